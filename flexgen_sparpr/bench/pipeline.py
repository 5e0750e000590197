"""Pipeline parallelism measured (scripts/bench_dist.py): one process (`flexgen_sparpr.flex_opt`)
against two stages (`torchrun ... flexgen_sparpr.dist_flex_opt`), each run a child process with
one torch thread; the time model's prediction of each (calibrated on one-process runs at other
prompt lengths), and the report."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from .args import die
from .results import load_average, md_table


GB = 1 << 30


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


def as_run(res: dict) -> dict:
    """The configuration a child run reports in its --output-json (device, dtype, weight format, its
    Policy: placement and schedule, its EngineConfig: block, KV dtype, KV policy and knobs). The LLM is
    in the child, so this is the CLI's report, not api/resolved.py's reading of an open LLM."""
    return {k: res.get(k) for k in ("device", "dtype", "weight_format", "policy", "engine")}


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
    from ..models.spec import opt_spec
    from ..runtime.stage_time import predict_pipeline, stage_trace
    from ..runtime.stages import even_by_bytes
    from ..runtime.timemodel import predict
    from ..runtime.trace import Placement, analytic_trace
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

    from ..models.spec import opt_spec
    from ..runtime.timemodel import calibrate
    from ..runtime.trace import Placement, analytic_trace
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


def median_run(runs: list[dict]) -> dict:
    """The run with the median total time (its other numbers are that run's)."""
    ordered = sorted(runs, key=lambda r: r["total_s"])
    out = dict(ordered[(len(ordered) - 1) // 2])
    out["total_s_all"] = [r["total_s"] for r in runs]
    out["total_s_spread"] = (max(out["total_s_all"]) - min(out["total_s_all"])) / statistics.median(out["total_s_all"])
    return out


def brief(pred: dict) -> dict:
    """A prediction's totals and per-stage busy shares (what the report shows)."""
    return {k: v for k, v in pred.items() if k in ("prefill_s", "decode_s", "total_s", "stage_busy_fraction")}
