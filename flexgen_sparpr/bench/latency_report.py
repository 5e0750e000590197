"""Markdown and the plot of scripts/reproduce_latency.py (the measured grid, the model's
validation, the modeled laptop) next to the SparPR paper's numbers."""
from __future__ import annotations

import os
from pathlib import Path

from .results import md_table

GiB = 1 << 30
# SparPR paper (arXiv 2610.18140), OPT-6.7B, batch 4, RTX 3070 Ti laptop 8 GB, 16 GB host
PAPER_CUT = {1024: 0.31, 2048: 0.52, 4096: 0.63}
PAPER_X = {1024: 1.4, 2048: 2.1, 4096: 2.7}
PAPER_LINE = ("paper (OPT-6.7B, batch 4, RTX 3070 Ti laptop 8 GB, 16 GB host): DeepSpeed and HF Accelerate OOM "
              "before 1k tokens, a Quest-style scheme OOMs at 1200, FlexGen completes 1k-4k and times out at 8k; "
              "SparPR cuts end-to-end latency 31/52/63 % at 1k/2k/4k, raises throughput 1.4/2.1/2.7x and "
              "finishes 8k in 44 min")


def _f(x, p=1):
    return "n/a" if x is None else f"{x:.{p}f}"


def _cell(cells, ctx, system):
    return next((c for c in cells if c["context"] == ctx and c["system"] == system), None)


def _e2e(c):
    if c is None:
        return "not run"
    if c.get("ok"):
        return _f(c["e2e_s"])
    if c.get("oom"):
        return "OOM"
    return ("timeout: " if c.get("timeout") else "failed: ") + str(c.get("error", "?"))[:60].replace("|", "/")


