"""scripts/bench_upstream_sparpr.py's run and report: upstream FlexGen on one context, with or
without apply_sparpr (flexgen_sparpr/upstream/sparpr_hook.py), in a child process; the table of
each context's pair and its cut beside the paper's."""
from __future__ import annotations

from .peers import upstream
from .results import md_table


def one(args, ctx: int, sparpr: bool, device: str) -> dict:
    """Upstream on one context at the flags' placement (+ apply_sparpr at their knobs when `sparpr`)."""
    hook = dict(keep_ratio=args.keep_ratio, min_keep=args.min_keep, block_size=args.block_size) if sparpr else None
    r = upstream(args.timeout, model=args.model.removeprefix("facebook/"), batch=args.batch, prompt_len=ctx,
                 gen_len=args.gen_len, percent=args.percent, offload_dir=args.offload_dir, sparpr=hook,
                 dtype="auto", device=device, gpu_mem=args.gpu_mem if device == "cuda" else None,
                 drop_page_cache=device == "cpu")
    r.pop("tokens", None)
    return r


def render_md(p: dict) -> str:
    """The pairs' table (seconds, cuts, KV bytes ratio, the paper's cut) and its notes."""
    cfg, f = p["config"], (lambda x, n=1: "n/a" if x is None else f"{x:.{n}f}")
    paper = {1024: "31 %", 2048: "52 %", 4096: "63 %"}
    rows = []
    for r in p["rows"]:
        u, s = r["upstream"], r["upstream+sparpr"]
        rows.append([r["context"], f(u.get("prefill_s")), f(u.get("decode_s")), f(u.get("total_s")),
                     f(s.get("prefill_s")), f(s.get("decode_s")), f(s.get("total_s")),
                     "n/a" if "cut" not in r else f"{100 * r['cut']:.0f} %",
                     "n/a" if "decode_cut" not in r else f"{100 * r['decode_cut']:.0f} %",
                     f(r.get("bytes_ratio"), 3), paper.get(r["context"], "n/a"),
                     u.get("error") or s.get("error") or ""])
    head = ["context", "upstream prefill s", "decode s", "e2e s", "+SparPR prefill s", "decode s", "e2e s", "cut",
            "decode cut", "KV bytes ratio", "paper cut", "error"]
    cap = (f"disk reads capped at {cfg['read_mbps']:g} MB/s by the kernel" if p["throttle"] else
           (p["throttle_note"] or "no read cap"))
    notes = [f"- {cfg['model']} dummy weights, batch {cfg['batch']}, gen {cfg['gen_len']}, --percent {cfg['percent']}, "
             f"on {p['device']} ({p['device_name']})" + (f", capped at {cfg['gpu_mem']:g} GiB" if cfg["gpu_mem"] else "")
             + f"; {cap}. SparPR keep ceiling {cfg['keep_ratio']}, block {cfg['block_size']}.",
             f"- Load average at start {p['machine']['load_average']}; {p['wall_s'] / 60:.1f} min wall; the two "
             "runs of a context ran one after the other."]
    return "# Upstream FlexGen with and without apply_sparpr\n\n" + md_table(head, rows) + "\n" + "\n".join(notes) + "\n"
