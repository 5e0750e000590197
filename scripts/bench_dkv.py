"""DKV on SmolLM2-135M-Instruct: compression per block, passkey retrieval, decode speed and
prefill time, for dense, dkv, dkv with block-sparse prefill, and sparpr with DKV cold blocks.

Each configuration prefills its own batch (their caches differ in form): dense and dkv keep the
cache on the compute tier; sparpr and sparpr+dkv keep it on the disk tier (O_DIRECT; raw, or in
DKV form there) and decode once per keep ratio from one prefill. Writes <out>/bench.{json,md}.
"""
from __future__ import annotations

import os
import random
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's engine, the one engine_commit() names
from flexgen_sparpr.bench.args import die, int_list, OneLineParser  # noqa: E402
from flexgen_sparpr.bench.results import machine_info, md_table, timer, write_results  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from flexgen_sparpr.bench.needle_prompt import NeedlePrompts, passkey_hit, random_key  # noqa: E402
from flexgen_sparpr.engine.config import EngineConfig, Policy  # noqa: E402
from flexgen_sparpr.engine.executor import Engine  # noqa: E402
from flexgen_sparpr.kv.dkv.codec import PICKS, DKVCodec  # noqa: E402
from flexgen_sparpr.kv.policies import make_policy  # noqa: E402
from flexgen_sparpr.models.spec import opt_spec  # noqa: E402
from flexgen_sparpr.weights.resolve import resolve_source  # noqa: E402

CONFIGS = ("dense", "dkv", "dkv-sparse-prefill", "sparpr", "sparpr+dkv")


