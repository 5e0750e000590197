"""One step's run: what each cell of the step's schedule (engine/schedule.py) says, done on the
step's tensors — the GPU batches' hidden states and logits, the layer weights in hand and loading,
the cache reads and block stores in flight — through the engine's I/O pool, KV reader and stage
link. The executor (executor.py) walks the cells; what a cell computes is engine/compute.py's.
"""
from __future__ import annotations

from concurrent.futures import Future

import torch

from .compute import compute, park
from .io import Done, to_compute
from .prefetch import Ahead, CacheReads
from .schedule import Cell, StepSchedule


class StepRun:
    """One token step (or the prefill) of engine `eng`: ids [B, S], pos_all [B, S], pads (one [gbs]
    or None per GPU batch). Starting it posts the stage's receives and loads the first layer's weights."""

    def __init__(self, eng, ids, pos_all, pads, prefill: bool, plan: StepSchedule,
                 carried: dict[int, Future] | None = None, carry: bool = False):
        p = eng.run_policy
        self.eng, self.pads, self.prefill = eng, pads, prefill
        self.gbs, ngb = p.gpu_batch_size, p.num_gpu_batches
        self.per = ngb // eng.micro_batches  # GPU batches per micro-batch
        self.hidden: list = [None] * ngb
        self.logits: list = [None] * ngb
        # one positions tensor per batch for the whole step: the model keeps RoPE per tensor
        self.pos = [pos_all[k * self.gbs:(k + 1) * self.gbs] for k in range(ngb)]
        self.batch_ids = [ids[k * self.gbs:(k + 1) * self.gbs] for k in range(ngb)]  # [gbs, S] each
        if eng.link is not None:
            eng.link.begin_step(self.per * self.gbs, ids.shape[1], eng.spec.hidden, eng.dtype)
        self.w = None  # the current layer's weights
        self.w_next = self._load(plan.cells[0].layer)
        self.cells = plan.cells
        self.reads = None if prefill else CacheReads(plan.reads, eng.reader.read_ahead, len(plan.cells), carried)
        # the next step's first reads may start in this one (CacheReads.further): where a next step
        # comes, the policy's reads are planned from the cache alone, and not between pipeline stages
        self.carry = carry and not prefill and eng.link is None and eng.reader.policy.plans_ahead
        self.stores: list[Future] = []

    def _load(self, j: int) -> Future | Done:
        """Layer j's weights; resident layers load inline: a thread hand-off would cost more than it hides."""
        weights = self.eng.weights
        if weights.is_resident(j):
            return Done(weights.load(j))
        return self.eng.io.submit(weights.load, j)

    def take_weights(self, c: Cell) -> None:
        """A layer's first cell: its weights in hand, and the next layer's start loading."""
        with self.eng.clock.timed("io_wait"):
            self.w = self.eng.io.adopt(self.w_next.result())
        if c.load is not None:
            self.w_next = self._load(c.load)

    def receive(self, c: Cell) -> None:
        """A micro-batch's input from the stage before, split into its GPU batches."""
        x_in = self.eng.link.receive(c.receive)  # x_in: [per * gbs, S, hidden]
        for i in range(self.per):
            self.hidden[c.batch + i] = x_in[i * self.gbs:(i + 1) * self.gbs]

    def prefetch(self, c: Cell) -> None:
        """Start the read of the next cell that reads a cache (engine/cell.py KVReader.prefetch),
        with what its early query needs when it is the very next cell."""
        m = c.read
        if m is None and self.carry:  # past the step's last reading cell: the next step's may start
            self._read_further(c.n)
        if m is None or not self.reads.may_start(c.n, m):
            return
        mk, layer = c.read_batch, self.eng.layers[c.read_layer]
        ahead = None
        if c.query_early:
            x = self.hidden[mk] if c.input_ready or mk == c.batch else None  # x: [gbs, 1, hidden]
            ahead = Ahead(self.w if c.read_layer == c.layer else self.w_next, x, self.pos[mk], c.input_ready)
        table = self.eng.tables[(layer.index, mk)]
        if self.reads.start(m, lambda: self.eng.reader.prefetch(table, layer.index, layer.kind, ahead)):
            self._read_further(c.n)

    def _read_further(self, n: int) -> None:
        """Start the gathers planned without a query further on (CacheReads.further), in order,
        until one cannot start (its policy waits for the query: then none further this step).
        Past the step's last reading cell, the next step's, of layers this step is done with (their
        tables as the next step finds them: every token in, every sealed block stored)."""
        done_with = self.cells[n].layer  # layers before it have run finish_layer
        beyond = (lambda m: self.cells[m].layer < done_with) if self.carry else None
        while (m := self.reads.further(n, beyond)) is not None:
            span = len(self.cells)
            layer, table = self.eng.layers[self.cells[m % span].layer], self._table(m % span)
            if not self.reads.start(m, lambda: self.eng.reader.prefetch(table, layer.index, layer.kind, None,
                                                                        landing_only=m >= span)):
                self.reads.no_further = True
                return

    def _key(self, m: int) -> tuple[int, int]:
        """The engine's key (layer index, GPU batch) of the KV table cell m reads."""
        cell = self.cells[m]
        return self.eng.layers[cell.layer].index, cell.batch

    def _table(self, m: int):
        """The KV table cell m reads."""
        return self.eng.tables[self._key(m)]

    def compute(self, c: Cell) -> None:
        """The cell's layer on its GPU batch, with its cache read in hand; its sealed blocks start storing."""
        eng, k = self.eng, c.batch
        layer = eng.layers[c.layer]
        fetched = None if self.prefill else self.reads.take(c.n)
        x = to_compute(eng.devices, self.hidden[k])
        with eng.clock.timed("io_wait"):
            got = eng.io.adopt(fetched.result()) if fetched is not None else None
        y, jobs = compute(eng, layer, self.w, x, self.batch_ids[k], k, self.pos[k], self.pads[k], got, self.prefill)
        self.stores += [eng.io.submit(job) for job in jobs]
        if layer.kind == "head":
            self.logits[k] = y  # [gbs, V]
        else:
            self.hidden[k] = park(eng, y)

    def finish_layer(self) -> None:
        """A layer's last cell: its sealed blocks are home before it runs again."""
        with self.eng.clock.timed("io_wait"):
            for f in self.stores:
                f.result()
        self.stores = []

    def send(self, c: Cell) -> None:
        """A micro-batch's output, on to the next stage."""
        k = c.batch
        self.eng.link.send(c.send, torch.cat(self.hidden[k + 1 - self.per:k + 1]))  # [per * gbs, S, hidden]

    def carried(self) -> tuple[dict[int, Future], dict]:
        """The next step's gathers this step started (CacheReads.carried), keyed by their cell, and
        the tables they read, keyed as the engine keys them."""
        pending = {} if self.reads is None else self.reads.carried()
        return pending, {self._key(m): self._table(m) for m in pending}

    def end(self) -> torch.Tensor | None:
        """The step's logits [B, V] (None on a stage without the head), once its sends are done."""
        if self.eng.link is not None:
            self.eng.link.end_step()
        if self.logits[0] is None:
            return None
        return self.logits[0] if len(self.logits) == 1 else torch.cat(self.logits)  # [B, V]
