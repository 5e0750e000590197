"""The measured half of scripts/reproduce_latency.py: each system's run on one context (this
engine dense or SparPR, upstream FlexGen, HF under accelerate's offload), this machine's
hardware, the time model's calibration and its validation against every engine run, and the
files of a report (the modeled half is bench/latency_model.py, the markdown bench/latency_report.py)."""
from __future__ import annotations

from pathlib import Path

from ..kv.policies.sparpr import SparPR
from .args import die
from .latency_model import hw_path, model_hardware
from .latency_report import measured_markdown, modeled_markdown, plot
from .offload import policy_knobs, random_prompts, run_offload
from .peers import hf_need, hf_offload_opt, upstream
from .results import engine_commit, load_average, machine_info, write_results


def run_engine(src, args, ctx: int, policy: str) -> dict:
    """This engine (dense, or SparPR at the flags' knobs) on one context, traced, with what its
    compute tier must hold beside the cache on disk and its configuration as it resolved it."""
    r = run_offload(src, batch=args.batch, ctx=ctx, gen_len=args.gen_len, policy=policy,
                    policy_args=policy_knobs(args, policy),
                    block_size=args.block_size, offload_dir=args.offload_dir, seed=args.seed,
                    trace=True, memory=True, gpu_batches=args.gpu_batches)
    tot = (r["kv_policy_stats"] or {}).get("totals", {})
    spec, n = src.spec, ctx + args.gen_len
    # what the compute tier holds: the weights, the gathered KV of the layer computing and of the
    # one prefetched, and the prefill's activations (the KV cache itself is on disk)
    layer_kv = 2 * args.batch * n * spec.kv_dim * 4 * (tot.get("effective_keep") or 1.0)
    tier = spec.num_params() * 4 + 2 * layer_kv + hf_need(spec, args.batch, ctx, args.gen_len)["activations"]
    return {"ok": True, "tier_need_bytes": tier, "prefill_s": r["prefill_s"], "decode_s": r["decode_s"],
            "bytes_moved": r["bytes_moved"],
            "disk_read_Bps": r["disk_read_Bps"], "disk_mode": r["disk_mode"],
            "peak_rss_bytes": r["memory"]["host_rss_peak_bytes"], "effective_keep": tot.get("effective_keep"),
            "blocks_recomputed": tot.get("blocks_recomputed"), "fallbacks": tot.get("fallbacks"),
            "checkpoints": bool(((r["kv_policy_stats"] or {}).get("checkpoint_tables") or {}).get("kept")),
            "trace": r["trace"], "resolved": r["resolved"]}


def run_upstream_cell(args, ctx: int) -> dict:
    """Upstream FlexGen in a child process, killed after --upstream-timeout seconds (reported as
    a timeout, as the paper reports FlexGen's 8k run)."""
    # no LLM, so no "resolved": upstream runs at the flags passed below
    import tempfile

    import torch
    # a folder of its own, removed here: a child killed at the timeout cannot clean up after itself
    with tempfile.TemporaryDirectory(dir=args.offload_dir, prefix="upstream-") as folder:
        r = upstream(args.upstream_timeout, model=args.model, batch=args.batch, prompt_len=ctx, gen_len=args.gen_len,
                     percent=(100, 0, 0, 0, 100, 0), offload_dir=folder,
                     threads=torch.get_num_threads())  # the same threads as this engine's runs
    if r.get("ok"):
        r.pop("tokens", None)
    return r


def run_hf(src, args, ctx: int, cap: float) -> dict:
    """HF OPT with random weights and accelerate's offload under the cap (see the docstring)."""
    # no LLM, so no "resolved": HF's placement is accelerate's under the cap
    prompts = random_prompts(src.spec.vocab, args.batch, ctx, args.seed)
    return hf_offload_opt(src.spec, prompts, args.gen_len, cap, args.seed, args.offload_dir)


def this_machine(args):
    from ..runtime.hardware import load_hardware
    if args.hardware:
        return load_hardware(hw_path(args.hardware))
    import torch
    from ..runtime.profile import hardware_from_probe, measure
    if args.quick:
        return hardware_from_probe(torch.device("cpu"), torch.float32, args.offload_dir)
    return measure(torch.device("cpu"), args.offload_dir, quick=True)


