"""Passkey retrieval, the SparPR paper's fidelity task, on SmolLM2-135M-Instruct: dense attention
against every registered KV policy at several context lengths and keep ratios.

Each batch of trials is prefilled once; every policy observes that prefill and decodes from a
snapshot of it. Writes <out>/needle.json (config + every trial), needle.md and needle.png.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import OneLineParser, REPO, die, int_list, machine_info, timer, write_results  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from flexgen_sparpr.bench.needle_prompt import NeedlePrompts, passkey_hit, random_key  # noqa: E402
from flexgen_sparpr.engine.config import EngineConfig, Policy  # noqa: E402
from flexgen_sparpr.engine.executor import Engine  # noqa: E402
from flexgen_sparpr.kv.policies.h2o import H2O  # noqa: E402
from flexgen_sparpr.kv.policies import POLICIES, make_policy  # noqa: E402
from flexgen_sparpr.weights.resolve import resolve_source  # noqa: E402

# the paper's scores (2k / 4k / 8k contexts), quoted beside ours
PAPER = {
    ("sparpr", 0.5): ".943 / .879 / .780", ("sparpr", 0.1): ".600 / .482 / .308",
    ("h2o", 0.5): "≈ .49–.51", ("h2o", 0.1): "≈ .12",
    ("streaming-llm", 0.5): "≈ .45–.49", ("streaming-llm", 0.1): "≈ .02",
    ("quest", 0.5): ".777 (Quest-only ablation)", ("quest", 0.1): ".777 (Quest-only ablation)",
    ("dense", 1.0): "≈ 1.0 (task statement)",
}
PAPER_CURVES = {("sparpr", 0.5): [.943, .879, .780], ("sparpr", 0.1): [.600, .482, .308]}


def engine_commit() -> str:
    """The engine's git commit (+ "-dirty" with local changes), for the config."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "flexgen_sparpr"], cwd=REPO, capture_output=True,
                               text=True).stdout.strip()
        return rev.stdout.strip() + ("-dirty" if dirty else "")
    except OSError:
        return "unknown"


def scores(trials):
    """(policy, keep, length) -> (hits, n)."""
    acc = {}
    for r in trials:
        h, n = acc.get((r["policy"], r["keep"], r["length"]), (0, 0))
        acc[(r["policy"], r["keep"], r["length"])] = (h + r["hit"], n + 1)
    return acc


def render(payload, png: Path) -> str:
    """The markdown report (and the plot beside it)."""
    cfg, acc = payload["config"], scores(payload["trials"])
    lengths = sorted({k[2] for k in acc})
    rows = sorted({k[:2] for k in acc}, key=lambda pk: (pk[0] != "dense", -pk[1], pk[0]))
    head = "| policy | keep | " + " | ".join(f"{n} tok" for n in lengths) + " | paper (2k / 4k / 8k) |"
    lines = [head, "|" + "---|" * (len(lengths) + 3)]
    for pol, keep in rows:
        cells = [f"{acc[(pol, keep, n)][0] / acc[(pol, keep, n)][1]:.2f} ({acc[(pol, keep, n)][1]})"
                 if (pol, keep, n) in acc else "–" for n in lengths]
        lines.append(f"| {pol} | {keep:g} | " + " | ".join(cells) + f" | {PAPER.get((pol, keep), '–')} |")
    for keep in cfg["keep"]:
        if ("sparpr", keep) not in rows:  # not measured (not implemented when this ran)
            lines.append(f"| sparpr | {keep:g} | " + " | ".join("paper only" for _ in lengths)
                         + f" | {PAPER.get(('sparpr', keep), '–')} |")
    plot(acc, lengths, cfg["keep"], png)
    return "\n".join([
        "# Passkey retrieval (needle) on SmolLM2-135M-Instruct", "",
        "Score = fraction of trials whose answer contains the key as a whole number (trials in "
        "brackets). Keep = fraction of the context's KV tokens attention may read per step "
        "(sinks and recent window inside it; the step's own new token on top). Prefill dense; "
        "one prefill per batch serves every policy. Paper: the SparPR paper's needle task at "
        "2k/4k/8k; a 'paper only' row was not measured in this run.", "",
        *lines, "",
        f"Wall time: {payload['wall_s']} s. Plot: {png.name}.", "",
        *([f"Not run (time limit): {json.dumps(payload['skipped'])}", ""] if payload.get("skipped") else []),
        *([f"Engine: {cfg['engine_commit']}.", ""] if cfg.get("engine_commit") else []),
        *([f"Engine workaround during the run: {cfg['engine_workaround']}.", ""]
          if cfg.get("engine_workaround") else []),
        "## Config", "", "```json", json.dumps({k: v for k, v in cfg.items() if k != "machine"},
                                               indent=1, default=str), "```", "",
        "Machine: " + json.dumps(cfg.get("machine"), default=str), ""])