def measured_markdown(pl: dict) -> str:
    cfg, m, cells = pl["config"], pl["machine"], pl["cells"]
    ctxs, systems = cfg["contexts"], cfg["systems"]
    head = ["context"] + [f"{s} e2e s" for s in systems] + [f"{s} tok/s" for s in systems]
    rows = [[ctx] + [_e2e(_cell(cells, ctx, s)) for s in systems]
            + [_f((_cell(cells, ctx, s) or {}).get("throughput_tok_s"), 3) for s in systems] for ctx in ctxs]
    cmp_rows = []
    for ctx in ctxs:
        d, s, u = (_cell(cells, ctx, k) for k in ("dense", "sparpr", "upstream"))
        ok = lambda c: c is not None and c.get("ok")  # noqa: E731
        cut = 1 - s["e2e_s"] / d["e2e_s"] if ok(d) and ok(s) else None
        x = s["throughput_tok_s"] / d["throughput_tok_s"] if ok(d) and ok(s) else None
        cut_u = 1 - s["e2e_s"] / u["e2e_s"] if ok(u) and ok(s) else None
        x_u = s["throughput_tok_s"] / u["throughput_tok_s"] if ok(u) and ok(s) else None
        pc, px = PAPER_CUT.get(ctx), PAPER_X.get(ctx)
        cmp_rows.append([ctx, "n/a" if cut is None else f"{100 * cut:.0f}%", _f(x, 2),
                         "n/a" if cut_u is None else f"{100 * cut_u:.0f}%", _f(x_u, 2),
                         _f(s.get("effective_keep") if ok(s) else None, 3),
                         "n/a" if pc is None else f"{100 * pc:.0f}%", _f(px, 1)])
    cmp_head = ["context", "SparPR cut vs dense", "throughput x vs dense", "SparPR cut vs upstream",
                "throughput x vs upstream", "SparPR effective keep", "paper: cut", "paper: throughput x"]
    mem_rows = []
    for ctx in ctxs:
        row = [ctx]
        for s in systems:
            c = _cell(cells, ctx, s) or {}
            row.append(_f(c["peak_rss_bytes"] / GiB, 2) if c.get("peak_rss_bytes") else "n/a")
        dn = (_cell(cells, ctx, "dense") or {}).get("tier_need_bytes")
        row.append(_f(dn / GiB, 2) if dn else "n/a")
        hf = _cell(cells, ctx, "hf") or {}
        need = hf.get("need")
        row.append(_f((need["kv"] + need["activations"]) / GiB, 2) if need else "n/a")
        row.append(hf.get("modules_on_disk", "n/a") if hf.get("ok") else ("OOM" if hf.get("oom") else "n/a"))
        mem_rows.append(row)
    mem_head = ["context"] + [f"{s} peak RSS GiB" for s in systems] + [
        "dense compute-tier need GiB", "HF KV + act. GiB", "HF modules on disk"]
    val_rows, errs = [], []
    for c in cells:
        if "model" not in c:
            continue
        v = c["model"]
        errs.append(abs(v["err_trace"]))
        b = v["analytic_over_trace_bytes"]
        val_rows.append([c["context"], c["system"], _f(v["measured_s"]), _f(v["model_trace_s"]),
                         f"{100 * v['err_trace']:+.0f}%", f"{100 * v['err_prefill']:+.0f}%",
                         f"{100 * v['err_decode']:+.0f}%", _f(v["model_analytic_s"]),
                         f"{100 * v['err_analytic']:+.0f}%", _f(b.get("disk->cpu"), 3), _f(b.get("cpu->disk"), 3),
                         _f(v["analytic_over_trace_flops"], 3)])
    val_head = ["context", "system", "measured s", "model (trace) s", "error", "prefill err", "decode err",
                "model (analytic) s", "error", "analytic/trace disk->cpu", "analytic/trace cpu->disk",
                "analytic/trace FLOPs"]
    cal, hw = pl["calibration"], pl["hardware"]
    la0, la1 = m["load_average"], pl.get("load_average_end")
    within = sum(1 for e in errs if e <= 0.25)
    notes = [
        f"- {cfg['model']} with dummy weights, batch {cfg['batch']}, gen_len {cfg['gen_len']}, float32 on the CPU "
        f"({m['cpu_model']}, {m['cpu_count']} cores, torch threads {m['torch_threads']}). Load average at start "
        f"{la0}, at end {la1}; per-cell load is in the JSON. The machine is shared: absolute times are noisy.",
        f"- KV cache 100 % on the disk tier; this engine reads it with O_DIRECT "
        f"(modes seen: {sorted({x for c in cells for x in c.get('disk_mode', [])})}); upstream FlexGen's disk "
        "tier goes through the page cache (it has no O_DIRECT), so its reads may hit RAM.",
        f"- Compute-tier cap {cfg['cap_gib']} GiB, imposed (the compute tier is host memory here). HF gets "
        "accelerate's device_map with max_memory = cap - (KV cache + activations) and offloads the other layers "
        "to disk; when KV + activations alone exceed the cap it is reported OOM without running. Peak RSS is "
        "the whole process (Python, torch, the dummy weights) and is shown, not enforced; this engine's "
        "compute-tier need is counted: weights + two layers' gathered KV + the prefill's activations (its KV "
        "cache is on disk), under the same rule as HF.",
        f"- SparPR: keep ceiling {cfg['keep_ratio']}, floor {cfg['min_keep']}, gamma {cfg['gamma']}.",
        f"- Time model calibrated once ({cal['source']}): prefill_eff {cal['prefill_eff']:.3g} (GEMMs), "
        f"scores_eff {cal.get('scores_eff', cal['prefill_eff']):.3g} (prefill attention), decode_eff "
        f"{cal['decode_eff']:.3g} (of the hardware file's {hw['flops_TFLOPS'].get('float32')} TFLOPS float32), "
        f"io_eff {cal['io_eff']:.3g} (of its {hw['disk_read_GBps']} GB/s disk read), per-layer overhead "
        f"{1e3 * cal['layer_overhead_s']:.2f} ms. {within} of {len(errs)} runs within +-25 % "
        f"(mean |error| {100 * sum(errs) / max(1, len(errs)):.0f} %).",
        *_first_fit(pl),
        "- model (analytic): the same model on the trace built from the spec and the placement alone (SparPR's "
        "keep = its measured effective keep), the path used for OPT-6.7B; analytic/trace compares its bytes "
        "and FLOPs with the engine's recorded trace (1.000 = identical).",
        "- " + PAPER_LINE + ".",
        f"- Whole run: {pl['wall_s'] / 60:.1f} min wall.",
    ]
    return ("# Latency, measured on this machine\n\n## End-to-end latency and throughput\n\n" + md_table(head, rows)
            + "\n## SparPR's reduction and ratio, next to the paper's\n\n" + md_table(cmp_head, cmp_rows)
            + "\n## Memory under the cap\n\n" + md_table(mem_head, mem_rows)
            + "\n## Time model vs measurement\n\n" + md_table(val_head, val_rows) + "\n" + "\n".join(notes) + "\n")


