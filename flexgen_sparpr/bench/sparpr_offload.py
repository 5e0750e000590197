"""SparPR against this engine's dense offload, and upstream FlexGen at the same placement
(scripts/bench_sparpr.py): one measured cell per (context, policy), the comparison of a pair,
and the report. The metrics are defined in the script's docstring."""
from __future__ import annotations

import statistics

from .offload import policy_knobs, run_offload
from .peers import upstream
from .results import md_table
from .sweep import REFERENCE


def run_cell(src, args, ctx: int, policy: str) -> dict:
    """One fresh engine, one generation; returns timings, bytes and the policy's statistics."""
    r = run_offload(src, batch=args.batch, ctx=ctx, gen_len=args.gen_len, policy=policy,
                    policy_args=policy_knobs(args, policy),
                    block_size=args.block_size, offload_dir=args.offload_dir,
                    cache_gpu_percent=args.cache_gpu_percent, cache_cpu_percent=args.cache_cpu_percent,
                    weight_percents=(args.w_gpu_percent, args.w_cpu_percent), gpu_mem=args.gpu_mem,
                    seed=args.seed, gpu_batches=args.gpu_batches, memory=True,
                    device=args.device, dtype=args.dtype, speculate=args.speculative_prefetch and policy != REFERENCE)
    moved, bw, modes, stats = r["bytes_moved"], r["disk_read_Bps"], r["disk_mode"], r["kv_policy_stats"]
    steps = r["step_s"]
    prefill, decode = r["prefill_s"], r["decode_s"]
    read = moved.get("disk->cpu", 0)
    per_step = read / len(steps)
    into_compute = read + moved.get("cpu->compute", 0)  # on the CPU, disk reads land in compute memory
    return {"context": ctx, "policy": policy, "prefill_s": prefill, "decode_s": decode, "e2e_s": prefill + decode,
            "throughput_tok_s": args.batch * args.gen_len / (prefill + decode),
            "decode_tok_s": args.batch * len(steps) / decode, "step_s_median": statistics.median(steps),
            "step_s": steps, "disk_read_bytes": read, "bytes_per_token": into_compute / (args.batch * len(steps)),
            "gpu_peak_bytes": r["memory"]["gpu_peak_bytes"], "memory": r["memory"],
            "bytes_moved": moved, "disk_read_Bps": bw, "disk_mode": modes,
            "io_bound_ratio": statistics.median(steps) / (per_step / bw) if bw and per_step else None,
            "tokens": r["tokens"], "kv_policy_stats": stats, "device": r["device"], "dtype": r["dtype"],
            "speculative_bytes": r["speculative_bytes"], "resolved": r["resolved"]}


def run_upstream_cell(args, ctx: int) -> dict:
    """Upstream FlexGen in a child process at the same placement (activations on the compute
    tier): one cell, or {"ok": False, "error": one line} (e.g. out of memory under the cap)."""
    # no LLM here, so no "resolved": upstream's placement and dtype are the flags passed below
    import torch
    dev = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    pct = (args.w_gpu_percent, args.w_cpu_percent, args.cache_gpu_percent, args.cache_cpu_percent, 100, 0)
    r = upstream(args.upstream_timeout, model=args.model.removeprefix("facebook/"), batch=args.batch, prompt_len=ctx,
                 gen_len=args.gen_len, percent=tuple(int(p) for p in pct), offload_dir=args.offload_dir,
                 dtype="auto" if args.dtype == "auto" else args.dtype, threads=torch.get_num_threads(),
                 device=dev.type, gpu_mem=args.gpu_mem if dev.type == "cuda" else None)
    r["context"] = ctx
    if r.get("ok"):
        r["e2e_s"] = r["total_s"]
        r["throughput_tok_s"] = args.batch * args.gen_len / r["total_s"]
    return r


def _ratio(a, b):
    return a / b if a is not None and b else None


