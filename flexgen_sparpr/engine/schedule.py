"""What a step does at each (layer, GPU batch) cell, as plain numbers: pure bookkeeping, no tensors.

The cells run micro-batch after micro-batch, each in FlexGen's order (engine/pipeline.py
`schedule`). At a layer's first cell its weights are taken and the next layer's start loading; at
its last cell the blocks it sealed are waited for. A decode cell starts the cache read of the next
cell that reads a cache; when that is the very next cell, its query may be had early: its input is
computed unless it is this cell's output (the same GPU batch) or, on a stage after the first, the
first layer's (received from the stage before, perhaps not yet).
A pipeline stage receives a micro-batch at its first layer's cell of the micro-batch's first GPU
batch and sends it after its last layer's cell of its last GPU batch. The executor (executor.py)
runs the cells; engine/runner.py does what each says.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .pipeline import schedule


@dataclass(frozen=True)
class Cell:
    """One cell: layer `layer` (an index into the engine's schedule layers) on GPU batch `batch`."""

    n: int  # the cell's place in the step
    layer: int
    batch: int
    is_first: bool  # the layer's first cell (of its run of GPU batches): take its weights
    is_last: bool  # the layer's last cell: wait for the blocks it sealed
    load: int | None  # at a first cell: the layer whose weights start loading next (None: none)
    read: int | None  # the next cell (its n) that reads a cache, after this one
    read_layer: int | None  # that cell's layer and batch
    read_batch: int | None
    query_early: bool  # the read is the next cell's: its query may be had early
    input_ready: bool  # ... and its input is computed already
    receive: int | None  # the micro-batch to receive before this cell (a stage after the first)
    send: int | None  # the micro-batch to send after this cell (a stage before the last)


@dataclass(frozen=True)
class StepSchedule:
    """A step's cells in order, and what its cache reads key on."""

    cells: tuple[Cell, ...]
    reads: tuple[int, ...]  # the cells that read a cache (their n)

    @property
    def order(self) -> list[tuple[int, int]]:
        return [(c.layer, c.batch) for c in self.cells]


@lru_cache(maxsize=64)
def step_schedule(reads_cache: tuple[bool, ...], num_gpu_batches: int, micro_batches: int,
                  receives: bool = False, sends: bool = False) -> StepSchedule:
    """The cells of a step over len(reads_cache) layers (reads_cache[j]: layer j reads a KV cache),
    num_gpu_batches GPU batches in micro_batches groups; receives / sends: the stage has a stage
    before / after it."""
    num_layers = len(reads_cache)
    order = schedule(num_layers, num_gpu_batches, micro_batches)
    per = num_gpu_batches // micro_batches  # GPU batches per micro-batch
    reads = tuple(n for n, (j, _) in enumerate(order) if reads_cache[j])
    cells = []
    for n, (j, k) in enumerate(order):
        is_first = n == 0 or order[n - 1][0] != j
        is_last = n + 1 == len(order) or order[n + 1][0] != j
        load = next((jj for jj, _ in order[n:] if jj != j), None) if is_first else None
        m = next((r for r in reads if r > n), None)
        mj, mk = order[m] if m is not None else (None, None)
        early = m == n + 1
        cells.append(Cell(
            n=n, layer=j, batch=k, is_first=is_first, is_last=is_last, load=load,
            read=m, read_layer=mj, read_batch=mk, query_early=early,
            input_ready=early and mk != k and not (receives and mj == 0),
            receive=k // per if receives and j == 0 and k % per == 0 else None,
            send=k // per if sends and j == num_layers - 1 and k % per == per - 1 else None))
    return StepSchedule(tuple(cells), reads)