def _first_fit(pl: dict) -> list[str]:
    """The note on a replaced calibration: what it was and how far off it predicted."""
    first = pl.get("calibration_first")
    errs = [abs(c["model_first_calibration"]["err_trace"]) for c in pl["cells"] if "model_first_calibration" in c]
    if not first or not errs:
        return []
    rec = pl.get("recalibrated", {})
    return [f"- The first calibration ({first['source']}, taken cold: the first engine runs of the process, "
            f"prefill_eff {first['prefill_eff']:.3g}, decode_eff {first['decode_eff']:.3g}, io_eff "
            f"{first['io_eff']:.3g}) predicted these runs with mean |error| {100 * sum(errs) / len(errs):.0f} %, "
            f"{sum(e <= 0.25 for e in errs)} of {len(errs)} within +-25 %. The calibration above was taken "
            f"afterwards (`--from-json ... --recalibrate`, load average {rec.get('load_average_before')} -> "
            f"{rec.get('load_average_after')}) with a warm-up run first and two contexts, which lets the "
            "prefill's GEMMs and attention scores have separate efficiencies; the measured runs are unchanged."]


def modeled_markdown(md: dict, pl: dict) -> str:
    hw, rows = md["hardware"], md["rows"]
    head = ["context", "placement (--percent)", "FlexGen dense min", "SparPR keep 0.5 min", "SparPR keep 0.1 min",
            "cut (0.5 / 0.1)", "throughput x (0.5 / 0.1)", "all-on-GPU", "paper: cut", "paper: x"]
    out = []
    for r in rows:
        if r.get("placement") is None:
            out.append([r["context"], "no placement fits", "-", "-", "-", "-", "-", "-", "-", "-"])
            continue
        d, a, b = (r[k]["total_s"] for k in ("dense", "sparpr_keep0.5", "sparpr_keep0.1"))
        aod = ("OOM (needs " + _f(r["all_on_device_need_bytes"] / GiB, 1) + " GiB)") if r["all_on_device"] is None \
            else _f(r["all_on_device"] / 60, 2) + " min"
        pc, px = PAPER_CUT.get(r["context"]), PAPER_X.get(r["context"])
        where = " ".join(str(p) for p in r["placement"])
        sp = r.get("sparpr_placement") or {}
        if any(list(v) != list(r["placement"]) for v in sp.values()):
            where = f"dense {where}; " + "; ".join(f"SparPR {k}: " + " ".join(str(p) for p in v)
                                                   for k, v in sp.items())
        out.append([r["context"], where, _f(d / 60, 2), _f(a / 60, 2),
                    _f(b / 60, 2), f"{100 * (1 - a / d):.0f}% / {100 * (1 - b / d):.0f}%",
                    f"{d / a:.2f} / {d / b:.2f}", aod,
                    "FlexGen times out; SparPR 44 min" if r["context"] == 8192 else
                    ("n/a" if pc is None else f"{100 * pc:.0f}%"), _f(px, 1)])
    io = [[r["context"], _f(r["dense"]["io_s"] / 60, 2), _f(r["dense"]["compute_s"] / 60, 2),
           _f(r["dense"]["bytes_per_step"] / 1e9, 2), _f(r["sparpr_keep0.1"]["bytes_per_step"] / 1e9, 2),
           _f(r["dense"]["derated_total_s"] / 60, 2), _f(r["sparpr_keep0.1"]["derated_total_s"] / 60, 2)]
          for r in rows if r.get("placement")]
    io_head = ["context", "dense I/O min", "dense compute min", "dense GB/decode step", "SparPR 0.1 GB/decode step",
               "dense min (derated I/O)", "SparPR 0.1 min (derated I/O)"]
    cal, der = md["calibration"], md["derated_calibration"]
    val = pl["calibration"]
    errs = [abs(c["model"]["err_trace"]) for c in pl["cells"] if "model" in c]
    notes = [
        f"- **Modeled, not measured.** Hardware file `{md['path']}`: {hw['name']} ({hw['source']}); compute "
        f"{hw['compute']}, {hw['compute_memory_GiB']} GiB device, {hw['cpu_memory_GiB']} GiB host, h2d "
        f"{hw['h2d_GBps']} GB/s, disk read {hw['disk_read_GBps']} GB/s, {md['dtype']}.",
        f"- OPT-6.7B, batch {md['batch']}, gen_len {md['gen_len']} (the paper does not give its gen_len; 32 is "
        "FlexGen's default). Bytes from the placement and context, FLOPs from the spec "
        "(runtime/timemodel.py `analytic_trace`), the analytic trace that matched the engine's recorded bytes "
        "on this machine (results/latency_measured.md).",
        "- FlexGen dense: the placement runtime/placement.py `choose` picks for this file (its grid over "
        "FlexGen's --percent). SparPR: the placement `choose` picks for it (as the laptop's policy file runs "
        "it, `--summaries-on cpu`: its key summaries, 1/8 of the cache's bytes, in host memory, none on the "
        "device; and a step reading only its keep; shown when it differs), each decode step scoring every "
        "summary on the host at this machine's measured one-thread rate "
        f"({md.get('host_scan_GBps', float('nan')):.1f} GB/s of float16 summaries; added to SparPR's time: "
        "a bound, a laptop has 8 cores), reading 50 % or 10 % of the offloaded blocks per "
        "step (the paper's two fidelity settings; it does not state the latency run's budget) and storing "
        "hidden-state checkpoints beside the blocks (+50 % writes for OPT). SparPR runs as 2 GPU batches "
        "of 2 (the weights still load once per layer for both), so each cell's selection comes from its exact "
        "early query and its reads overlap the previous cell's compute like dense's (engine/prefetch.py); with "
        "one GPU batch its reads would add to each layer's time (the measured CPU runs above are that case, "
        "and the model counts them so).",
        f"- Calibration: {cal['source']} (prefill_eff {cal['prefill_eff']}, decode_eff {cal['decode_eff']}, "
        f"io_eff {cal['io_eff']}). This machine's fit does not transfer to a GPU; the 'derated I/O' columns "
        f"use its measured io_eff {der['io_eff']:.2f} instead as the pessimistic bound. The model's error on "
        f"this machine: mean |error| {100 * sum(errs) / max(1, len(errs)):.0f} % over {len(errs)} runs "
        f"(calibration: {val['source']}).",
        "- all-on-GPU: weights + the full KV cache + the prefill's activations on the device (what DeepSpeed / "
        "HF Accelerate without offload and a Quest-style scheme hold); OOM when above the device memory.",
        "- " + PAPER_LINE + ".",
        "- The gap: the model reproduces the mechanism (dense decode is bound by moving the KV cache and the "
        "offloaded weights over PCIe and disk; SparPR moves a keep share of the KV) but not the paper's "
        "overheads: FlexGen's Python per-layer costs and WSL's I/O path, the exact budget SparPR reached, "
        "its gen_len, and the 8k timeout threshold are unknown. Weight traffic is paid by both systems alike, "
        "so the cut shrinks where weights, not the KV cache, dominate the bytes of a step.",
    ]
    return (f"# Latency on {hw['name']}, *modeled*\n\n" + md_table(head, out) + "\n## Where the time goes\n\n"
            + md_table(io_head, io) + "\n" + "\n".join(notes) + "\n")