def compare(dense: dict, sparpr: dict, upstream: dict | None = None) -> dict:
    tot = sparpr["kv_policy_stats"]["totals"]
    up = upstream if upstream and upstream.get("ok") else None
    return {"context": dense["context"],
            "upstream_prefill_s": up["prefill_s"] if up else None, "upstream_decode_s": up["decode_s"] if up else None,
            "upstream_e2e_s": up["e2e_s"] if up else None, "upstream_tok_s": up["throughput_tok_s"] if up else None,
            "upstream_error": upstream.get("error") if upstream and not up else None,
            "dense_gpu_peak_bytes": dense["gpu_peak_bytes"], "sparpr_gpu_peak_bytes": sparpr["gpu_peak_bytes"],
            "dense_prefill_s": dense["prefill_s"], "sparpr_prefill_s": sparpr["prefill_s"],
            "cut_if_decode_free": dense["decode_s"] / dense["e2e_s"],  # the most any decode speed-up can cut
            "dense_decode_s": dense["decode_s"], "sparpr_decode_s": sparpr["decode_s"],
            "dense_e2e_s": dense["e2e_s"], "sparpr_e2e_s": sparpr["e2e_s"],
            "latency_cut": 1 - sparpr["e2e_s"] / dense["e2e_s"],
            "dense_tok_s": dense["throughput_tok_s"], "sparpr_tok_s": sparpr["throughput_tok_s"],
            "throughput_x": sparpr["throughput_tok_s"] / dense["throughput_tok_s"],
            "decode_x": sparpr["decode_tok_s"] / dense["decode_tok_s"],
            "bytes_per_token_ratio": _ratio(sparpr["bytes_per_token"], dense["bytes_per_token"]),
            "dense_io_bound": dense["io_bound_ratio"], "sparpr_io_bound": sparpr["io_bound_ratio"],
            "effective_keep": tot["effective_keep"], "recomputed": tot["blocks_recomputed"],
            "fallbacks": tot["fallbacks"], "speculative_bytes": sparpr["speculative_bytes"],
            # SparPR's own estimate prices its exact selections read afresh: the engine reads at most
            # that (each table's arena holds what it read: engine/recall.py); a speculative prefetch
            # adds wrong guesses
            "est_bytes_bound": 0 < sparpr["disk_read_bytes"] <= tot["est_bytes"].get("disk->cpu", 0)}


