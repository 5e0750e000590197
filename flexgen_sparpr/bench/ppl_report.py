"""scripts/ppl.py's report: perplexity per configuration and length with its ratio to dense on
the same windows, the verdict on the target, and the plot of the ratio against keep."""
from __future__ import annotations

import json
from pathlib import Path

from ..kv.policies.dkv import DKV
from .perplexity import summarize
from .results import md_table
from .resume import engines
from .sweep import REFERENCE, resolved_lines


TARGET = ("sparpr", 0.1, 1.02)  # SparPR at keep 0.1 within +2 % of dense perplexity


def render(payload, png: Path) -> str:
    """The markdown of a ppl.py results payload; draws the plot at `png` beside it."""
    rows = summarize(payload["records"])
    cfg = payload["config"]
    lengths = sorted({r["length"] for r in rows})
    by = {(r["label"], r["length"]): r for r in rows}
    labels = list(dict.fromkeys(r["label"] for r in rows))
    table = []
    for lab in labels:
        cells = []
        for n in lengths:
            r = by.get((lab, n))
            cells.append("–" if r is None else f"{r['ppl']:.2f} ({r['ratio']:.3f} [{r['ratio_lo']:.3f}, "
                         f"{r['ratio_hi']:.3f}])" if lab != REFERENCE else "–" if r is None else f"{r['ppl']:.2f}")
        table.append([lab, *cells])
    pol, keep, lim = TARGET
    tgt = [by[(f"{pol}@{keep:g}", n)] for n in lengths if (f"{pol}@{keep:g}", n) in by]
    verdict = ", ".join(f"{r['length']}: {100 * (r['ratio'] - 1):+.2f} % (CI upper {100 * (r['ratio_hi'] - 1):+.2f} %) "
                        f"{'met' if r['ratio'] <= lim else 'missed'}" for r in tgt) or "not measured"
    plot(rows, lengths, png)
    n_win = {r["length"]: r["windows"] for r in rows if r["label"] == REFERENCE}
    return "\n".join([
        "# Long-text perplexity per KV policy (SmolLM2-135M-Instruct)", "",
        f"Split **{cfg['split']}**: texts {', '.join(cfg['texts'])}; seed {cfg['seed']}. Each window: "
        f"P prompt tokens prefilled densely, then {cfg['score_tokens']} tokens decoded teacher-forced with "
        "the policy reading its keep of the cache, each scored on the text's true next token. Cell: "
        "perplexity (ratio to dense on the same windows [95 % t-interval over windows]). Windows per "
        f"length: {json_compact(n_win)}." + (" Windows cut evenly spaced from the texts joined into one stream: their "
                                             "prompts overlap (not independent samples), their scored spans do not."
                                             if cfg.get("stream") else ""), "",
        md_table(["config", *[f"P = {n}" for n in lengths]], table),
        f"Target (SparPR keep {keep:g} within +{100 * (lim - 1):.0f} % of dense): {verdict}.", "",
        f"Wall time: {payload['wall_s']} s. Plot: {png.name}. Engine: {engines(payload['batches'], cfg['engine_commit'])}.", "",
        *([f"Not run (time limit; run the same command again to resume): {len(payload['skipped'])} batches: "
           f"{', '.join(payload['skipped'])}", ""] if payload.get("skipped") else []),
        "## Config", "", "```json",
        json.dumps({k: v for k, v in cfg.items() if k not in ("machine", "resolved")}, indent=1, default=str),
        "```", "",
        "Machine: " + json_compact(cfg.get("machine")), "", *resolved_lines(cfg)])


def json_compact(x) -> str:
    return json.dumps(x, default=str)


def plot(rows, lengths, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 3.8), squeeze=False)
    for ax, n in zip(axes[0], lengths):
        pols = sorted({r["policy"] for r in rows if r["length"] == n and r["policy"] not in (REFERENCE, DKV.name)})
        for i, p in enumerate(pols):
            rs = sorted((r for r in rows if r["length"] == n and r["policy"] == p), key=lambda r: r["keep"])
            ax.errorbar([r["keep"] for r in rs], [r["ratio"] for r in rs], marker="os^Dv<>"[i % 7], capsize=2,
                        yerr=[[r["ratio"] - r["ratio_lo"] for r in rs],
                              [min(r["ratio_hi"], 10) - r["ratio"] for r in rs]], label=p)
        for r in rows:
            if r["length"] == n and r["policy"] == DKV.name:
                ax.axhline(r["ratio"], color="k", ls=":", label="dkv (r 32, m 16)")
        ax.axhline(1.02, color="0.6", lw=1, ls="--", label="dense + 2 %")
        ax.set(title=f"P = {n}", xlabel="keep ratio", ylabel="perplexity / dense", xscale="log")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
