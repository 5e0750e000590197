"""bench_throttled.py's summary (cuts, byte ratios, model errors, against the issue's targets)
and its markdown."""
from __future__ import annotations

from .results import md_table

CUT_TARGET = {1024: 0.45, 2048: 0.65, 4096: 0.75}  # SparPR vs this engine's dense (issue 17)
UPSTREAM_TARGET = {1024: 0.31, 2048: 0.52, 4096: 0.63}  # the paper's cuts (upstream + SparPR vs upstream)


def _cut(a: dict, b: dict, key: str = "e2e_s"):
    """1 - a / b when both ran."""
    return 1 - a[key] / b[key] if a.get("ok") and b.get("ok") and a.get(key) and b.get(key) else None


def summarize(payload: dict, keep: float) -> list[dict]:
    out = []
    for row in payload["runs"]:
        c = row["cells"]
        d, s = c["dense"], c["sparpr"]
        u, us = c.get("upstream", {}), c.get("upstream+sparpr", {})
        ratio = s["disk_read_bytes"] / d["disk_read_bytes"] if d.get("disk_read_bytes") else None
        up_ratio = (us["disk_read_bytes"] / u["disk_read_bytes"]
                    if u.get("ok") and us.get("ok") and u.get("disk_read_bytes") else None)
        errors = [x[k] for x in (d, s) for k in ("model_error",) if x.get(k) is not None]
        out.append({
            "read_mbps": row["read_mbps"], "throttled": row["throttled"], "gen_len": row["gen_len"],
            "context": row["context"], "latency_cut": _cut(s, d), "decode_cut": _cut(s, d, "decode_s"),
            "cut_target": CUT_TARGET.get(row["context"]), "bytes_ratio": ratio, "bytes_target": keep + 0.05,
            "sparpr_step_over_io": s.get("step_over_io"), "dense_step_over_io": d.get("step_over_io"),
            "model_errors": errors, "model_within_25": all(abs(e) <= 0.25 for e in errors) if errors else None,
            "upstream_cut": _cut(us, u), "upstream_decode_cut": _cut(us, u, "decode_s"),
            "upstream_target": UPSTREAM_TARGET.get(row["context"]), "upstream_bytes_ratio": up_ratio,
            "selected": s.get("blocks_selected"), "copied": s.get("blocks_copied"),
            "recomputed": s.get("blocks_recomputed"), "fallbacks": s.get("fallbacks"), "rho_range": s.get("rho_range")})
    return out


def _f(x, p=2, pct=False):
    if x is None:
        return "n/a"
    return f"{100 * x:.0f} %" if pct else f"{x:.{p}f}"