def plot(acc, lengths, keeps, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(keeps), figsize=(5 * len(keeps), 3.8), squeeze=False)
    for ax, keep in zip(axes[0], keeps):
        pols = sorted({p for p, k, _ in acc if k in (keep, 1.0)}, key=lambda p: (p != "dense", p))
        for i, pol in enumerate(pols):
            k = 1.0 if pol == "dense" else keep
            xs = [n for n in lengths if (pol, k, n) in acc]
            shift = 2 ** (0.04 * (i - len(pols) / 2))  # side by side where scores coincide
            style = dict(color="0.6", lw=4, alpha=0.5) if pol == "dense" else dict(marker="os^Dv<>"[i % 7])
            ax.plot([x * shift for x in xs], [acc[(pol, k, n)][0] / acc[(pol, k, n)][1] for n in xs],
                    label=pol, **style)
        if ("sparpr", keep) in PAPER_CURVES:
            ax.plot([2048, 4096, 8192], PAPER_CURVES[("sparpr", keep)], "k:", marker="x", label="SparPR (paper)")
        ax.set(title=f"keep {keep:g}", xlabel="context tokens", ylabel="passkey accuracy", ylim=(-0.05, 1.05))
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(set(lengths) | {2048, 4096, 8192}))
        ax.set_xticklabels([f"{n // 1024}k" if n >= 1024 else str(n) for n in ax.get_xticks()])
        ax.legend(fontsize=7)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)


def float_list(text: str) -> list[float]:
    vals = [float(v) for v in text.split(",") if v.strip()]
    if not vals:
        raise ValueError(text)
    return vals


def parse_args(argv=None):
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--filler", default=str(REPO / "tests/data/alice29.txt"))
    ap.add_argument("--depths", type=float_list, default=[0.25, 0.75], help="trial i uses depths[i %% n]")
    ap.add_argument("--key-digits", type=int, default=5)
    ap.add_argument("--lengths", type=int_list, default=[2048, 4096, 8192], help="prompt tokens")
    ap.add_argument("--keep", type=float_list, default=[0.5, 0.1], help="keep ratios")
    ap.add_argument("--policies", default="", help="comma list (default: every registered but dense)")
    ap.add_argument("--trials", type=int, default=10, help="trials per context length")
    ap.add_argument("--trials-at", default="", help="per-length overrides, e.g. 8192:6")
    ap.add_argument("--batch", type=int, default=5, help="prompts per prefill (the GPU batch)")
    ap.add_argument("--block-size", type=int, default=16, help="KV block tokens (Quest's page size)")
    ap.add_argument("--answer-prefix", default="The secret passkey is",
                    help="text that opens the assistant turn (RULER-style answer prefix)")
    ap.add_argument("--max-minutes", type=float, default=0, help="start no batch after this (0: no limit)")
    ap.add_argument("--gen-len", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=str(REPO / "results/needle"))
    args = ap.parse_args(argv)
    # policies that store their own cache form (DKV) cannot share the dense prefill: scripts/bench_dkv.py
    shared = sorted(n for n in POLICIES if n != "dense" and not POLICIES[n].attends)
    names = [p for p in args.policies.split(",") if p] or shared
    for n in names:
        if n not in shared:
            die(f"policy {n!r} cannot observe a shared dense prefill (these can: {', '.join(shared)})")
    args.policy_names = names
    args.trials_by_len = {n: args.trials for n in args.lengths}
    for item in filter(None, args.trials_at.split(",")):
        length, n = (int(v) for v in item.split(":"))
        args.trials_by_len[length] = n
    if args.key_digits < 1 or args.batch < 1 or args.gen_len < 1:
        die("--key-digits, --batch and --gen-len must be >= 1")
    return args


def build_policies(names, keeps):
    """One instance per (policy, keep ratio); they all observe the same prefill."""
    return {(n, k): make_policy(n, keep_ratio=k) for n in names for k in keeps}


