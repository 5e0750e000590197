"""Selecting a query-aware policy's blocks one (layer, GPU batch) ahead, so their recovery
overlaps the compute before it, like the engine's other prefetches.

The schedule runs every GPU batch of layer j before layer j+1. While (j, k) computes, the next
cell is (j, k+1), whose input is batch k+1's hidden state, or (j+1, 0), whose input is batch 0's
output of layer j, already computed when k is the last batch. Either way the next cell's query
is exact: its attention input through the query projection alone (RoPE at its positions for
Llama). With one GPU batch the next cell's input is the output still being computed, so a
query-aware selection waits for the real query (no overlap) — unless the engine speculates
(`EngineConfig.speculative_prefetch`): then the next layer's query is guessed from the current
layer's input (the residual stream changes little from one layer to the next), its blocks are
gathered while this layer computes, and at the next layer the exact selection reuses what the
guess read and reads the rest then (recovery.py `top_up`). The exact selection is what attention
uses, so the output does not change; only the bytes of wrong guesses are added.
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
from concurrent.futures import Future
from typing import NamedTuple

import torch

from ..kv.block_table import BlockTable
from ..kv.policy import KVPolicy, Selection
from ..storage.tiers import Devices
from .io import Done, IOPool, to_compute
from .recovery import Fetched
from .weights import sub_weights


class Ahead(NamedTuple):
    """What the next (layer, batch) cell needs to compute its query early."""

    weights: dict | Future  # the next cell's layer weights (a Future while they load)
    x: torch.Tensor | None  # [B, 1, hidden] its input hidden state
    pos: torch.Tensor  # [B, 1] its positions
    input_ready: bool  # False: the next cell's input is still being computed (one GPU batch)


def early_selection(policy: KVPolicy, arch, table: BlockTable, layer: int, kind: str, ahead: Ahead | None,
                    io: IOPool, devices: Devices, speculate: bool = False) -> Selection | None:
    """The policy's selection for cell (layer, table) of kind attn or block, from its exact query,
    or from a guessed one (Selection.guess) when `speculate` and the cell's input is not computed
    yet; None when neither can be had without waiting (no input, or the weights still loading).
    The query is the cell's attention input through the query projection alone (arch)."""
    guess = ahead is not None and not ahead.input_ready and speculate
    if ahead is None or not (ahead.input_ready or guess) or ahead.x is None or kind not in ("attn", "block"):
        return None
    w = ahead.weights
    if isinstance(w, (Future, Done)):
        if not w.done():  # never stall the current cell on the next layer's weights
            return None
        w = io.adopt(w.result())
    if kind == "block":
        w = sub_weights(w, "a.")
    q = arch.query(w, arch.attn_input(w, to_compute(devices, ahead.x)), ahead.pos)  # q: [B, H, 1, D]
    if not guess:
        return policy.select(table, layer, q)
    sel = policy.speculate(table, layer, q)
    return dataclasses.replace(sel, guess=True)


class Landing:
    """A gather whose disk blocks are still landing (KVReader._land_later), answered like a Future:
    result() waits for the reads and gives the Fetched with its landed blocks."""

    def __init__(self, fetched: Fetched, land: list[int], view: torch.Tensor, reads):
        self._fetched, self._land, self._view, self._reads = fetched, land, view, reads

    def done(self) -> bool:
        return self._reads is None

    def result(self, timeout=None) -> Fetched:
        if self._reads is not None:
            reads, self._reads = self._reads, None
            reads.wait()
            self._fetched.landed = (self._land, self._view)
        return self._fetched

    def drop(self) -> None:
        """Unused (a read carried to a step that did not take it): its reads reaped (and counted)."""
        if self._reads is not None:
            reads, self._reads = self._reads, None
            reads.drop()


