"""Where a step's time goes, on the thread that runs the step: choosing the KV blocks (select),
reading them inside the cell (read: nothing overlaps it), rebuilding blocks from checkpoints
(rebuild), waiting for the I/O pool (io_wait: weights, prefetched KV, block stores) and the rest
(compute: the model's maths and everything else). On CUDA these are host seconds: a kernel still
running when its call returns is counted where the host next waits for it."""
from __future__ import annotations

import time
from contextlib import contextmanager

PARTS = ("select", "read", "rebuild", "io_wait", "compute")


class StepClock:
    """Seconds per part of the current step; `close` files the step and starts the next."""

    def __init__(self):
        self._now: dict[str, float] = {}

    @contextmanager
    def timed(self, part: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._now[part] = self._now.get(part, 0.0) + time.perf_counter() - t0

    def close(self, total_s: float) -> dict[str, float]:
        """This step's parts, compute being what the others leave of total_s; then a new step."""
        parts = {p: self._now.get(p, 0.0) for p in PARTS if p != "compute"}
        parts["compute"] = max(0.0, total_s - sum(parts.values()))
        self._now = {}
        return parts


def median_parts(steps: list[dict[str, float]]) -> dict[str, float]:
    """Per part, the median over steps (the decode steps of a run): {} for no steps."""
    if not steps:
        return {}
    out = {}
    for p in PARTS:
        xs = sorted(s.get(p, 0.0) for s in steps)
        n = len(xs)
        out[p] = xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2
    return out
