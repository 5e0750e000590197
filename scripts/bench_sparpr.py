"""SparPR vs this engine's dense offload: OPT with dummy weights, the whole KV cache on the disk
tier with the page cache bypassed (O_DIRECT) unless placed otherwise, one run; with --upstream,
upstream FlexGen at the same placement too (on CUDA as shipped, on the CPU patched).

For every context length both policies run the same random prompts (batch --batch, no padding)
in a fresh engine each: prefill, then --gen-len - 1 decode steps, greedy.

  end-to-end latency = prefill + decode seconds;  throughput = batch * gen_len / latency
  bytes per token    = bytes into the compute device during decode (disk->cpu, and cpu->compute on
                       CUDA: weights too) / (batch * (gen_len - 1));  ratio = SparPR / dense
  I/O bound ratio    = median decode step / (disk->cpu bytes per step / measured disk bandwidth)

The disk bandwidth is the engine's own: its timed O_DIRECT block reads in that run
(`counters.bandwidth("disk", "cpu")`). A ratio near 1 means the step is its disk reads; above
1, compute and overheads take the rest.

OPT's real position table stops at 2048 tokens; the dummy model's is sized to the longest
context + gen_len here, so the 4k and 8k rows time an OPT-shaped model beyond its trained range
(the timing, not the text, is what they measure). Writes <out>/bench.json (cells, each with the
configuration its engine resolved, + config with the engine commit + machine) and <out>/bench.md.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never contact a model hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's engine, the one engine_commit() names
from flexgen_sparpr.bench.args import add_opt_bench_args, die, int_list, OneLineParser  # noqa: E402
from flexgen_sparpr.bench.results import engine_commit, machine_info, timer, write_results  # noqa: E402
from flexgen_sparpr.bench.offload import opt_source  # noqa: E402
from flexgen_sparpr.bench.sparpr_offload import compare, render_md, run_cell, run_upstream_cell  # noqa: E402
from flexgen_sparpr.utils.progress import bars_wanted, progress  # noqa: E402

STEM = "bench"


def parse_args(argv=None) -> argparse.Namespace:
    ap = OneLineParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    add_opt_bench_args(ap, gen_len=32)
    ap.add_argument("--cache-gpu-percent", type=float, default=0,
                    help="share of the KV cache kept on the compute tier, a memory cap (default: 0, all on disk)")
    ap.add_argument("--cache-cpu-percent", type=float, default=0,
                    help="share of the KV cache on the CPU tier; the rest is on disk (default: 0)")
    ap.add_argument("--w-gpu-percent", type=float, default=100,
                    help="share of the weights on the compute tier (default: 100)")
    ap.add_argument("--w-cpu-percent", type=float, default=0,
                    help="share of the weights on the CPU tier; the rest is on disk (default: 0)")
    ap.add_argument("--gpu-mem", type=float, default=None,
                    help="cap the CUDA device at this many GiB, as a card that size (default: no cap)")
    ap.add_argument("--upstream", action="store_true",
                    help="also run upstream FlexGen (flexgen==0.1.8) at the same placement, batch and lengths: "
                         "unpatched on CUDA, with the CPU patches on the CPU")
    ap.add_argument("--offload-dir", default="~/flexgen_offload_dir", help="disk tier folder (default: %(default)s)")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                    help="compute tier: auto is CUDA when there is one, else the CPU (default: auto)")
    ap.add_argument("--dtype", choices=["auto", "float16", "bfloat16", "float32"], default="auto",
                    help="auto: float16 on CUDA, float32 on the CPU (default: auto)")
    ap.add_argument("--speculative-prefetch", action="store_true",
                    help="SparPR gathers its next layer's blocks from a guessed query while a layer computes "
                         "(one GPU batch; the engine's --speculative-prefetch)")
    ap.add_argument("--upstream-timeout", type=int, default=600, help="seconds per upstream run (default: 600)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the dummy weights and prompts (default: 0)")
    ap.add_argument("--out", default=str(REPO / "results" / "sparpr"), help="output folder (default: results/sparpr)")
    args = ap.parse_args(argv)
    try:
        args.contexts = int_list(args.contexts)
    except ValueError:
        die(f"--contexts must be a comma-separated list of positive integers (got {args.contexts!r})")
    if args.batch < 1 or args.block_size < 1:
        die("--batch and --block-size must be >= 1")
    if args.gpu_batches < 1 or args.batch % args.gpu_batches:
        die(f"--gpu-batches must be >= 1 and divide --batch (got {args.gpu_batches} for batch {args.batch})")
    if args.gen_len < 2:
        die(f"--gen-len must be >= 2 (decode excludes the prefill's token; got {args.gen_len})")
    for flag in ("keep_ratio", "min_keep", "gamma"):
        if not 0 < getattr(args, flag) <= 1:
            die(f"--{flag.replace('_', '-')} must be in (0, 1] (got {getattr(args, flag)})")
    for kind, (g, c) in (("cache", (args.cache_gpu_percent, args.cache_cpu_percent)),
                         ("w", (args.w_gpu_percent, args.w_cpu_percent))):
        if not (0 <= g <= 100 and 0 <= c <= 100 and g + c <= 100) or not (float(g).is_integer() and float(c).is_integer()):
            die(f"--{kind}-gpu-percent and --{kind}-cpu-percent must be whole numbers in [0, 100] (as --percent's) "
                "and sum to at most 100")
    if args.cache_gpu_percent == 100:
        die("--cache-gpu-percent must be below 100 (a resident cache is not an offload benchmark)")
    if args.gpu_mem is not None and args.gpu_mem <= 0:
        die(f"--gpu-mem must be > 0 GiB (got {args.gpu_mem})")
    if args.threads is not None and args.threads < 1:
        die(f"--threads must be >= 1 (got {args.threads})")
    if not args.model.lower().removeprefix("facebook/").startswith("opt-"):
        die(f"--model must be an OPT size such as opt-125m (got {args.model!r})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from flexgen_sparpr.weights.resolve import ModelNotFound

    if args.threads:
        torch.set_num_threads(args.threads)
    args.offload_dir = str(Path(args.offload_dir).expanduser())
    max_seq = max(args.contexts) + args.gen_len
    try:
        src = opt_source(args.model, max_seq, args.seed, args.device, args.dtype)
    except (ModelNotFound, ValueError) as exc:  # ConfigError is a ValueError
        die(str(exc))
    payload = {"config": {**vars(args), "engine_commit": engine_commit()}, "machine": machine_info(),
               "max_seq_len": max_seq, "cells": [], "summary": [], "upstream": []}
    cells = len(args.contexts) * (2 + bool(args.upstream))
    with timer() as total, progress(total=cells, desc="cells", unit="cell", enabled=bars_wanted(args.quiet)) as bar:
        for ctx in args.contexts:
            up = None
            if args.upstream:  # first, while this process holds no device memory of its own
                up = run_upstream_cell(args, ctx)
                payload["upstream"].append(up)
                bar.update()
                bar.write(f"ctx {ctx} upstream: " + (f"e2e {up['e2e_s']:.1f} s, decode {up['decode_tok_s']:.2f} tok/s"
                                                     if up.get("ok") else f"error: {up['error']}"))
            pair = {}
            for policy in ("dense", "sparpr"):
                try:
                    pair[policy] = run_cell(src, args, ctx, policy)
                except ValueError as exc:  # e.g. an unwritable --offload-dir
                    die(str(exc))
                c = pair[policy]
                bar.update()
                bar.write(f"ctx {ctx} {policy}: e2e {c['e2e_s']:.1f} s, decode {c['decode_tok_s']:.2f} tok/s, "
                          f"{c['bytes_per_token'] / 2**20:.1f} MiB/token")
                payload["cells"].append(c)
            payload["summary"].append(compare(pair["dense"], pair["sparpr"], up))
    payload["wall_s"] = total()
    payload["disk_modes"] = sorted({m for c in payload["cells"] for m in c["disk_mode"]})
    for p in write_results(Path(args.out), STEM, payload, render_md(payload)):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    from flexgen_sparpr.utils.guard import guarded
    sys.exit(guarded(main))  # one error line for any failure, signals included (utils/guard.py)
