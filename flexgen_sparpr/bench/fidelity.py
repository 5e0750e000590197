"""Summaries of a retrieval grid: score per configuration, agreement with dense trial by trial,
and the keep frontier (the smallest keep whose answers still equal dense's often enough).

A record is one trial under one configuration: {"trial", "task", "length", "label", "policy",
"keep", "hit", "canon"} where "trial" identifies the prompt and "canon" is the answer reduced to
what must agree (bench/tasks.py: canonical).
"""
from __future__ import annotations

from .stats import wilson
from .sweep import REFERENCE


def summarize(records: list[dict]) -> list[dict]:
    """One row per (task, length, label): hits, n, score, the same trials' dense hits, the ratio
    score / dense score, kept = dense's hits this configuration also hits, and agree = trials
    whose canonical answer equals dense's (with its Wilson interval): agreeing on dense's wrong
    answers counts there, kept says whether its right ones survive."""
    dense = {(r["trial"], r["task"], r["length"]): r for r in records if r["label"] == REFERENCE}
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if (r["trial"], r["task"], r["length"]) in dense:
            groups.setdefault((r["task"], r["length"], r["label"]), []).append(r)
    rows = []
    for (task, length, label), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] != REFERENCE,
                                                                            kv[0][2])):
        ds = [dense[(r["trial"], task, length)] for r in rs]
        hits, dhits = sum(r["hit"] for r in rs), sum(d["hit"] for d in ds)
        kept = sum(r["hit"] and d["hit"] for r, d in zip(rs, ds))
        agree = sum(r["canon"] == d["canon"] for r, d in zip(rs, ds))
        lo, hi = wilson(agree, len(rs))
        rows.append({"task": task, "length": length, "label": label, "policy": rs[0]["policy"],
                     "keep": rs[0]["keep"], "n": len(rs), "hits": hits, "score": hits / len(rs),
                     "dense_hits": dhits, "kept": kept, "vs_dense": hits / dhits if dhits else None,
                     "agree": agree, "agree_rate": agree / len(rs), "agree_lo": lo, "agree_hi": hi})
    return rows


def frontier(rows: list[dict], policy: str, threshold: float = 0.95) -> dict[tuple[str, int], float | None]:
    """{(task, length): the smallest keep of `policy` at which its answers equal dense's in at
    least `threshold` of the trials, at that keep and at every larger keep measured (None: not even
    at the largest)}. Rows come from summarize."""
    cells: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for r in rows:
        if r["policy"] == policy:
            cells.setdefault((r["task"], r["length"]), []).append((r["keep"], r["agree_rate"]))
    out = {}
    for cell, pts in cells.items():
        best = None
        for keep, rate in sorted(pts, reverse=True):  # from the largest keep down
            if rate < threshold:
                break
            best = keep
        out[cell] = best
    return out
