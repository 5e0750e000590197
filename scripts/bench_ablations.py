"""The SparPR paper's ablation table, under a kernel read throttle: full SparPR vs
--no-dynamic-budget, --quest-only, --no-recompute and --no-fallback, side by side.

Per variant, interleaved, with the disk tier's reads capped (bench/throttle.py; by default at the
laptop-balanced cap of bench_throttled.py):
- speed: OPT dummy weights (--model), batch --batch, --context, --gen-len, the KV cache all on the
  disk tier (O_DIRECT); latency, disk bytes and read requests, and SparPR's counts (blocks
  selected, copied, recomputed, fallbacks, ρ);
- fidelity: passkey needle on SmolLM2-135M-Instruct (prepared in the cache; `flexgen-sparpr
  prepare`) on the held-out split (texts asyoulik / plrabn12, depths 0.1 / 0.5 / 0.9, seed 1001:
  none of the rules was tuned on them), the KV cache on the same throttled disk tier, so each
  mechanism decides with the same costs as in the speed runs; hits per variant and dense's, and in
  how many trials the variant answers as dense does.

The paper's numbers beside ours (its Table: full .957, Quest-only .777, ... as quoted in the
issue). Writes <out>/ablations.json (each variant with the configuration its speed and needle
engines resolved, the engine commit) and <out>/ablations.md.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's engine, the one engine_commit() names
from flexgen_sparpr.bench.ablations import VARIANTS, needle_run, needle_trials, render_md  # noqa: E402
from flexgen_sparpr.bench.args import add_opt_bench_args, die, OneLineParser  # noqa: E402
from flexgen_sparpr.bench.results import engine_commit, machine_info, timer, write_results  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = OneLineParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=__doc__.split("\n\n", 1)[1])
    add_opt_bench_args(ap, gen_len=32)
    ap.add_argument("--context", type=int, default=2048, help="prompt length of the speed runs (default: 2048)")
    ap.add_argument("--read-mbps", type=float, default=None, help="read cap, MB/s (default: the balanced cap)")
    ap.add_argument("--needle-length", type=int, default=2048, help="needle prompt tokens (default: 2048)")
    ap.add_argument("--trials", type=int, default=6, help="needle trials (default: 6)")
    ap.add_argument("--needle-batch", type=int, default=3, help="needle prompts per prefill (default: 3)")
    ap.add_argument("--needle-block-size", type=int, default=16, help="KV block of the needle runs (default: 16)")
    ap.add_argument("--offload-dir", default="/tmp/offload-ablations", help="disk tier folder; removed (default: %(default)s)")
    ap.add_argument("--out", default=str(REPO / "results/sparpr"), help="output folder (default: %(default)s)")
    ap.add_argument("--stem", default="ablations", help="output file stem (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.trials < 1 or args.needle_batch < 1 or args.context < args.block_size or args.gen_len < 2:
        die("--trials and --needle-batch must be >= 1, --context >= --block-size, --gen-len >= 2")
    if args.read_mbps is not None and not args.read_mbps > 0:
        die(f"--read-mbps must be > 0 (got {args.read_mbps})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from flexgen_sparpr.bench.throttled_runs import HERE_HW, THERE_HW, cell, engine_run
    from flexgen_sparpr.bench.offload import opt_source
    from transformers import AutoTokenizer
    from flexgen_sparpr.bench.balance import balanced_read
    from flexgen_sparpr.bench.needle_prompt import passkey_hit
    from flexgen_sparpr.bench.throttle import open_throttle
    from flexgen_sparpr.bench.latency_model import hardware_file
    from flexgen_sparpr.weights.resolve import resolve_source, smollm2_dir

    d = smollm2_dir()
    if not (d / "config.json").exists():
        die(f"SmolLM2-135M is not prepared at {d} (flexgen-sparpr prepare)")
    tok = AutoTokenizer.from_pretrained(str(d))
    small = resolve_source(str(d), "")
    trials = needle_trials(tok, args.trials, args.needle_length)
    mbps = args.read_mbps or round(balanced_read(hardware_file(HERE_HW), hardware_file(THERE_HW), (0, 95, 5)).read_mbps, 1)
    opt = opt_source(args.model, args.context + args.gen_len, 0)
    offload = Path(args.offload_dir).expanduser()
    offload.mkdir(parents=True, exist_ok=True)
    args.offload_dir = str(offload)
    os.environ["FLEXGEN_SPARPR_CACHE"] = str(offload / "probe-cache")  # SparPR probes the disk under the cap
    rows, th = {}, None
    try:
        th, note = open_throttle(mbps, offload)
        if th is not None:
            th.attach(os.getpid())
        with timer() as wall:
            # warm-up: SparPR's first engine probes the disk and the matmuls under the cap (not timed)
            engine_run(opt, args, 4 * args.block_size, 2, "sparpr", 0)
            dense_answers, dense_resolved = needle_run(small, tok, trials, args, "dense", {})
            dense_hits = [passkey_hit(a, t.key) for a, t in zip(dense_answers, trials)]
            for name, extra in VARIANTS.items():
                r = engine_run(opt, args, args.context, args.gen_len, "sparpr", 0, extra)
                c = cell(name, r, None, mbps * 1e6 if th is not None else None)
                ans, needle_resolved = needle_run(small, tok, trials, args, "sparpr",
                                                  dict(keep_ratio=args.keep_ratio, min_keep=args.min_keep,
                                                       gamma=args.gamma, probe_dir=args.offload_dir, **extra))
                hits = [passkey_hit(a, t.key) for a, t in zip(ans, trials)]
                c.update(needle_hits=sum(hits), needle_trials=len(trials),
                         same_as_dense=sum(a == b for a, b in zip(hits, dense_hits)), answers=ans,
                         resolved={"speed": c["resolved"], "needle": needle_resolved})  # needle: one per prefill
                rows[name] = c
                print(f"{name}: e2e {c['e2e_s']:.1f} s, disk {c['disk_read_bytes'] / 1e6:.0f} MB, "
                      f"needle {sum(hits)}/{len(trials)}", flush=True)
    finally:
        if th is not None:
            th.close()
        shutil.rmtree(offload, ignore_errors=True)
    payload = {"config": {**vars(args), "engine_commit": engine_commit()}, "machine": machine_info(),
               "read_mbps": mbps, "throttled": th is not None, "note": note, "dense_needle_hits": sum(dense_hits),
               "dense_answers": dense_answers, "dense_needle_resolved": dense_resolved,
               "variants": rows, "wall_s": wall()}
    for p in write_results(Path(args.out), args.stem, payload, render_md(payload)):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    from flexgen_sparpr.utils.guard import guarded
    sys.exit(guarded(main))
