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

Writes <out>/bench.{json,md} with the config, the engine commit and the load average around
every run (the numbers are only as quiet as the machine was).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's engine, the one engine_commit() names
from flexgen_sparpr.bench.args import die, int_list, OneLineParser  # noqa: E402
from flexgen_sparpr.bench.results import engine_commit, load_average, machine_info, md_table, write_results  # noqa: E402

GB = 1 << 30


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


def flags(args, prompt_len: int, gen_len: int, gbs: int, ngb: int, offload: str, out: Path) -> list[str]:
    return ["--model", args.model, "--path", "_DUMMY_", "--prompt-len", str(prompt_len), "--gen-len", str(gen_len),
            "--gpu-batch-size", str(gbs), "--num-gpu-batches", str(ngb), "--percent", "100", "0", "0", "0", "100", "0",
            "--block-size", str(args.block_size), "--offload-dir", offload, "--output-json", str(out), "--no-log",
            "--verbose", "0", "--dtype", "float32", "--device", "cpu"] + ([] if args.no_direct_io else ["--direct-io"])


def run(cmd: list[str], out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}
    before = load_average()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=out.parent)
    if r.returncode != 0:
        die(f"a run failed ({' '.join(cmd[:6])} ...): {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
    res = json.loads(out.read_text())
    res["load_before"], res["load_after"] = before, load_average()
    return res


def one_process(args, prompt_len, gen_len, gbs, ngb, offload, work: Path) -> dict:
    out = work / "one.json"
    return run([sys.executable, "-m", "flexgen_sparpr.flex_opt", *flags(args, prompt_len, gen_len, gbs, ngb, offload,
                                                                        out)], out)


def two_processes(args, gbs, ngb, offload, work: Path) -> dict:
    out = work / "two.json"
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "-m", "flexgen_sparpr.dist_flex_opt",
                *flags(args, args.prompt_len, args.gen_len, gbs, ngb, offload, out)], out)


def summarize(res: dict, batch: int, gen_len: int) -> dict:
    t = res["timings"]
    row = {"total_s": t["total_s"], "prefill_s": t["prefill_s"], "decode_s": t["decode_s"],
           "throughput_tok_s": batch * gen_len / t["total_s"], "decode_tok_s": t["decode_tokens_per_s"],
           "bytes_moved": res["bytes_moved"], "peak_rss_bytes": [res["peak_memory"]["host_rss_peak_bytes"]],
           "load": [res["load_before"], res["load_after"]]}
    pipe = res.get("pipeline")
    if pipe:
        row["busy_fraction"] = [s["timings"]["busy_fraction"] for s in pipe["stages"]]
        row["stage_layers"] = pipe["stage_layers"]
        row["link_bytes"] = {k: v for s in pipe["stages"] for k, v in s["link"].items()}
        row["peak_rss_bytes"] = [s["peak_memory"]["host_rss_peak_bytes"] for s in pipe["stages"]]
        row["stage_bytes_moved"] = [s["bytes_moved"] for s in pipe["stages"]]
    return row


def model(args, hw, cal, gbs, ngb, stages: int) -> dict:
    """The time model's prediction of a measured run (one process, or `stages` stages)."""
    from flexgen_sparpr.models.spec import opt_spec
    from flexgen_sparpr.runtime.stage_time import predict_pipeline, stage_trace
    from flexgen_sparpr.runtime.stages import even_by_bytes
    from flexgen_sparpr.runtime.timemodel import predict
    from flexgen_sparpr.runtime.trace import Placement, analytic_trace
    spec = opt_spec(args.model)
    pl = Placement.from_percent((100, 0, 0, 0, 100, 0), block_size=args.block_size, dtype_bytes=4)
    if stages == 1:
        return predict(analytic_trace(spec, args.batch, args.prompt_len, args.gen_len, pl), hw, "float32", cal)
    split = even_by_bytes(spec, stages)
    traces = [stage_trace(spec, split, s, args.batch, args.prompt_len, args.gen_len, pl, ngb) for s in range(stages)]
    return predict_pipeline(traces, hw, "float32", cal, ngb, spec.hidden, 4)


def calibrate_split(args, hw, calib_runs: list[dict]):
    """A Calibration from one-process runs at the calibration lengths (their analytic traces,
    with the measured step times)."""
    import dataclasses

    from flexgen_sparpr.models.spec import opt_spec
    from flexgen_sparpr.runtime.timemodel import calibrate
    from flexgen_sparpr.runtime.trace import Placement, analytic_trace
    spec = opt_spec(args.model)
    pl = Placement.from_percent((100, 0, 0, 0, 100, 0), block_size=args.block_size, dtype_bytes=4)
    traces = []
    for r in calib_runs:
        tr = analytic_trace(spec, args.batch, r["prompt_len"], args.calib_gen_len, pl)
        traces.append([dataclasses.replace(s, measured_s=t) for s, t in zip(tr, r["timings"]["per_token_s"])])
    return calibrate(traces, hw, "float32", source=f"one-process runs at prompt lengths {args.calib_prompt_lens}")


