"""SparPR's measured step fallback (on by default; `--no-step-fallback` turns it off): whole decode steps
read the cache as the dense policy does while sparse steps, timed, cost more than gamma x dense steps,
timed too.

The per-layer fallback (sparpr_plan.py) weighs the bytes a sparse and a dense layer would move. It
cannot see what a sparse step pays beside its bytes (the selection, reads that nothing overlaps: the
blocks are known only once the layer's query is), nor what a dense step hides (its reads in flight
while the layers before compute). Where those dominate (a short context on disk, a few MiB a step)
SparPR was 1.6x slower than dense. With the cache resident nothing moves, and at a short context the
selection costs more than the attention it skips (SmolLM2, 2k tokens, batch 1, on the CPU: a sparse
step 19.3 ms, a dense one 16.7 ms). So the policy times both kinds of step and runs the faster:

- a run starts sparse: SETTLE steps untimed (warm-up), SAMPLES timed;
- where the median sparse step is already below gamma x the least a dense step could cost (its
  offloaded blocks' bytes over the faster of the probed and the live disk bandwidth, summed over
  the step: CostModel.least_copy_s), sparse is chosen without timing dense; else SETTLE + SAMPLES dense steps
  are timed and the mode whose median step is lower runs, with gamma's preference for dense
  (dense while the sparse median is above gamma x the dense one), the chosen mode's timings kept
  fresh;
- after `recheck` steps the choice is made again, the other mode timed again where it is needed;
  while the choice holds, the next recheck waits twice as long (up to MAX_RECHECK).

A step is one context length (every layer and GPU batch of a step sees the same one), decided when
its first layer asks; a length that does not follow the last one starts a new run. A resident cache
has no dense floor: its dense steps are always timed."""
from __future__ import annotations

import statistics
from collections import deque

SETTLE = 1  # steps of a mode not timed after a switch to it (buffers, arenas, a cold landing ring)
SAMPLES = 3  # timed steps of each mode behind a choice (their median)
RECHECK = 64  # steps of the chosen mode before the other one is timed again
MAX_RECHECK = 1024
_KEEP = 8  # lengths remembered (a step's layers ask the same one; prefetch asks one ahead)


class StepModes:
    """Which decode steps read densely (`dense(length)`), from the step seconds `record` is given."""

    def __init__(self, gamma: float):
        self.gamma = gamma
        self.dense_steps = self.steps = 0  # over the runs: steps decided dense, steps decided
        self.switches = 0  # choices that changed the mode
        self._reset()

    def _reset(self) -> None:
        self._decided: dict[int, tuple[bool, bool]] = {}  # length -> (dense, timed)
        self._times = {False: deque(maxlen=SAMPLES), True: deque(maxlen=SAMPLES)}
        self._floor: float | None = None  # the least a dense step could cost (the last sparse step's)
        self._queue: deque[tuple[bool, bool]] = deque(self._trial(False))
        self._choice: bool | None = None
        self._recheck = RECHECK
        self._last = None

    @staticmethod
    def _trial(dense: bool) -> list[tuple[bool, bool]]:
        return [(dense, False)] * SETTLE + [(dense, True)] * SAMPLES

    def dense(self, length: int) -> bool:
        """Whether the step at this context length reads every block (decided once per length)."""
        got = self._decided.get(length)
        if got is None:
            if self._last is not None and length != self._last + 1:
                self._reset()  # not the next step: a new run (another prompt, another placement)
            self._last = length
            got = self._decided[length] = self._next()
            if len(self._decided) > _KEEP:
                del self._decided[min(self._decided)]
            self.steps += 1
            self.dense_steps += got[0]
        return got[0]

    def _next(self) -> tuple[bool, bool]:
        while not self._queue:
            self._choose()
        return self._queue.popleft()

    def _choose(self) -> None:
        """The next steps: the faster mode by the timed medians (or by the dense floor), each
        recheck; the mode a choice needs timed first."""
        sparse, dense = (statistics.median(self._times[m]) if self._times[m] else None for m in (False, True))
        if sparse is None:  # (only after a dense choice whose sparse timings were dropped)
            self._queue.extend(self._trial(False))
            return
        if self._floor is not None and sparse < self.gamma * self._floor:
            choice = False  # a dense step could not be faster: no need to time one
        elif dense is None:
            self._queue.extend(self._trial(True))
            return
        else:
            choice = sparse > self.gamma * dense
        if self._choice is not None:
            if choice == self._choice:
                self._recheck = min(MAX_RECHECK, 2 * self._recheck)
            else:
                self._recheck, self.switches = RECHECK, self.switches + 1
        self._choice = choice
        self._times[not choice].clear()  # timed afresh when a choice next needs it
        self._queue.extend([(choice, True)] * self._recheck)

    def record(self, length: int, seconds: float, dense_floor_s: float | None = None) -> None:
        """The step at `length` took `seconds` (the engine's step time); dense_floor_s: on a sparse
        step, the least a dense step could have cost (its offloaded bytes over the measured links)."""
        got = self._decided.get(length)
        if got is not None and got[1]:
            self._times[got[0]].append(seconds)
        if got is not None and not got[0] and dense_floor_s:
            self._floor = dense_floor_s

    def report(self) -> dict:
        times = {("dense" if m else "sparse"): [round(t, 6) for t in ts] for m, ts in self._times.items()}
        return {"steps": self.steps, "dense_steps": self.dense_steps, "switches": self.switches,
                "chosen": None if self._choice is None else ("dense" if self._choice else "sparse"),
                "last_timed_s": times}
