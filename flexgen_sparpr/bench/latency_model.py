"""The model half of scripts/reproduce_latency.py: OPT-6.7B on a hardware file it predicts
(FlexGen dense and SparPR at keep 0.5 / 0.1, each on the placement runtime/placement.py picks),
with nothing measured but the host's rate of scoring SparPR's summaries."""
from __future__ import annotations

import math
from pathlib import Path

from .results import REPO


def hw_path(p: str) -> Path:
    """A hardware file relative to the repository when it is there, else the path as given."""
    return REPO / p if (REPO / p).is_file() else Path(p).expanduser()


def hardware_file(path):
    """The hardware file at `path` (relative to the repository when it is there)."""
    from ..runtime.hardware import load_hardware
    return load_hardware(hw_path(path))


def host_scan_Bps() -> float:
    """Bytes per second one thread of this machine scores SparPR's float16 mean summaries at
    (OPT-6.7B's 32 heads of 128, batch 4, an 8k context's 4-token runs; best of 5)."""
    import time
    import torch
    from ..kv.policies.sparpr_mean import block_scores
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        q, summ = torch.randn(4, 32, 1, 128), torch.randn(4, 32, 128, 16, 128).half()  # [B, Hkv, nb, P, D]
        live, best = torch.ones(4, 128, 16, dtype=torch.bool), math.inf
        for _ in range(5):
            t0 = time.perf_counter()
            block_scores(q, summ, live, "softmax")
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return summ.nbytes / best


def model_hardware(path: str, args, cal_cpu) -> dict:
    """OPT-6.7B, batch 4, on one hardware file: FlexGen dense (placement from runtime/placement.py),
    SparPR at keep 0.5 and 0.1 (the paper's two settings) on the same placement, all-on-device."""
    from ..models.spec import opt_spec
    from ..runtime.hardware import load_hardware
    from ..runtime.placement import NoPlacementFits, Workload, choose, device_bytes_needed
    from ..runtime.timemodel import Calibration, predict
    from ..runtime.trace import Placement, analytic_trace
    hw, spec = load_hardware(hw_path(path)), opt_spec("opt-6.7b")
    dtype = "float16" if hw.is_cuda else "float32"
    nbytes = 2 if hw.is_cuda else 4
    assumed = Calibration(source="the file's effective figures as given (already derated), no per-layer overhead")
    derated = Calibration(io_eff=min(1.0, cal_cpu.io_eff),
                          source=f"as given, links at this machine's fitted io_eff {cal_cpu.io_eff:.2f}")
    from ..kv.policies import make_policy
    from ..api.resolved import policy_knobs
    # SparPR as the laptop's policy file runs it: its key summaries in host memory (none on the
    # device), scored there each step at this machine's measured one-thread rate (a bound for a laptop's 8 cores)
    sparpr = make_policy("sparpr", summaries_on="cpu")
    shares = dict(resident_share=sparpr.resident_share(args.block_size, nbytes),
                  host_share=sparpr.host_share(args.block_size, nbytes))
    scan_Bps = host_scan_Bps()
    rows = []
    for ctx in args.contexts_model:
        row = {"context": ctx}
        need = device_bytes_needed(spec, args.batch, ctx + args.predict_gen_len, nbytes)
        row["all_on_device_need_bytes"] = need["total"]
        if need["total"] > hw.compute_memory:
            row["all_on_device"] = None
        else:
            tr = analytic_trace(spec, args.batch, ctx, args.predict_gen_len,
                                Placement(block_size=args.block_size, dtype_bytes=nbytes, is_cuda=hw.is_cuda))
            row["all_on_device"] = predict(tr, hw, dtype, assumed)["total_s"]
        try:
            plans = {1.0: choose(Workload(spec, ctx, args.predict_gen_len, args.batch, dtype), hw)}
            # SparPR's own placements: its key summaries sit on the device wherever the cache lives,
            # and a step reads only its keep of the cache
            for keep in (0.5, 0.1):
                plans[keep] = choose(Workload(spec, ctx, args.predict_gen_len, args.batch, dtype,
                                              kv_read_share=keep, **shares), hw)
        except NoPlacementFits as e:
            row["placement"], row["error"] = None, str(e)
            rows.append(row)
            continue
        row["placement"] = list(plans[1.0].percent)
        row["sparpr_placement"] = {str(k): list(plans[k].percent) for k in (0.5, 0.1)}
        for name, keep in (("dense", 1.0), ("sparpr_keep0.5", 0.5), ("sparpr_keep0.1", 0.1)):
            pl = Placement.from_percent(plans[keep].percent, block_size=args.block_size,
                                        dtype_bytes=nbytes, is_cuda=hw.is_cuda, checkpoints=keep < 1)
            tr = analytic_trace(spec, args.batch, ctx, args.predict_gen_len, pl, keep=keep)
            p, d = predict(tr, hw, dtype, assumed), predict(tr, hw, dtype, derated)
            # the host scores every summary each decode step (the cache at its largest: an upper bound)
            scan = 0.0 if keep == 1.0 else shares["host_share"] * args.batch * (ctx + args.predict_gen_len) * \
                2 * spec.kv_dim * nbytes * spec.num_layers / scan_Bps
            extra = (args.predict_gen_len - 1) * scan
            row[name] = {"total_s": p["total_s"] + extra, "prefill_s": p["prefill_s"], "decode_s": p["decode_s"] + extra,
                         "io_s": p["io_s"], "compute_s": p["compute_s"], "derated_total_s": d["total_s"] + extra,
                         "bytes_per_step": sum(tr[-1].bytes.values()), "host_scoring_s_per_step": scan}
        rows.append(row)
    # a modeled table builds no LLM, so no "resolved": what it models is recorded instead (block,
    # dtype, the SparPR knobs it prices; each row's placement)
    return {"hardware": hw.to_yaml_dict(), "path": path, "host_scan_GBps": scan_Bps / 1e9, "calibration": assumed.to_dict(),
            "derated_calibration": derated.to_dict(), "gen_len": args.predict_gen_len, "batch": args.batch,
            "dtype": dtype, "block_size": args.block_size, "kv_policy": policy_knobs(sparpr), "rows": rows}
