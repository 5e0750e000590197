"""Long-text perplexity per KV policy: the windows a run scores and their summary.

A window is P prompt tokens (prefilled densely) and the next T + 1 tokens of the same text: the
first is the prefill's own prediction (dense for every policy, not scored), the other T are
decoded teacher-forced one at a time with the policy reading its keep of the cache
(bench/forced.py). A policy's perplexity ratio to dense is exp of the mean, over windows, of its
mean NLL minus dense's on the same window; its 95 % interval is the Student-t interval of that
mean (bench/stats.py), so it says how much the ratio moves from window to window.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from .stats import mean_ci
from .sweep import REFERENCE


@dataclass(frozen=True)
class Window:
    text: str
    start: int  # token offset in the text
    prompt: list[int]  # P tokens
    forced: list[int]  # T + 1 tokens: the prefill's prediction, then the T scored ones


def windows(name: str, ids: list[int], prompt_len: int, score_len: int, count: int, seed: int) -> list[Window]:
    """`count` non-overlapping windows of a tokenized text at seeded random offsets (the same
    seed, text and lengths give the same windows). Raises ValueError when the text is too short."""
    span = prompt_len + score_len + 1
    room = len(ids) - count * span
    if room < 0:
        raise ValueError(f"text {name!r} has {len(ids)} tokens: too short for {count} windows of {span}")
    rng = random.Random(f"{seed}:{name}:{prompt_len}:{score_len}")
    # count gaps that add up to at most `room`: sorted cut points in [0, room]
    cuts = sorted(rng.randint(0, room) for _ in range(count))
    out = []
    for i, c in enumerate(cuts):
        s = c + i * span
        out.append(Window(name, s, ids[s:s + prompt_len], ids[s + prompt_len:s + span]))
    return out


def stream_windows(name: str, ids: list[int], prompt_len: int, score_len: int, count: int) -> list[Window]:
    """`count` windows evenly spaced over a token stream (the first at 0, the last at its end),
    for texts too short for disjoint windows: their prompts overlap, but the scored spans (each
    window's last score_len + 1 tokens) are disjoint. Raises ValueError when the stream cannot
    hold them so."""
    span = prompt_len + score_len + 1
    room = len(ids) - span
    step = room // (count - 1) if count > 1 else 0
    if room < 0 or (count > 1 and step < score_len + 1):
        raise ValueError(f"stream {name!r} has {len(ids)} tokens: too short for {count} windows of {prompt_len} "
                         f"+ {score_len + 1} tokens with disjoint scored spans")
    return [Window(name, i * step, ids[i * step:i * step + prompt_len], ids[i * step + prompt_len:i * step + span])
            for i in range(count)]


def summarize(records: list[dict]) -> list[dict]:
    """records: one per (window, config): {"window", "length", "label", "policy", "keep", "nll_sum",
    "n", "top1"}. Returns one row per (label, length) with a dense row on the same windows:
    ppl, dense_ppl, ratio = exp(mean over windows of the NLL difference) and its 95 % interval
    (ratio_lo, ratio_hi), the windows and tokens counted, and top-1 agreement with the text."""
    dense = {(r["window"], r["length"]): r for r in records if r["label"] == REFERENCE}
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in records:
        if (r["window"], r["length"]) in dense:
            groups.setdefault((r["label"], r["length"]), []).append(r)
    rows = []
    for (label, length), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0] != REFERENCE, kv[0][0])):
        ds = [dense[(r["window"], r["length"])] for r in rs]
        deltas = [r["nll_sum"] / r["n"] - d["nll_sum"] / d["n"] for r, d in zip(rs, ds)]
        m, lo, hi = mean_ci(deltas)
        n_tok = sum(r["n"] for r in rs)
        rows.append({"label": label, "policy": rs[0]["policy"], "keep": rs[0]["keep"], "length": length,
                     "windows": len(rs), "tokens": n_tok,
                     "ppl": math.exp(sum(r["nll_sum"] for r in rs) / n_tok),
                     "dense_ppl": math.exp(sum(d["nll_sum"] for d in ds) / sum(d["n"] for d in ds)),
                     "ratio": math.exp(m), "ratio_lo": math.exp(lo) if lo > -math.inf else 0.0,
                     "ratio_hi": math.exp(hi) if hi < math.inf else math.inf,
                     "top1": sum(r["top1"] for r in rs) / n_tok})
    return rows
