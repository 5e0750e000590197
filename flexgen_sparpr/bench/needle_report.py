"""scripts/needle.py's report: a table per task (score and agreement with dense per configuration
and length, the SparPR paper's passkey figures beside), and the plot of agreement against keep."""
from __future__ import annotations

import json
from pathlib import Path

from ..kv.policies.dkv import DKV
from .fidelity import summarize
from .results import md_table
from .resume import engines
from .sweep import DKV_RANK, DKV_RESIDUALS, REFERENCE, resolved_lines
from .tasks import TASKS


# the SparPR paper's passkey scores (2k / 4k / 8k), quoted beside ours
PAPER = {("sparpr", 0.5): ".943 / .879 / .780", ("sparpr", 0.1): ".600 / .482 / .308",
         ("h2o", 0.5): "≈ .49–.51", ("h2o", 0.1): "≈ .12", ("streaming-llm", 0.5): "≈ .45–.49",
         ("streaming-llm", 0.1): "≈ .02", ("quest", 0.5): ".777 (Quest-only)", ("quest", 0.1): ".777 (Quest-only)"}


def render(payload, png: Path) -> str:
    """The markdown of a needle.py results payload; draws the plot at `png` beside it."""
    cfg = payload["config"]
    rows = summarize(payload["records"])
    if not rows and payload["records"]:  # no dense answers here (--no-dense): scores only; frontier.py joins
        groups = {}
        for r in payload["records"]:
            groups.setdefault((r["task"], r["length"], r["label"]), []).append(r)
        rows = [{"task": t, "length": n, "label": lab, "policy": rs[0]["policy"], "keep": rs[0]["keep"],
                 "n": len(rs), "hits": sum(x["hit"] for x in rs), "score": sum(x["hit"] for x in rs) / len(rs),
                 "agree": "?", "agree_rate": None, "vs_dense": None, "dense_hits": None}
                for (t, n, lab), rs in groups.items()]
    lengths = sorted({r["length"] for r in rows})
    lines = ["# Retrieval fidelity on SmolLM2-135M-Instruct", "",
             f"Split **{cfg['split']}**: texts {', '.join(cfg['texts'])}, depths {cfg['depths']}, seed {cfg['seed']}. "
             "Cell: score (hits / trials) · agreement with dense trial by trial (the answers' numbers, or the "
             "phrase, equal dense's). Keep = the share of the context's KV tokens a step may read (sinks and "
             "recent window inside it). Raw policies: KV blocks of "
             f"{cfg['block_size']} tokens; dkv and sparpr+dkv: {cfg['dkv_block']} (rank "
             f"{cfg.get('dkv_args', {}).get('rank', DKV_RANK)}, "
             f"{cfg.get('dkv_args', {}).get('residuals', DKV_RESIDUALS)} exact rows"
             + (f", the top {cfg['dkv_args']['exact_routed']} routed blocks read raw"
                if cfg.get("dkv_args", {}).get("exact_routed") else "") + ").", ""]
    for task in [t for t in TASKS if any(r["task"] == t for r in rows)]:
        by = {(r["label"], r["length"]): r for r in rows if r["task"] == task}
        labels = sorted({lab for lab, _ in by}, key=lambda s: (s != REFERENCE, s.split("@")[0],
                                                               -float(s.split("@")[1]) if "@" in s else 0))
        table = [[lab, *[f"{by[(lab, n)]['score']:.2f} · {by[(lab, n)]['agree']}/{by[(lab, n)]['n']}"
                         if (lab, n) in by else "–" for n in lengths],
                  PAPER.get((lab.split("@")[0], float(lab.split("@")[1])), "") if "@" in lab and task == "passkey"
                  else ""] for lab in labels]
        lines += [f"## {task}", "", md_table(["config", *[f"{n} tok" for n in lengths], "paper (passkey)"], table)]
        sp = [by[("sparpr@0.1", n)] for n in lengths if ("sparpr@0.1", n) in by]
        if sp:
            lines.append("SparPR keep 0.1 vs dense (target ≥ 0.9×): " + ", ".join(
                f"{r['length']}: {r['hits']}/{r['dense_hits']}" + (f" = {r['vs_dense']:.2f}" if r["vs_dense"] else "")
                for r in sp) + "\n")
    drawn = plot(rows, lengths, png)
    shown = f"Plot: {png.name}" if drawn else \
        "No plot: no dense answers in this run (--no-dense; scripts/frontier.py joins them from another)"
    return "\n".join([
        *lines, f"Wall time: {payload['wall_s']} s. {shown}. Engine: {engines(payload['batches'], cfg['engine_commit'])}.", "",
        *([f"Not run (time limit; the same command resumes): {len(payload['skipped'])} batches: "
           f"{', '.join(payload['skipped'])}", ""] if payload.get("skipped") else []),
        "## Config", "", "```json",
        json.dumps({k: v for k, v in cfg.items() if k not in ("machine", "resolved")}, indent=1, default=str),
        "```", "",
        "Machine: " + json.dumps(cfg.get("machine"), default=str), "", *resolved_lines(cfg)])


def plot(rows, lengths, png: Path) -> bool:
    """Each policy's agreement with dense against its keep, a panel per task and length; False
    (nothing drawn, an older plot removed) when no row has dense's answers to agree with."""
    if not any(r["agree_rate"] is not None and r["policy"] != REFERENCE for r in rows):
        png.unlink(missing_ok=True)
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tasks = [t for t in TASKS if any(r["task"] == t for r in rows)]
    fig, axes = plt.subplots(len(tasks), len(lengths), figsize=(4.2 * len(lengths), 3.2 * len(tasks)), squeeze=False)
    for i, task in enumerate(tasks):
        for ax, n in zip(axes[i], lengths):
            rs = [r for r in rows if r["task"] == task and r["length"] == n]
            rs = [r for r in rs if r["agree_rate"] is not None]
            for j, pol in enumerate(sorted({r["policy"] for r in rs if r["policy"] not in (REFERENCE, DKV.name)})):
                pts = sorted((r["keep"], r["agree_rate"]) for r in rs if r["policy"] == pol)
                ax.plot([k for k, _ in pts], [a for _, a in pts], marker="os^Dv<>"[j % 7], label=pol)
            for r in rs:
                if r["policy"] == DKV.name:
                    ax.axhline(r["agree_rate"], color="k", ls=":", label="dkv")
            ax.axhline(0.95, color="0.6", lw=1, ls="--")
            ax.set(title=f"{task}, {n} tok", xscale="log", ylim=(-0.05, 1.05), xlabel="keep",
                   ylabel="agrees with dense")
            ax.legend(fontsize=6)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return True