def render_md(payload: dict) -> str:
    cfg, m = payload["config"], payload["machine"]
    f = lambda x, p=2: "n/a" if x is None else f"{x:.{p}f}"  # noqa: E731
    rows = [[c["context"], f(c["dense_prefill_s"], 1), f(c["dense_decode_s"], 1), f(c["dense_e2e_s"], 1),
             f(c["sparpr_prefill_s"], 1), f(c["sparpr_decode_s"], 1), f(c["sparpr_e2e_s"], 1),
             f"{100 * c['latency_cut']:.0f}%", f(c["dense_tok_s"], 3), f(c["sparpr_tok_s"], 3), f(c["throughput_x"]),
             f(c["decode_x"])] for c in payload["summary"]]
    head = ["context", "dense prefill s", "dense decode s", "dense e2e s", "SparPR prefill s", "SparPR decode s",
            "SparPR e2e s", "latency cut", "dense tok/s", "SparPR tok/s", "throughput x", "decode x"]
    io_rows = [[c["context"], f(c["bytes_per_token_ratio"], 3), f(c["dense_io_bound"]), f(c["sparpr_io_bound"]),
                f(c["effective_keep"], 3), c["recomputed"], c["fallbacks"], "yes" if c["est_bytes_bound"] else "no"]
               for c in payload["summary"]]
    io_head = ["context", "bytes/token SparPR / dense", "dense step / IO", "SparPR step / IO", "SparPR effective keep",
               "blocks recomputed", "fallbacks", "counters <= SparPR's byte estimate"]
    gib = lambda b: "n/a" if not b else f"{b / 2**30:.2f}"  # noqa: E731
    up_rows = [[c["context"], f(c["upstream_prefill_s"], 1), f(c["upstream_decode_s"], 1), f(c["upstream_e2e_s"], 1),
                f(c["upstream_tok_s"], 3), c["upstream_error"] or "", gib(c["dense_gpu_peak_bytes"]),
                gib(c["sparpr_gpu_peak_bytes"])] for c in payload["summary"]]
    up_head = ["context", "upstream prefill s", "upstream decode s", "upstream e2e s", "upstream tok/s",
               "upstream error", "dense peak GPU GiB", "SparPR peak GPU GiB"]
    sp = [c["kv_policy_stats"] for c in payload["cells"] if c["kv_policy_stats"]]
    rhos = [st["rho"] for k in sp for st in k["steps"] if st["rho"] is not None]
    ckpt = [k.get("checkpoint_tables", {}) for k in sp]
    kept, asked = sum(c.get("kept", 0) for c in ckpt), sum(c.get("asked", 0) for c in ckpt)
    rebuilt, fell = sum(c["recomputed"] for c in payload["summary"]), sum(c["fallbacks"] for c in payload["summary"])
    where = sorted({(c["device"], c["dtype"]) for c in payload["cells"]})
    on = ", ".join(f"{d} on {dev}" for dev, d in where)
    gpu = f" ({m['cuda']})" if m.get("cuda") and any(dev.startswith("cuda") for dev, _ in where) else ""
    bound = ", ".join(f"{100 * c['cut_if_decode_free']:.0f} %" for c in payload["summary"])
    notes = [
        f"- {cfg['model']} with dummy weights, batch {cfg['batch']}, gen_len {cfg['gen_len']}, {on}{gpu} "
        f"(host {m['cpu_model']}, {m['cpu_count']} cores, torch threads {m['torch_threads']}; load average at "
        f"start {m['load_average']}: times compare only between runs on a quiet machine).",
        f"- The most a decode speed-up could cut (dense decode / dense end-to-end, prefill unchanged): {bound}.",
        f"- KV cache: {cfg['cache_gpu_percent']:g}% compute, {cfg.get('cache_cpu_percent', 0):g}% CPU, "
        f"{100 - cfg['cache_gpu_percent'] - cfg.get('cache_cpu_percent', 0):g}% on the disk tier, O_DIRECT (disk mode: "
        f"{payload['disk_modes']}), block size {cfg['block_size']}; weights {cfg.get('w_gpu_percent', 100):g}% "
        f"compute, {cfg.get('w_cpu_percent', 0):g}% CPU, the rest disk; activations on compute"
        + (f"; the CUDA device capped at {cfg['gpu_mem']:g} GiB (--gpu-mem; peak GPU = reserved + context)"
           if cfg.get("gpu_mem") else "") + ".",
        f"- SparPR: keep_ratio ceiling {cfg['keep_ratio']}, min_keep {cfg['min_keep']}, gamma {cfg['gamma']}; "
        "dynamic budget, recompute and fallback on. Measured rho (copy / recompute cost of a block) was "
        + (f"{min(rhos):.3f}-{max(rhos):.3f}" if rhos else "n/a")
        + f"; blocks rebuilt from checkpoints: {rebuilt}; dense fallbacks: {fell}; tables that kept "
        f"checkpoints (kept only where a rebuild can pay): {kept} of {asked}.",
        f"- OPT's real position table stops at 2048; the dummy model's is sized for {payload['max_seq_len']} "
        "tokens, so rows above 2048 time an OPT-shaped model beyond OPT's trained range.",
        "- step/IO = median decode step / (disk bytes per step / the engine's own measured disk bandwidth).",
        *([("- Speculative prefetch on (one GPU batch): share of SparPR's decode disk reads made from a guess "
            "one layer early: " + ", ".join(f"{100 * c['speculative_bytes'] / max(1, sc['disk_read_bytes']):.0f} %"
                                            for c, sc in zip(payload["summary"], payload["cells"][1::2]))
            + ". The guesses that the exact selection does not use are read for nothing and count in the "
              "bytes; SparPR's own estimate prices the exact selections only, so it no longer equals the "
              "counters.")] if cfg.get("speculative_prefetch") else []),
        "- Prompts are random token ids; nothing here measures fidelity (see scripts/needle.py).",
        f"- Whole grid: {payload['wall_s'] / 60:.1f} min wall; each (context, policy) ran in a fresh engine.",
    ]
    peer = ("\n## Upstream FlexGen (flexgen==0.1.8) at the same placement, and peak GPU memory\n\n"
            + md_table(up_head, up_rows)) if cfg.get("upstream") or cfg.get("gpu_mem") else ""
    return (f"# SparPR vs dense offload ({cfg['model']})\n\n## Latency and throughput\n\n"
            + md_table(head, rows) + "\n## Bytes and I/O\n\n" + md_table(io_head, io_rows) + peer + "\n"
            + "\n".join(notes) + "\n")
