"""Pipeline parallelism on this machine: 1 process vs 2 (torchrun, gloo over loopback), each with
one torch thread, OPT with dummy weights, the batch as 2-4 micro-batches, the KV cache on disk.

Per configuration (--splits: GPU batch size x GPU batches; a pipeline runs each GPU batch as a
micro-batch) it runs, interleaved --reps times: `python -m flexgen_sparpr.flex_opt` (one process,
FlexGen's schedule) and `torchrun --standalone --nproc-per-node 2 -m flexgen_sparpr.dist_flex_opt`
(two stages split even by bytes). It reports throughput, each stage's busy fraction (the rest is
the pipeline bubble: waiting for an input micro-batch or for the last stage's token ids), the
bytes each link moved (disk, and stage 0 -> stage 1), peak memory per rank, and the time model's
prediction of every run: the model (runtime/timemodel.py; runtime/stage_time.py for the stages)
is calibrated per configuration on separate one-process runs at other prompt lengths
(--calib-prompt-lens), then predicts the measured runs from their analytic traces.

Writes <out>/bench.{json,md} with the config, the engine commit, the configuration each kind of
run reported (its --output-json: the LLM is in the child) and the load average around every run
(the numbers are only as quiet as the machine was).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's engine, the one engine_commit() names
from flexgen_sparpr.bench.args import die, int_list, OneLineParser  # noqa: E402
from flexgen_sparpr.bench.pipeline import (as_run, brief, calibrate_split, markdown, median_run,  # noqa: E402
                                           model, one_process, summarize, two_processes)
from flexgen_sparpr.bench.results import engine_commit, machine_info, write_results  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = OneLineParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="opt-125m", help="an OPT size name, dummy weights (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=8, help="sequences (default: %(default)s)")
    ap.add_argument("--splits", default="4x2,2x4", help="GPU batch size x GPU batches, each a micro-batch "
                    "(default: %(default)s)")
    ap.add_argument("--prompt-len", type=int, default=64, help="(default: %(default)s)")
    ap.add_argument("--gen-len", type=int, default=16, help="(default: %(default)s)")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: %(default)s)")
    ap.add_argument("--calib-prompt-lens", default="32,128", help="prompt lengths of the calibration runs, "
                    "one process each (default: %(default)s)")
    ap.add_argument("--calib-gen-len", type=int, default=8, help="(default: %(default)s)")
    ap.add_argument("--reps", type=int, default=2, help="interleaved repetitions of each run (default: %(default)s)")
    ap.add_argument("--hardware", default=str(REPO / "configs/hardware/cpu-only.yaml"),
                    help="this machine's hardware file, calibrated by the runs (default: configs/hardware/cpu-only.yaml)")
    ap.add_argument("--offload-dir", default=None, help="disk tier folder (default: a temp folder, removed)")
    ap.add_argument("--no-direct-io", action="store_true", help="let the disk tier use the page cache")
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny lengths, one rep")
    ap.add_argument("--out", default=str(REPO / "results" / "distributed"), help="output folder (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompt_len, args.gen_len, args.calib_prompt_lens, args.calib_gen_len, args.reps = 16, 4, "8,24", 3, 1
    try:
        args.calib_prompt_lens = int_list(args.calib_prompt_lens)
        args.splits = [tuple(int(x) for x in s.split("x")) for s in args.splits.split(",")]
    except ValueError:
        die("--calib-prompt-lens takes positive integers, --splits GBSxNGB pairs (e.g. 4x2,2x4)")
    for gbs, ngb in args.splits:
        if gbs < 1 or ngb < 1 or gbs * ngb != args.batch:
            die(f"--splits {gbs}x{ngb} does not make the batch of {args.batch}")
    if min(args.prompt_len, args.gen_len, args.calib_gen_len, args.block_size, args.reps) < 1 or args.gen_len < 2:
        die("lengths, --block-size and --reps must be >= 1, --gen-len >= 2")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from flexgen_sparpr.bench.latency_model import hardware_file
    hw = hardware_file(args.hardware)
    own_offload = args.offload_dir is None
    offload = args.offload_dir or tempfile.mkdtemp(prefix="bench-dist-")
    configs = []
    with tempfile.TemporaryDirectory(prefix="bench-dist-work-") as tmp:
        work = Path(tmp)
        for gbs, ngb in args.splits:
            calib = []
            for plen in args.calib_prompt_lens:
                r = one_process(args, plen, args.calib_gen_len, gbs, ngb, offload, work)
                r["prompt_len"] = plen
                calib.append(r)
            cal = calibrate_split(args, hw, calib)
            runs = {"one": [], "two": []}
            for _ in range(args.reps):
                raw = {"one": one_process(args, args.prompt_len, args.gen_len, gbs, ngb, offload, work),
                       "two": two_processes(args, gbs, ngb, offload, work)}
                for k, res in raw.items():
                    runs[k].append(summarize(res, args.batch, args.gen_len))
            measured = {k: median_run(v) for k, v in runs.items()}
            predicted = {"one": brief(model(args, hw, cal, gbs, ngb, 1)), "two": brief(model(args, hw, cal, gbs, ngb, 2))}
            configs.append({"gpu_batch_size": gbs, "num_gpu_batches": ngb, "micro_batches": ngb,
                            "calibration": cal.to_dict(), "calibration_runs": [
                                {"prompt_len": r["prompt_len"], "per_token_s": r["timings"]["per_token_s"]} for r in calib],
                            "runs": runs, "resolved": {k: as_run(res) for k, res in raw.items()},  # the last rep's
                            "measured": measured, "predicted": predicted,
                            "speedup": measured["one"]["total_s"] / measured["two"]["total_s"]})
    if own_offload:
        import shutil
        shutil.rmtree(offload, ignore_errors=True)
    config = {"model": args.model, "batch": args.batch, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
              "block_size": args.block_size, "splits": args.splits, "reps": args.reps,
              "calib_prompt_lens": args.calib_prompt_lens, "calib_gen_len": args.calib_gen_len,
              "hardware": args.hardware, "direct_io": not args.no_direct_io, "engine_commit": engine_commit(),
              "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])}
    payload = {"config": config, "machine": machine_info(), "configs": configs}
    for p in write_results(Path(args.out), "bench", payload, markdown(payload)):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