def render_md(payload: dict) -> str:
    cfg, m, bal = payload["config"], payload["machine"], payload["balance"]
    head = ["cap MB/s", "gen", "context", "dense e2e s", "SparPR e2e s", "cut", "target", "dense / SparPR prefill s",
            "decode cut", "bytes SparPR/dense", "≤ keep+5 %", "step/IO dense / SparPR", "model err dense", "model err SparPR"]
    rows = []
    for r, s in zip(payload["runs"], payload["summary"]):
        c = r["cells"]
        rows.append([f"{r['read_mbps']:g}" + ("" if r["throttled"] else " (NOT throttled)"), r["gen_len"], r["context"],
                     _f(c["dense"].get("e2e_s"), 1), _f(c["sparpr"].get("e2e_s"), 1), _f(s["latency_cut"], pct=True),
                     _f(s["cut_target"], pct=True),
                     f"{_f(c['dense'].get('prefill_s'), 1)} / {_f(c['sparpr'].get('prefill_s'), 1)}",
                     _f(s["decode_cut"], pct=True), _f(s["bytes_ratio"], 3),
                     "n/a" if s["bytes_ratio"] is None else ("yes" if s["bytes_ratio"] <= s["bytes_target"] else "no"),
                     f"{_f(s['dense_step_over_io'])} / {_f(s['sparpr_step_over_io'])}",
                     _f(c["dense"].get("model_error"), pct=True),
                     _f(c["sparpr"].get("model_error"), pct=True)])
    chead = ["cap", "gen", "context", "run", "blocks total", "selected", "copied", "recomputed", "fallbacks", "spans",
             "disk bytes (engine)", "disk bytes (kernel)", "read requests", "ρ range"]
    crows = []
    for r in payload["runs"]:
        for kind, c in r["cells"].items():
            if not c.get("ok"):
                crows.append([f"{r['read_mbps']:g}", r["gen_len"], r["context"], kind, "error: " + str(c["error"])]
                             + [""] * 9)
                continue
            req = (c.get("requests") or {}).get("disk->cpu")
            rho = c.get("rho_range")
            crows.append([f"{r['read_mbps']:g}", r["gen_len"], r["context"], kind, c.get("blocks_total", "n/a"),
                          c.get("blocks_selected", "n/a"), c.get("blocks_copied", "n/a"), c.get("blocks_recomputed", "n/a"),
                          c.get("fallbacks", "n/a"), c.get("spans", "n/a"), c.get("disk_read_bytes"),
                          c.get("kernel_disk_read_bytes", "n/a"), "n/a" if req is None else req,
                          "n/a" if not rho else f"{rho[0]:.2f}-{rho[1]:.2f}"])
    uhead = ["cap", "gen", "context", "upstream e2e s", "upstream+SparPR e2e s", "cut", "decode cut", "paper",
             "bytes ratio"]
    urows = [[f"{r['read_mbps']:g}", r["gen_len"], r["context"], _f(r["cells"].get("upstream", {}).get("e2e_s"), 1),
              _f(r["cells"].get("upstream+sparpr", {}).get("e2e_s"), 1), _f(s["upstream_cut"], pct=True),
              _f(s["upstream_decode_cut"], pct=True), _f(s["upstream_target"], pct=True),
              _f(s["upstream_bytes_ratio"], 3)] for r, s in zip(payload["runs"], payload["summary"])]
    notes = [
        f"- {cfg['model']} dummy weights, batch {cfg['batch']}, block {cfg['block_size']}, SparPR keep ceiling "
        f"{cfg['keep_ratio']}, min_keep {cfg['min_keep']}, gamma {cfg['gamma']}; KV all on the disk tier (this "
        f"engine: {'float16' if bal['kv_dtype_bytes_here_over_there'] == 1 else 'float32'} blocks, O_DIRECT; "
        "upstream: float16, page cache dropped after each disk sync).",
        f"- Balanced cap: {bal['read_mbps']:.1f} MB/s = this CPU's {bal['here_TFLOPS']:.4f} TFLOPS x "
        f"{bal['kv_dtype_bytes_here_over_there']:g} (KV bytes here / there) / the laptop's "
        f"{bal['there_flop_per_byte']:.0f} FLOP per byte ({bal['there_TFLOPS']:g} TFLOPS over its "
        f"{bal['there_link_GBps']:.2f} GB/s effective KV link: cache split {cfg['there_cache_percent']}), from "
        f"{bal['here_hardware']} and {bal['there_hardware']} (bench/balance.py).",
        f"- Engine {cfg.get('engine_commit', 'not recorded')}; host {m['cpu_model']}, {m['cpu_count']} cores, load average at start {m['load_average']}: a busy "
        "machine's times compare only within this run (runs interleaved per context).",
        "- Model error = time model's predicted end-to-end / measured - 1, calibrated on a separate pair "
        f"at context {cfg['calib_context']}; upstream is not modelled (no trace).",
        f"- Whole grid: {payload['wall_s'] / 60:.1f} min wall.",
    ]
    notes += sorted({f"- {r['note']}" for r in payload["runs"] if r.get("note")})
    return ("# SparPR under a kernel read throttle (I/O-bound regime)\n\n## This engine: dense vs SparPR\n\n"
            + md_table(head, rows) + "\n## Counts per run\n\n" + md_table(chead, crows)
            + "\n## Upstream FlexGen vs upstream + apply_sparpr\n\n" + md_table(uhead, urows) + "\n"
            + "\n".join(notes) + "\n")