class CacheReads:
    """A decode step's KV gathers in flight, keyed by schedule cell. A cell that reads a
    cache is gathered as soon as the cell before it in cache order has started, so with separate
    attention and MLP cells the gather for layer j+1 runs through layer j's attention and MLP, not
    only its MLP. Two cells early only when the cell between has its own gather in hand (it will
    not read serially). A gather that cannot start yet (a query-aware policy still waiting for its
    query) is not recorded, and is tried again at the next cell.

    Gathers planned without a query (dense, StreamingLLM: `KVPolicy.plan`) may run further ahead:
    up to `ahead` of them beyond the computing cell's, each started only when every reading cell
    before it holds its own, so that the disk always has a read in flight while layers compute
    (a step with its KV on disk otherwise waits on one layer's read at a time). The gather ring
    (engine/recovery.py GatherRing) holds ahead + 2 buffers. The first such gather that cannot start
    (a query-aware policy) ends the trying for the step: it would fail at every cell.

    Past the step's last reading cell, `further` goes on into the next step's (keyed `span` on:
    cell m of the next step is span + m) where `beyond(m)` allows it; the step hands those on
    (`carried`), and the next step starts holding them (`pending`). Only a step that another follows
    (Engine.step: not the generation's last) starts them. Without this the disk idled
    from the last layer's read to the next step's first (the last layers, the head, sampling):
    a tenth of a dense step with half its KV on disk."""

    def __init__(self, reads, ahead: int = 1, span: int = 0, pending: dict[int, Future] | None = None):
        self.order = tuple(sorted(reads))  # the cells that read a cache (engine/schedule.py StepSchedule.reads)
        self.reads = frozenset(reads)
        self.ahead = ahead
        self.span = span  # the step's cell count: the next step's cell m is keyed span + m
        self.pending: dict[int, Future] = dict(pending or {})  # carried from the step before, if any
        self.no_further = False  # a gather further on could not start: none will this step

    def may_start(self, n: int, m: int) -> bool:
        """Whether cell n may start cell m's gather: m is next, or n reads nothing or holds its own."""
        return m == n + 1 or n not in self.reads or n in self.pending

    def further(self, n: int, beyond=None) -> int | None:
        """The next reading cell after n whose gather may start at cell n beyond the very next one:
        every reading cell from n on holds its gather, and fewer than `ahead` are pending after n.
        Past this step's last, the next step's reading cells (keyed span + m) where beyond(m)."""
        if self.no_further or (n in self.reads and n not in self.pending):
            return None
        held = 0
        later = ((m, False) for m in self.order[bisect.bisect_right(self.order, n):])
        nxt = () if beyond is None else ((self.span + m, True) for m in self.order)
        for m, next_step in itertools.chain(later, nxt):
            if m not in self.pending:
                if held >= self.ahead or (next_step and not beyond(m - self.span)):
                    return None
                return m
            held += 1
        return None

    def start(self, m: int, gather) -> bool:
        """gather() -> Future for cell m, unless started already; a done future of None is dropped.
        Returns whether m's gather is pending now."""
        if m in self.pending:
            return True
        f = gather()
        if not (f.done() and f.result() is None):
            self.pending[m] = f
            return True
        return False

    def take(self, n: int) -> Future | None:
        """Cell n's gather, if one was started."""
        return self.pending.pop(n, None)

    def carried(self) -> dict[int, Future]:
        """The next step's gathers started in this one, keyed by their cell in it."""
        return {m - self.span: f for m, f in self.pending.items() if m >= self.span}


def drop(f) -> None:
    """Let a gather go unused: its reads reaped (counted: the disk read them), its buffer free again."""
    if hasattr(f, "drop"):
        f.drop()
        return
    try:
        f.result()
    except Exception:  # an unused read that failed: nothing waits for it
        pass


class Carry:
    """The next step's gathers a decode step started (CacheReads.carried), and the state of the
    tables they read: the next step takes them only where it finds the same schedule, policy and
    tables, each at the length and rewind count it had (else they are dropped)."""

    def __init__(self, pending: dict[int, Future], plan, policy, tables: dict):
        self.pending, self.plan, self.policy = pending, plan, policy
        self.marks = {key: (t, t.length, t.rewinds) for key, t in tables.items()}  # the carried cells' tables

    def take(self, plan, policy, tables: dict) -> dict[int, Future] | None:
        """The gathers, where the step about to run is the one they were started for; else None
        (dropped)."""
        if plan == self.plan and policy is self.policy and all(
                tables.get(key) is t and t.length == n and t.rewinds == r for key, (t, n, r) in self.marks.items()):
            pending, self.pending = self.pending, {}
            return pending
        self.drop()
        return None

    def drop(self) -> None:
        for f in self.pending.values():
            drop(f)
        self.pending = {}
