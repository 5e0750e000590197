"""The runs of scripts/bench_throttled.py (and bench_ablations.py): this engine traced on the
throttled disk tier, upstream FlexGen with or without apply_sparpr, and one run's row of counts,
bytes and the time model's error; the hardware files the read cap is balanced between."""
from __future__ import annotations

import statistics

from .offload import policy_knobs, run_offload
from .peers import upstream
from .results import REPO

THERE_HW = REPO / "configs/hardware/rtx3070ti-laptop-8gb.yaml"
HERE_HW = REPO / "results/latency_hardware_this_machine.yaml"


def time_model(traces: list, hw, source: str):
    """The time model calibrated on `traces` (float32) against `hw`: (its calibration, a
    function from a run's trace to its prediction)."""
    from ..runtime.timemodel import calibrate, predict
    cal = calibrate(traces, hw, "float32", source=source)
    return cal, lambda tr: predict(tr, hw, "float32", cal)


def engine_run(src, args, ctx: int, gen: int, policy: str, seed: int, extra: dict | None = None) -> dict:
    """This engine, dense or SparPR (at the flags' knobs and `extra`), traced."""
    r = run_offload(src, batch=args.batch, ctx=ctx, gen_len=gen, policy=policy,
                    policy_args=policy_knobs(args, policy, **(extra or {})),
                    block_size=args.block_size, offload_dir=args.offload_dir, seed=seed, trace=True)
    r["e2e_s"] = r["prefill_s"] + r["decode_s"]
    return r


def upstream_run(args, ctx: int, gen: int, sparpr: bool) -> dict:
    """Upstream FlexGen on the CPU, KV on its disk tier with its page cache dropped, with
    apply_sparpr at the flags' knobs when `sparpr`."""
    import torch
    hook = dict(keep_ratio=args.keep_ratio, min_keep=args.min_keep, block_size=args.block_size) if sparpr else None
    r = upstream(args.upstream_timeout, model=args.model.removeprefix("facebook/"), batch=args.batch, prompt_len=ctx,
                 gen_len=gen, percent=(100, 0, 0, 0, 100, 0), offload_dir=args.offload_dir, sparpr=hook,
                 threads=torch.get_num_threads(), device="cpu", drop_page_cache=True)
    if r.get("ok"):
        r["e2e_s"] = r["total_s"]
        r.pop("tokens", None)
    return r


def cell(kind: str, r: dict, kernel_read: int | None, cap_Bps: float | None, model=None) -> dict:
    """One run's row: timings, counts, bytes, I/O-boundness, the model's error, and this engine's
    configuration as it resolved it."""
    out = {"kind": kind, "ok": r.get("ok", True), "error": r.get("error"), "kernel_disk_read_bytes": kernel_read}
    if not out["ok"]:
        return out
    steps = r["step_s"]
    out.update(prefill_s=r["prefill_s"], decode_s=r["decode_s"], e2e_s=r["e2e_s"],
               step_s_median=statistics.median(steps) if steps else None)
    if kind.startswith("upstream"):  # no LLM, so no "resolved": upstream runs at the flags upstream_run passes
        st = r.get("sparpr_stats") or {}
        out.update(disk_read_bytes=r["kv_read_bytes"], requests={"disk->cpu": (st.get("requests") or {}).get("disk")},
                   blocks_total=st.get("blocks_total"), blocks_selected=st.get("blocks_selected"),
                   spans=st.get("spans"), summary_bytes=st.get("summary_bytes"),
                   effective_keep=st.get("effective_keep"))
    else:
        tot = (r["kv_policy_stats"] or {}).get("totals", {})
        out.update(disk_read_bytes=r["bytes_moved"].get("disk->cpu", 0), bytes_moved=r["bytes_moved"],
                   requests=r["requests"], disk_read_Bps_engine=r["disk_read_Bps"], resolved=r["resolved"],
                   **{k: tot.get(k) for k in ("blocks_total", "blocks_selected", "blocks_copied", "blocks_recomputed",
                                              "fallbacks", "spans", "effective_keep")})
        rhos = [s["rho"] for s in (r["kv_policy_stats"] or {}).get("steps", []) if s.get("rho") is not None]
        out["rho_range"] = [min(rhos), max(rhos)] if rhos else None
        if model is not None:
            p = model(r["trace"])
            out.update(model_e2e_s=p["total_s"], model_decode_s=p["decode_s"],
                       model_error=p["total_s"] / r["e2e_s"] - 1, model_decode_error=p["decode_s"] / r["decode_s"] - 1)
    per_step = out["disk_read_bytes"] / max(1, len(steps))
    out["step_over_io"] = (out["step_s_median"] / (per_step / cap_Bps)) if cap_Bps and per_step else None
    return out