def parse_args(argv=None):
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int_list, default=[2048, 4096, 8192])
    ap.add_argument("--trials", type=int, default=4, help="prompts per length (one batch)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    ap.add_argument("--keep", default="0.5,0.1", help="sparpr keep ratios (comma list)")
    ap.add_argument("--block", type=int, default=256, help="--dkv-block")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--residuals", type=int, default=16)
    ap.add_argument("--residual-pick", default="attention", choices=list(PICKS),
                    help="which rows a block keeps exact (--dkv-residual-pick)")
    ap.add_argument("--pick-follow", type=int, default=None,
                    help="dkv: a token inherits the pick score of this many tokens before it (default: the policy's)")
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--dense-layers", type=int, default=0)
    ap.add_argument("--route", default="lowrank", choices=["lowrank", "mean"], help="dkv block routing")
    ap.add_argument("--gen-len", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--depths", default="0.25,0.75,0.5,0.1,0.9",
                    help="needle depths, trial i uses depths[i %% n]; 0.25,0.75 with the same --seed gives "
                         "scripts/needle.py's prompts (default: %(default)s)")
    ap.add_argument("--offload-dir", default=None, help="disk tier folder (default: a temporary one)")
    ap.add_argument("--out", default=str(REPO / "results/dkv"))
    args = ap.parse_args(argv)
    args.configs = [c for c in args.configs.split(",") if c]
    args.keep = [float(k) for k in args.keep.split(",") if k]
    try:
        args.depths = [float(x) for x in args.depths.split(",") if x]
    except ValueError:
        die(f"--depths must be a comma list of numbers in [0, 1] (got {args.depths!r})")
    if not args.depths or not all(0 <= x <= 1 for x in args.depths):
        die(f"--depths must be a comma list of numbers in [0, 1] (got {args.depths})")
    if set(args.configs) - set(CONFIGS):
        die(f"unknown configs {sorted(set(args.configs) - set(CONFIGS))} (known: {', '.join(CONFIGS)})")
    if args.trials < 1 or args.gen_len < 1 or not all(0 < k <= 1 for k in args.keep):
        die("--trials and --gen-len must be >= 1 and --keep values in (0, 1]")
    return args


def compression_rows(block: int, rank: int, residuals: int) -> list[list]:
    """Bytes of one KV block (one sequence, one layer) dense vs DKV, for SmolLM2 and OPT shapes."""
    shapes = {"smollm2-135m": (3, 64)}
    for name in ("opt-125m", "opt-1.3b", "opt-6.7b"):
        spec = opt_spec(name)
        shapes[name] = (spec.num_kv_heads, spec.head_dim)
    rows = []
    for name, (hkv, d) in shapes.items():
        for dtype in (torch.float16, torch.float32):
            c = DKVCodec((2, 1, hkv, block, d), dtype, rank, residuals)
            rows.append([name, str(dtype).split(".")[1], f"2x{hkv}x{d}", c.dense_nbytes(), c.nbytes,
                         round(c.dense_nbytes() / c.nbytes, 2)])
    return rows


def engine_for(src, config: str, args, batch: int, offload: str) -> Engine:
    dkv = {"rank": args.rank, "residuals": args.residuals, "residual_pick": args.residual_pick}
    if config == "dense":
        cfg = EngineConfig(device="cpu", block_size=args.block)
    elif config.startswith("dkv"):
        cfg = EngineConfig(device="cpu", block_size=args.block, kv_policy="dkv",
                           policy_args=dkv | {"topk": args.topk, "dense_layers": args.dense_layers, "route": args.route,
                                              "sparse_prefill": config == "dkv-sparse-prefill"}
                           | ({"pick_follow": args.pick_follow} if args.pick_follow is not None else {}))
    else:  # sparpr decodes from a dense-policy prefill of a disk cache (raw, or in DKV form)
        cold = {"cold_codec": "dkv", "codec_args": dkv} if config == "sparpr+dkv" else {}
        cfg = EngineConfig(device="cpu", block_size=args.block, offload_dir=offload, direct_io=True, **cold)
    pol = Policy(gpu_batch_size=batch, cache_gpu_percent=0 if config.startswith("sparpr") else 100)
    return Engine(src, pol, cfg)


def answers(res, trials, tok, eos) -> list[dict]:
    out = []
    for trial, toks in zip(trials, res.tokens):
        toks = toks[:toks.index(eos)] if eos in toks else toks
        text = tok.decode(toks, skip_special_tokens=True)
        out.append({"key": trial.key, "depth": trial.depth, "answer": text, "hit": passkey_hit(text, trial.key)})
    return out


def run_config(src, config, args, trials, tok, offload) -> list[dict]:
    eos, recs = src.spec.eos_id, []
    with engine_for(src, config, args, len(trials), offload) as eng:
        runs = [(config, None)] if not config.startswith("sparpr") else [(f"{config}@{k}", k) for k in args.keep]
        observers = tuple(make_policy("sparpr", keep_ratio=k, probe_dir=offload) for _, k in runs if k)
        with timer() as t_pre:
            st = eng.prefill([t.ids for t in trials], args.gen_len, observers=observers)
        prefill_s = t_pre()
        snap = eng.snapshot(st)
        for (name, _), pol in zip(runs, observers or (None,)):
            if pol is not None:
                eng.set_kv_policy(pol, attach=False)
            res = eng.decode(eng.restore(snap), stop=eos)  # the answers (and a warm-up for the timing)
            before = eng.devices.counters.snapshot().get("disk->cpu", 0)
            with timer() as t_dec:  # the same decode again, timed, without the stop token
                timed = eng.decode(eng.restore(snap))
            steps = max(1, len(timed.step_times) - 1)
            recs.append({"config": name, "length": len(trials[0].ids), "prefill_s": round(prefill_s, 2),
                         "decode_s": round(t_dec(), 3), "decode_tok_s": round(len(trials) * steps / t_dec(), 2),  # all sequences, gen_len - 1 steps
                         "decode_steps": steps,
                         "disk_read_bytes": eng.devices.counters.snapshot().get("disk->cpu", 0) - before,
                         "stats": eng.kv_policy.stats() if hasattr(eng.kv_policy, "stats") else None,
                         "trials": answers(res, trials, tok, eos)})
            print(f"{name} @ {recs[-1]['length']}: {sum(t['hit'] for t in recs[-1]['trials'])}/{len(trials)} "
                  f"prefill {prefill_s:.1f}s decode {recs[-1]['decode_tok_s']} tok/s", flush=True)
    return recs


def render(payload) -> str:
    a = payload["config"]
    lines = [f"# DKV on SmolLM2-135M-Instruct ({a['trials']} passkey trials per length)\n",
             f"Block {a['block']} tokens, rank {a['rank']}, {a['residuals']} residual rows, top-{a['topk']} "
             f"routed blocks (routing: {a['route']}), residual pick {a.get('residual_pick', 'error')}, one exact recent "
             f"block. CPU float32, {payload['machine']['cpu_count']} cores, "
             f"load average {payload['machine']['load_average']}. Command: `{payload['command']}`.\n",
             "## Bytes per KV block (one sequence, one layer; the codec's formula)\n",
             md_table(["model", "dtype", "K|V heads x dim", "dense B", "DKV B", "dense / DKV"], payload["compression"]),
             "\n## Passkey retrieval, decode speed, prefill time\n"]
    rows = []
    for r in payload["runs"]:
        hits = sum(t["hit"] for t in r["trials"])
        rows.append([r["config"], r["length"], f"{hits}/{len(r['trials'])}", r["prefill_s"], r["decode_tok_s"],
                     r["disk_read_bytes"]])
    lines.append(md_table(["config", "context", "exact key", "prefill s", "decode tok/s", "disk->cpu B (decode)"],
                          rows))
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    src = resolve_source("smollm2-135m", "")
    tok = AutoTokenizer.from_pretrained(src.tokenizer_dir)
    builder = NeedlePrompts(tok, REPO / "tests/data/alice29.txt", "The secret passkey is")
    rng = random.Random(args.seed)
    depths = args.depths
    plans = {n: [builder.build(n, depths[i % len(depths)], random_key(rng, 5), rng) for i in range(args.trials)]
             for n in args.lengths}
    payload = {"config": {k: v for k, v in vars(args).items()}, "command": " ".join(["scripts/bench_dkv.py", *(argv or
               sys.argv[1:])]), "machine": machine_info(), "compression": compression_rows(args.block, args.rank,
               args.residuals), "runs": []}
    with tempfile.TemporaryDirectory(dir=args.offload_dir) as offload, timer() as wall:
        for n in args.lengths:
            for config in args.configs:
                payload["runs"] += run_config(src, config, args, plans[n], tok, offload)
                payload["wall_s"] = round(wall(), 1)
                write_results(Path(args.out), "bench", payload, render(payload))
    print(f"wrote {args.out}/bench.json and bench.md in {payload.get('wall_s', 0)} s")


if __name__ == "__main__":
    from flexgen_sparpr.utils.guard import guarded
    sys.exit(guarded(main))  # one error line for any failure, signals included (utils/guard.py)
