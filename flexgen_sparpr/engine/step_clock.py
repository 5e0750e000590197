"""Where a step's time goes, on the thread that runs the step: choosing the KV blocks (select),
reading them inside the cell (read: nothing overlaps it), rebuilding blocks from checkpoints
(rebuild), waiting for the I/O pool (io_wait: weights, prefetched KV, block stores) and the rest
(compute: the model's maths and everything else). On CUDA these are host seconds: a kernel still
running when its call returns is counted where the host next waits for it."""
from __future__ import annotations

import time

PARTS = ("select", "read", "rebuild", "io_wait", "compute")


class _Timed:
    """One `with clock.timed(part)`: a plain context manager (a generator-made one costs several
    times more, and a decode step enters a few hundred)."""

    __slots__ = ("now", "part", "t0")

    def __init__(self, now: dict[str, float], part: str):
        self.now, self.part = now, part

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        self.now[self.part] = self.now.get(self.part, 0.0) + time.perf_counter() - self.t0


class StepClock:
    """Seconds per part of the current step; `close` files the step and starts the next."""

    def __init__(self):
        self._now: dict[str, float] = {}

    def timed(self, part: str) -> _Timed:
        return _Timed(self._now, part)

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