def validate(cell: dict, spec, args, hw, cal) -> dict:
    """Model vs measurement for one engine run: from its recorded trace and from the analytic one."""
    from ..runtime.timemodel import predict
    from ..runtime.trace import LINKS, Placement, analytic_trace
    tr = cell["trace"]
    pl = Placement(cache=(0, 0, 100), block_size=args.block_size, dtype_bytes=4,
                   # SparPR's, where a rebuild can pay (runs saved before that rule always kept them)
                   checkpoints=cell.get("checkpoints", cell["policy"] == SparPR.name))
    keep = cell.get("effective_keep") or 1.0
    an = analytic_trace(spec, args.batch, cell["context"], args.gen_len, pl, keep=keep,
                        serial_kv=cell["policy"] == SparPR.name and args.gpu_batches == 1)
    p_rec, p_an = predict(tr, hw, "float32", cal), predict(an, hw, "float32", cal)
    meas = cell["prefill_s"] + cell["decode_s"]
    sums = lambda t, link: sum(s.bytes.get(link, 0) for s in t)  # noqa: E731
    return {"measured_s": meas, "model_trace_s": p_rec["total_s"], "model_analytic_s": p_an["total_s"],
            "err_trace": p_rec["total_s"] / meas - 1, "err_analytic": p_an["total_s"] / meas - 1,
            "err_prefill": p_rec["prefill_s"] / cell["prefill_s"] - 1,
            "err_decode": p_rec["decode_s"] / cell["decode_s"] - 1,
            "decode_io_bound_steps": p_rec["decode_io_bound_steps"],
            "analytic_over_trace_bytes": {k: (sums(an, k) / sums(tr, k) if sums(tr, k) else None) for k in LINKS},
            "analytic_over_trace_flops": sum(sum(s.flops.values()) for s in an) /
            sum(sum(s.flops.values()) for s in tr)}


def calibration_runs(src, args, hw):
    """One discarded warm-up run (the process's first engine pays one-off costs), then dense and
    SparPR at each calibration context; returns the fitted Calibration and the runs."""
    from ..runtime.timemodel import calibrate
    run_engine(src, args, min(args.calib_contexts), "dense")
    calib = [{**run_engine(src, args, c, p), "context": c, "system": p}
             for c in args.calib_contexts for p in ("dense", "sparpr")]
    ctxs = ",".join(map(str, args.calib_contexts))
    cal = calibrate([c["trace"] for c in calib], hw, "float32",
                    source=f"dense + SparPR at context {ctxs} after a warm-up run (not validated against)")
    return cal, [{k: v for k, v in c.items() if k != "trace"} for c in calib]


def report(payload: dict, args, spec, hw, cal, out: Path) -> list[Path]:
    """The model on every engine run's trace, the modeled hardware files, then the files."""
    from ..runtime.hardware import save_hardware
    from ..runtime.timemodel import Calibration
    from ..runtime.trace import StepTrace
    first = Calibration(**payload["calibration_first"]) if "calibration_first" in payload else None
    for cell in payload["cells"]:
        if "trace" in cell:
            tr = [s if isinstance(s, StepTrace) else StepTrace(**s) for s in cell["trace"]]
            cell["model"] = validate({**cell, "trace": tr}, spec, args, hw, cal)
            if first is not None:
                cell["model_first_calibration"] = validate({**cell, "trace": tr}, spec, args, hw, first)
            cell["trace"] = [s.to_dict() for s in tr]
    payload["modeled"] = [{**model_hardware(p, args, cal), "engine_commit": engine_commit()}  # the commit modeling it
                          for p in args.predict_hardware]
    save_hardware(hw, out / "latency_hardware_this_machine.yaml")
    written = write_results(out, "latency_measured", payload, measured_markdown(payload))
    written.append(plot(payload, out / "latency_measured.png"))
    for m in payload["modeled"]:
        stem = "latency_modeled_" + Path(m["path"]).stem.split("-")[0]
        written += write_results(out, stem, m, modeled_markdown(m, payload))
    return written


def rerun_model(args) -> list[Path]:
    """--from-json: the model and the reports again on a saved run's traces, measuring nothing."""
    import json
    from ..models.spec import opt_spec
    from ..runtime.hardware import hardware_from_dict
    from ..runtime.timemodel import Calibration
    try:
        payload = json.loads(Path(args.from_json).expanduser().read_text())
        saved = payload["config"]
        hw = hardware_from_dict(payload["hardware"], where=args.from_json)
        for key in ("calibration", "calibration_first"):  # fits saved before scores_eff existed
            if key in payload:
                payload[key].setdefault("scores_eff", payload[key]["prefill_eff"])
        cal = Calibration(**payload["calibration"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        die(f"--from-json {args.from_json}: not a reproduce_latency result ({e})")
    for key in ("model", "contexts", "batch", "gen_len", "block_size", "systems", "cap_gib", "keep_ratio",
                "min_keep", "gamma"):
        setattr(args, key, saved[key])
    payload["config"].update(predict_hardware=args.predict_hardware, predict_gen_len=args.predict_gen_len)
    args.contexts_model = (1024, 2048, 4096, 8192)
    if args.recalibrate:
        from ..weights.resolve import resolve_source
        args.offload_dir = str(Path(args.offload_dir).expanduser())
        args.seed = saved.get("seed", 0)
        src = resolve_source(args.model, "_DUMMY_", max_seq_len=max(args.contexts + args.calib_contexts) +
                             args.gen_len, seed=args.seed)
        first = payload.get("calibration_first") or payload["calibration"]
        load = load_average()
        cal, runs = calibration_runs(src, args, hw)
        payload.update(calibration_first=first, calibration=cal.to_dict(), calibration_runs=runs,
                       recalibrated={"load_average_before": load, "load_average_after": load_average(),
                                     "calib_contexts": args.calib_contexts, "machine": machine_info()})
    return report(payload, args, opt_spec(args.model), hw, cal, Path(args.out))