def run_batch(eng, trials, pols, gen_len, eos, tok):
    """Prefill the batch once, decode it densely and with every policy. Returns records, times."""
    dense = make_policy("dense")
    eng.set_kv_policy(dense, attach=False)  # the engine's own policy must not also be an observer
    h2os = [p for p in pols.values() if isinstance(p, H2O)]
    observers = tuple(p for p in pols.values() if p not in h2os[1:])
    with timer() as t_pre:
        st = eng.prefill([t.ids for t in trials], gen_len, observers=observers)
    for p in h2os[1:]:
        p.adopt_prefill(h2os[0], eng.tables.values())  # same prefill statistics, other budget
    snap = eng.snapshot(st)
    records, times = [], {"prefill_s": round(t_pre(), 2)}
    for (name, keep), pol in [(("dense", 1.0), dense), *pols.items()]:
        eng.set_kv_policy(pol, attach=False)
        with timer() as t_dec:
            res = eng.decode(eng.restore(snap), stop=eos)
        times[f"{name}@{keep}"] = round(t_dec(), 2)
        for trial, toks in zip(trials, res.tokens):
            toks = toks[:toks.index(eos)] if eos in toks else toks
            answer = tok.decode(toks, skip_special_tokens=True)
            records.append({"policy": name, "keep": keep, "length": len(trial.ids), "depth": trial.depth,
                            "key": trial.key, "answer": answer, "hit": passkey_hit(answer, trial.key),
                            "start": trial.start, "needle_at": trial.needle_at})
    return records, times


def main(argv=None) -> None:
    args = parse_args(argv)
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    src = resolve_source(args.model, "")
    tok = AutoTokenizer.from_pretrained(src.tokenizer_dir)
    builder = NeedlePrompts(tok, Path(args.filler), args.answer_prefix)
    eos = src.spec.eos_id
    rng = random.Random(args.seed)
    config = {k: v for k, v in vars(args).items() if k not in ("trials_at",)}
    config |= {"model_dir": str(src.tokenizer_dir), "engine_commit": engine_commit(), "machine": machine_info()}
    plans = {n: [builder.build(n, args.depths[i % len(args.depths)], random_key(rng, args.key_digits), rng)
                 for i in range(args.trials_by_len[n])] for n in args.lengths}
    # round-robin over lengths, so a time limit leaves every length with trials
    todo = [(n, plans[n][i:i + args.batch]) for i in range(0, max(map(len, plans.values())), args.batch)
            for n in args.lengths if plans[n][i:i + args.batch]]
    records, batches, skipped, engines = [], [], [], {}
    out = Path(args.out)
    payload = {"config": config, "wall_s": 0.0, "batches": batches, "skipped": skipped, "trials": records}
    with timer() as wall:
        for length, chunk in todo:
            if args.max_minutes and wall() > 60 * args.max_minutes:
                skipped.append({"length": length, "trials": len(chunk)})
                continue
            if len(chunk) not in engines:
                engines[len(chunk)] = Engine(src, Policy(gpu_batch_size=len(chunk)),
                                             EngineConfig(device=args.device, block_size=args.block_size))
            pols = build_policies(args.policy_names, args.keep)
            recs, times = run_batch(engines[len(chunk)], chunk, pols, args.gen_len, eos, tok)
            records += recs
            batches.append({"length": length, "trials": len(chunk), **times})
            hits = sum(r["hit"] for r in recs if r["policy"] == "dense")
            print(f"{length} tokens x {len(chunk)}: dense {hits}/{len(chunk)}, prefill {times['prefill_s']}s, "
                  f"elapsed {wall():.0f}s", flush=True)
            payload = {"config": config, "wall_s": round(wall(), 1), "batches": batches, "skipped": skipped,
                       "trials": records}
            write_results(out, "needle", payload, render(payload, out / "needle.png"))
    for eng in engines.values():
        eng.close()
    payload["wall_s"] = round(wall(), 1)
    if skipped:
        print(f"time limit: skipped {sum(b['trials'] for b in skipped)} trials: {skipped}")
    paths = write_results(out, "needle", payload, render(payload, out / "needle.png"))
    print(f"wrote {', '.join(str(p) for p in paths)}, {out / 'needle.png'}")
    print(f"total wall time: {wall():.1f}s")


if __name__ == "__main__":
    from flexgen_sparpr.cli.guard import guarded
    sys.exit(guarded(main))  # one error line for any failure, signals included (cli/guard.py)
