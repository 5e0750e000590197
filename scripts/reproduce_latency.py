"""Measured latency reproduction on this machine, and the validated time model (issue #6, parts 3-4).

One run, per context length (OPT with dummy weights, batch 4, the KV cache on the disk tier with
the page cache bypassed):

  upstream  upstream FlexGen 0.1.8, patched for the CPU (flexgen_sparpr/upstream), KV on disk
  dense     this engine, every KV block read each step
  sparpr    this engine, SparPR (keep ceiling --keep-ratio, floor --min-keep, gamma --gamma)
  hf        HF transformers + accelerate offload (device_map from max_memory under the cap):
            the stand-in for the systems that hold the KV cache on the compute device

The compute tier here is host memory, so its cap (--cap-gib) is imposed, not physical: HF's
weights get max_memory = cap - (its KV cache + activations) and accelerate offloads the rest to
disk; when the KV cache and activations alone exceed the cap the run is reported as OOM without
running (it would have to hold them on the device). The engine's peak RSS is measured and shown
beside the cap.

The time model (flexgen_sparpr/runtime/timemodel.py) is calibrated once on a separate pair of
runs at --calib-context, then predicts every measured run from its own trace and from the
analytic trace; the error per run is reported. Then it predicts OPT-6.7B at batch 4 on each
--predict-hardware file (results/latency_modeled_<name>.md). Writes results/latency_measured.
{json,md,png}; this machine's hardware file goes beside them.
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
from flexgen_sparpr.bench.latency_runs import (calibration_runs, report, rerun_model, run_engine,  # noqa: E402
                                               run_hf, run_upstream_cell, this_machine)
from flexgen_sparpr.bench.peers import GiB  # noqa: E402
from flexgen_sparpr.bench.results import engine_commit, load_average, machine_info, timer  # noqa: E402
from flexgen_sparpr.utils.progress import bars_wanted, progress  # noqa: E402

SYSTEMS = ("upstream", "dense", "sparpr", "hf")
PREDICT_HW = ("configs/hardware/rtx3070ti-laptop-8gb.yaml", "configs/hardware/t4-flexgen.yaml")


def parse_args(argv=None) -> argparse.Namespace:
    ap = OneLineParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    add_opt_bench_args(ap, gen_len=8)
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="subset of %(default)s")
    ap.add_argument("--cap-gib", type=float, default=1.0, help="compute-tier memory cap in GiB (default: 1.0)")
    ap.add_argument("--upstream-timeout", type=float, default=480,
                    help="seconds before upstream FlexGen is stopped; longer contexts are then skipped (default: 480)")
    ap.add_argument("--calib-contexts", default="512,3072",
                    help="contexts of the calibration pairs, after one discarded warm-up run (default: %(default)s)")
    ap.add_argument("--hardware", help="this machine's hardware file (default: measure it, quick profile)")
    ap.add_argument("--predict-hardware", default=",".join(PREDICT_HW), help="hardware files to predict OPT-6.7B on")
    ap.add_argument("--predict-gen-len", type=int, default=32, help="gen_len of the modeled runs (default: 32)")
    ap.add_argument("--offload-dir", default="~/flexgen_offload_dir", help="disk tier folder (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the dummy weights and prompts (default: 0)")
    ap.add_argument("--from-json", help="re-run the model and the reports on a saved latency_measured.json")
    ap.add_argument("--recalibrate", action="store_true",
                    help="with --from-json: run the warm-up and calibration runs again (the saved fit is kept)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: context 128, gen_len 2, calibration at 64, the cached probe as hardware")
    ap.add_argument("--out", default=str(REPO / "results"), help="output folder (default: results)")
    args = ap.parse_args(argv)
    if args.quick:  # a smoke test of every path, well under a minute on 2 cores
        args.contexts, args.gen_len, args.calib_contexts = "128", 2, "64"
    try:
        args.contexts = int_list(args.contexts)
        args.calib_contexts = int_list(args.calib_contexts)
    except ValueError:
        die("--contexts and --calib-contexts must be comma-separated lists of positive integers")
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in args.systems if s not in SYSTEMS]
    if bad or not args.systems:
        die(f"--systems must be a subset of {','.join(SYSTEMS)} (got {bad or 'nothing'})")
    if args.batch < 1 or args.block_size < 1:
        die("--batch and --block-size must be >= 1")
    if args.gpu_batches < 1 or args.batch % args.gpu_batches:
        die(f"--gpu-batches must be >= 1 and divide --batch (got {args.gpu_batches} for batch {args.batch})")
    if args.gen_len < 2 or args.predict_gen_len < 2:
        die("--gen-len and --predict-gen-len must be >= 2 (decode excludes the prefill's token)")
    for flag in ("keep_ratio", "min_keep", "gamma"):
        if not 0 < getattr(args, flag) <= 1:
            die(f"--{flag.replace('_', '-')} must be in (0, 1] (got {getattr(args, flag)})")
    if not args.upstream_timeout > 0:
        die(f"--upstream-timeout must be > 0 (got {args.upstream_timeout})")
    if not args.cap_gib > 0:
        die(f"--cap-gib must be > 0 (got {args.cap_gib})")
    if args.threads is not None and args.threads < 1:
        die(f"--threads must be >= 1 (got {args.threads})")
    if not args.model.lower().removeprefix("facebook/").startswith("opt-"):
        die(f"--model must be an OPT size such as opt-125m (got {args.model!r})")
    args.predict_hardware = [p.strip() for p in args.predict_hardware.split(",") if p.strip()]
    if args.from_json and not Path(args.from_json).expanduser().is_file():
        die(f"--from-json file not found: {args.from_json}")
    for p in args.predict_hardware + ([args.hardware] if args.hardware else []):
        if not (REPO / p).is_file() and not Path(p).expanduser().is_file():
            die(f"hardware file not found: {p}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json:
        for p in rerun_model(args):
            print(f"wrote {p}")
        return 0
    import torch
    from flexgen_sparpr.weights.resolve import ModelNotFound, resolve_source

    if args.threads:
        torch.set_num_threads(args.threads)
    args.offload_dir = str(Path(args.offload_dir).expanduser())
    Path(args.offload_dir).mkdir(parents=True, exist_ok=True)
    args.contexts_model = (1024, 2048, 4096, 8192)
    out = Path(args.out)
    max_seq = max(args.contexts + args.calib_contexts) + args.gen_len
    try:
        src = resolve_source(args.model, "_DUMMY_", max_seq_len=max_seq, seed=args.seed)
    except (ModelNotFound, ValueError) as exc:
        die(str(exc))
    cap = args.cap_gib * GiB
    payload = {"config": {**vars(args), "engine_commit": engine_commit()}, "machine": machine_info(), "cells": []}
    with timer() as total:
        hw = this_machine(args)
        print(f"this machine: disk read {hw.disk_read_bw / 1e9:.2f} GB/s, float32 "
              f"{hw.compute_flops('float32') / 1e9:.1f} GFLOP/s", flush=True)
        cal, calib = calibration_runs(src, args, hw)
        print(f"calibration: {cal}", flush=True)
        timed_out = None
        bar = progress(total=len(args.contexts) * len(args.systems), desc="cells", unit="cell",
                       enabled=bars_wanted(args.quiet))
        for ctx in sorted(args.contexts):
            for system in args.systems:
                load = load_average()
                try:
                    if system in ("dense", "sparpr"):
                        cell = run_engine(src, args, ctx, system)
                    elif system == "upstream" and timed_out:  # a longer context would only take longer
                        cell = {"ok": False, "timeout": True, "error": f"skipped: timed out at {timed_out}"}
                    elif system == "upstream":
                        cell = run_upstream_cell(args, ctx)
                        timed_out = ctx if cell.get("timeout") else timed_out
                    else:
                        cell = run_hf(src, args, ctx, cap)
                except ValueError as exc:  # e.g. an unwritable --offload-dir
                    die(str(exc))
                cell.update(context=ctx, system=system, policy=system, load_average_before=load)
                if cell.get("ok"):
                    cell["e2e_s"] = cell["prefill_s"] + cell["decode_s"]
                    cell["throughput_tok_s"] = args.batch * args.gen_len / cell["e2e_s"]
                msg = f"e2e {cell['e2e_s']:.1f} s" if cell.get("ok") else cell.get("error")
                bar.update()
                bar.write(f"ctx {ctx} {system}: {msg}")
                payload["cells"].append(cell)
        bar.close()
    payload.update(wall_s=total(), cap_bytes=cap, calibration=cal.to_dict(), hardware=hw.to_yaml_dict(),
                   calibration_runs=calib,
                   load_average_end=load_average())
    written = report(payload, args, src.spec, hw, cal, out)
    for p in written:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    from flexgen_sparpr.utils.guard import guarded
    sys.exit(guarded(main))  # one error line for any failure, signals included (utils/guard.py)
