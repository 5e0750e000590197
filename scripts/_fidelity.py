"""What the fidelity scripts (ppl.py, needle.py, frontier.py, dkv_speed.py) share: the split
flags, --dkv-exact-routed, the engine commit for the config and for each batch, and cutting a
plan into batches with stable ids (for resuming)."""
from __future__ import annotations

import json

from _common import die, engine_commit  # noqa: F401  (engine_commit: re-exported for the fidelity scripts)

from flexgen_sparpr.bench.texts import SPLITS, texts_of

# policy compositions the fidelity scripts sweep by default: SparPR reading DKV-coded blocks
# (what `--kv-policy sparpr --cold-codec dkv` stores)
COMPOSED = ("sparpr+dkv",)


def float_list(text: str) -> list[float]:
    vals = [float(v) for v in text.split(",") if v.strip()]
    if not vals:
        raise ValueError(text)
    return vals


def split_args(ap, depths: bool = False) -> None:
    """--split (tuning | held-out), --texts and --seed (default: the split's); with `depths`,
    --depths too. After parse_args, call resolve_split(args)."""
    ap.add_argument("--split", default="held-out", choices=list(SPLITS),
                    help="which texts/depths/seeds: held-out (reported results) or tuning (what rules were tuned on)")
    ap.add_argument("--texts", default="", help="comma list of texts of the split (default: all of the split's)")
    ap.add_argument("--seed", type=int, default=None, help="default: the split's")
    if depths:
        ap.add_argument("--depths", type=float_list, default=None,
                        help="needle depths, trial i uses depths[i %% n] (default: the split's)")


def exact_routed_arg(ap) -> None:
    """--dkv-exact-routed E (>= 0): the dkv engine's E routed blocks read raw and attended exactly
    (the policy's --dkv-exact-routed; its raw copies in host memory)."""
    def count(text: str) -> int:
        if not text.isdigit():
            raise ValueError(text)  # argparse: "invalid count value", one line
        return int(text)
    count.__name__ = "count"
    ap.add_argument("--dkv-exact-routed", type=count, default=0, metavar="E",
                    help="the dkv engine's E routed blocks of most mass read raw and attended exactly (0: none)")


def resolve_split(args) -> None:
    """Fill args.text_objs, args.seed (and args.depths, if the parser has them) from the split."""
    sp = SPLITS[args.split]
    try:
        args.text_objs = texts_of(args.split, [t for t in args.texts.split(",") if t])
    except ValueError as e:
        die(str(e))
    args.seed = sp.seed if args.seed is None else args.seed
    if hasattr(args, "depths"):
        args.depths = list(sp.depths) if args.depths is None else args.depths
        if not all(0 <= d <= 1 for d in args.depths):
            die(f"--depths must be in [0, 1] (got {args.depths})")


def plan_batches(items: dict, batch: int) -> list[tuple[str, object, list]]:
    """{key: [item, ...]} (key: a length, or a (task, length) tuple) -> [(id, key, chunk)]: the
    shorter lengths first, and within a length round-robin over the keys (a time limit leaves
    the short lengths complete and every task with some trials); ids "<key>:<index of the
    chunk's first item>", e.g. "2048:5" or "passkey:2048:5" (stable across runs: for resuming)."""
    def name(key) -> str:
        return ":".join(map(str, key)) if isinstance(key, tuple) else str(key)

    def length(key) -> int:
        return key[-1] if isinstance(key, tuple) else key
    out = []
    for k, xs in items.items():
        for j, i in enumerate(range(0, len(xs), batch)):
            out.append((length(k), j, name(k), (f"{name(k)}:{i}", k, xs[i:i + batch])))
    return [b for *_, b in sorted(out, key=lambda o: o[:3])]


def resumed_batches(old: dict | None) -> list[dict]:
    """A partial results file's batches, each naming the engine commit it ran under ("engine"):
    a file written before batches named theirs gets its config's commit, the only one it kept
    (the last run's: a resumed run rewrites the config)."""
    if not old:
        return []
    commit = old.get("config", {}).get("engine_commit", "unknown")
    return [dict(b, engine=b.get("engine", commit)) for b in old["batches"]]


def engines(batches: list[dict], current: str) -> str:
    """Which engine commits ran the batches, for a report: "a7e49b6" or "a7e49b6 (6 batches),
    5973f20 (6 batches)" in the order they first ran; `current` where no batch ran yet."""
    count: dict[str, int] = {}
    for b in batches:
        c = b.get("engine", current)
        count[c] = count.get(c, 0) + 1
    if len(count) <= 1:
        return next(iter(count), current)
    return ", ".join(f"{c} ({n} batch{'es' if n != 1 else ''})" for c, n in count.items())


def resolved_config(cfgs, device: str, block_size: int, dkv_block: int, dkv_args: dict | None = None) -> dict:
    """What a run's configurations resolve to, for its config: the compute and KV dtypes the
    engine picks on `device` (EngineConfig's "auto"), the placement (every block on the compute
    tier: Policy's default percents), and each configuration's KV block and every knob of its
    policy after the policy resolved them (SparPR's summary "auto" -> lowrank, the floor it runs
    with, ...); a composition "A+C" also lists the knobs of the codec policy C storing its blocks."""
    import torch

    from flexgen_sparpr.bench.sweep import RAW, new_policy
    from flexgen_sparpr.engine.config import EngineConfig, Policy
    from flexgen_sparpr.kv.knobs import knobs
    from flexgen_sparpr.kv.policies import make_policy

    def knob_values(p) -> dict:
        return {k.name: getattr(p, k.name) for k in knobs(type(p))}
    ec = EngineConfig(device=device, block_size=block_size)
    compute = ec.torch_dtype(torch.device(device))
    pl = Policy()
    out = {"compute_dtype": str(compute).removeprefix("torch."),
           "kv_dtype": str(ec.torch_kv_dtype(compute)).removeprefix("torch.") + " (raw blocks on the CPU/disk tiers; "
           "none here: every block is on the compute tier, in the compute dtype)",
           "placement": {"weights": list(pl.weight_percents), "cache": list(pl.cache_percents)},
           "configs": {}}
    for c in cfgs:
        p = new_policy(c, dkv_args)
        entry = {"family": c.family, "block_size": block_size if c.family == RAW else dkv_block,
                 "policy": type(p).name, **knob_values(p)}
        _, codec = c.parts
        if codec:
            entry["codec"] = {"policy": codec, **knob_values(make_policy(codec, **(dkv_args or {})))}
        out["configs"][c.label] = entry
    return out


def resolved_lines(cfg: dict) -> list[str]:
    """A report's section on its config's "resolved" entry (resolved_config): the engine's
    dtypes and placement, then one line per configuration; none for a config without it."""
    res = cfg.get("resolved")
    if not res:
        return []
    head = {k: v for k, v in res.items() if k != "configs"}
    return ["## Resolved configuration", "", f"Engine on {cfg.get('device', '?')}: `{json.dumps(head)}`", "",
            *[f"- {label}: `{json.dumps(c, default=str)}`" for label, c in res["configs"].items()], ""]