def markdown(payload: dict) -> str:
    cfg, rows = payload["config"], []
    for c in payload["configs"]:
        for name, key in (("1 process", "one"), ("2 processes", "two")):
            m = c["measured"][key]
            p = c["predicted"][key]
            busy = " / ".join(f"{b:.0%}" for b in m.get("busy_fraction", [])) or "-"
            pbusy = " / ".join(f"{b:.0%}" for b in p.get("stage_busy_fraction", [])) or "-"
            link = ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in m.get("link_bytes", {}).items()) or "-"
            disk = sum(v for k, v in m["bytes_moved"].items() if "disk" in k)
            rss = " / ".join(f"{b / GB:.2f}" for b in m["peak_rss_bytes"])
            rows.append([f"{c['gpu_batch_size']}x{c['num_gpu_batches']}", name, c["micro_batches"] if key == "two" else 1,
                         f"{m['total_s']:.2f}", f"{m['throughput_tok_s']:.1f}", f"{p['total_s']:.2f}",
                         f"{(p['total_s'] - m['total_s']) / m['total_s']:+.0%}", busy, pbusy, f"{disk / 1e6:.1f}", link,
                         rss, f"{m['load'][0][0]:.1f}-{m['load'][1][0]:.1f}"])
    head = ["GBS x GPU batches", "run", "micro-batches", "measured s (median)", "tokens/s", "predicted s", "error",
            "busy per stage", "predicted busy", "disk MB", "stage link", "peak RSS GiB per rank", "load (1 min)"]
    m = payload["machine"]
    return (f"# Pipeline parallelism on this machine: 1 process vs 2\n\n"
            f"{cfg['model']} (dummy weights), batch {cfg['batch']}, prompt {cfg['prompt_len']} + {cfg['gen_len']} new "
            f"tokens, KV cache on disk ({'O_DIRECT' if cfg['direct_io'] else 'page cache'}), block {cfg['block_size']}, "
            f"float32, one torch thread per process, median of {cfg['reps']} interleaved runs. Engine "
            f"{cfg['engine_commit']}; {m['cpu_count']} cores ({m['cpu_model']}). Produced by `python scripts/"
            f"{cfg['command']}`.\n\n"
            + md_table(head, rows) +
            "\n- busy per stage: the share of the run's steps a stage computes or waits on its own I/O; the rest "
            "is the pipeline bubble (waiting for an input micro-batch, or for the last stage's token ids).\n"
            "- predicted: the time model (runtime/timemodel.py, runtime/stage_time.py), calibrated per "
            "configuration on one-process runs at other prompt lengths "
            f"({cfg['calib_prompt_lens']}, {cfg['calib_gen_len']} new tokens), from the runs' analytic traces; "
            "2 processes: each stage's time per micro-batch, step = the slowest x (micro-batches + stages - 1). "
            "Loopback transfers are not counted (< 1 MB per micro-batch).\n"
            "- The machine is shared: the load column is the 1-minute load average before and after each run; "
            "two ranks need both cores, so any other load slows the 2-process runs more than the 1-process ones.\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    from flexgen_sparpr.runtime.hardware import load_hardware
    hw = load_hardware(args.hardware)
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
                runs["one"].append(summarize(one_process(args, args.prompt_len, args.gen_len, gbs, ngb, offload, work),
                                             args.batch, args.gen_len))
                runs["two"].append(summarize(two_processes(args, gbs, ngb, offload, work), args.batch, args.gen_len))
            measured = {k: _median_run(v) for k, v in runs.items()}
            predicted = {"one": _brief(model(args, hw, cal, gbs, ngb, 1)), "two": _brief(model(args, hw, cal, gbs, ngb, 2))}
            configs.append({"gpu_batch_size": gbs, "num_gpu_batches": ngb, "micro_batches": ngb,
                            "calibration": cal.to_dict(), "calibration_runs": [
                                {"prompt_len": r["prompt_len"], "per_token_s": r["timings"]["per_token_s"]} for r in calib],
                            "runs": runs, "measured": measured, "predicted": predicted,
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


def _median_run(runs: list[dict]) -> dict:
    """The run with the median total time (its other numbers are that run's)."""
    ordered = sorted(runs, key=lambda r: r["total_s"])
    out = dict(ordered[(len(ordered) - 1) // 2])
    out["total_s_all"] = [r["total_s"] for r in runs]
    out["total_s_spread"] = (max(out["total_s_all"]) - min(out["total_s_all"])) / statistics.median(out["total_s_all"])
    return out


def _brief(pred: dict) -> dict:
    return {k: v for k, v in pred.items() if k in ("prefill_s", "decode_s", "total_s", "stage_busy_fraction")}


if __name__ == "__main__":
    sys.exit(main())