def plot(pl: dict, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cells, cfg = pl["cells"], pl["config"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for s in cfg["systems"]:
        pts = [(c["context"], c["e2e_s"]) for c in cells if c["system"] == s and c.get("ok")]
        if pts:
            a.plot(*zip(*pts), marker="o", label=s)
        for c in cells:  # where a system stopped: OOM under the cap, killed, timed out
            if c["system"] == s and not c.get("ok"):
                why = "OOM" if c.get("oom") else "timeout" if c.get("timeout") else "failed"
                a.axvline(c["context"], color="grey", ls=":", lw=0.8)
                a.text(c["context"], 0.02 + 0.25 * cfg["systems"].index(s), f" {s}: {why}", rotation=90,
                       fontsize=7, transform=a.get_xaxis_transform(), va="bottom")
    a.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="end-to-end s",
          title=f"{cfg['model']}, batch {cfg['batch']}, gen {cfg['gen_len']}, measured")
    a.legend()
    val = [(c["model"]["measured_s"], c["model"]["model_trace_s"], c["system"]) for c in cells if "model" in c]
    for s in ("dense", "sparpr"):
        pts = [(m, p) for m, p, k in val if k == s]
        if pts:
            b.scatter(*zip(*pts), label=s)
    if val:
        lo, hi = min(min(m, p) for m, p, _ in val) * 0.8, max(max(m, p) for m, p, _ in val) * 1.2
        b.plot([lo, hi], [lo, hi], "k-", lw=0.8)
        b.fill_between([lo, hi], [lo * 0.75, hi * 0.75], [lo * 1.25, hi * 1.25], color="grey", alpha=0.2,
                       label="+-25 %")
        b.set(xscale="log", yscale="log")
        b.minorticks_off()
    b.set(xlabel="measured s", ylabel="model s", title="time model vs measurement")
    b.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp.png")
    try:  # a temp file in the same folder, then a rename: never half a PNG
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return path
