"""Keeping what a layer read on the compute device, so the next step reads only what changed.

A query-aware selection recurs: most (block, sequence) pairs a layer reads at one decode step it
reads again at the next (SparPR keep 0.1, SmolLM2, 2k tokens, batch 4: 77 %). For a cache that
lives off the compute device, each table keeps an arena of block slots on the compute device;
a step's selected sealed blocks that a slot already holds (for every sequence that needs them)
are attended where they are, the others are read from their tier into free slots (least recently
used first), and the open block is copied after the slots. Attention reads the arena with a mask
that keeps each sequence and head to its own selected blocks: the same tokens at their own
positions as a fresh gather attends (their order differs, so sums may differ in the last bits).

Memory: per table, ARENA_SLACK x the largest selection so far, in slots of one block. A rewound
table (a cache cut back: engine/reuse.py, a snapshot restored) starts afresh.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, replace

import torch

from ..kv.block_table import BlockTable
from ..kv.policy import ARENA_SLACK, Selection
from .recovery import Fetched


@dataclass
class _Arena:
    """One table's slots: kv [2, B, Hkv, C*bs + bs + 1, D] (the open block and the step's token
    after the C slots), pos [C*bs + bs + 1], which block each slot holds, for which sequences."""

    kv: torch.Tensor
    pos: torch.Tensor
    block_of: list[int]  # [C] block id in each slot, -1: none
    slot_of: dict[int, int]
    had: torch.Tensor  # [B, C] bool on the host: the sequences whose rows a slot holds
    used: list[int]  # [C] the step each slot was last attended
    rewinds: int
    step: int = 0

    @property
    def slots(self) -> int:
        return len(self.block_of)


class Recall:
    """Per offloaded table, its arena (see the module docstring). Thread-safe per table: a
    table's gathers run one at a time (a cell's prefetch, or its read)."""

    def __init__(self):
        self._arenas: weakref.WeakKeyDictionary[BlockTable, _Arena] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    @staticmethod
    def applies(t: BlockTable, sel: Selection) -> bool:
        """A plain copy of whole blocks of an offloaded raw cache: no rebuilds, no per-sequence
        rows, not a guess, no exact rows held in place of encoded blocks."""
        return not t.store.resident and not sel.recompute and sel.rows is None and not sel.guess and \
            not t.store.holds_exact_rows()

    def gather(self, t: BlockTable, sel: Selection, dtype: torch.dtype, device: torch.device) -> Fetched:
        """What attention reads for sel (kv with the step's spare last slot, pos, and sel with its
        mask over the arena's tokens), reading from the tiers only the blocks no slot holds."""
        _, b, hkv, bs, d = t.block_shape
        sealed = [x for x in sel.blocks if x < t.sealed]
        open_len = t.length - t.sealed * bs if sel.blocks and sel.blocks[-1] == t.sealed else 0
        # need: [B, n] on the host, beside the arena's bookkeeping (a policy may leave seqs on the device)
        need = sel.seqs[:, :len(sealed)].cpu() if sel.seqs is not None else torch.ones(b, len(sealed), dtype=torch.bool)
        with self._lock:
            ar = self._arenas.get(t)
        if ar is None or ar.rewinds != t.rewinds or ar.kv.dtype != dtype or ar.slots < len(sealed):
            ar = self._new(t, max(int(len(sealed) * ARENA_SLACK) + 1, ar.slots if ar is not None else 0), dtype,
                           device, ar)
        ar.step += 1
        slots = [ar.slot_of.get(x, -1) for x in sealed]
        known = torch.tensor([s >= 0 for s in slots], dtype=torch.bool)  # known: [n]
        held = ar.had[:, [max(s, 0) for s in slots]] & known  # held: [B, n]
        short = ~held & need  # short: [B, n] rows to read
        hit = (~short.any(dim=0)).tolist()  # hit: [n] nothing to read
        for s, h in zip(slots, hit):
            if h:
                ar.used[s] = ar.step
        miss = [i for i, h in enumerate(hit) if not h]
        if miss:
            chosen = set(sealed)
            free = iter(sorted((s for s in range(ar.slots) if ar.used[s] != ar.step and
                                ar.block_of[s] not in chosen), key=ar.used.__getitem__))
            for i in miss:  # a block some slot holds for other rows keeps its slot; else the oldest free one
                if slots[i] < 0:
                    s = slots[i] = next(free)
                    if ar.block_of[s] >= 0:
                        del ar.slot_of[ar.block_of[s]]
                    ar.block_of[s], ar.slot_of[sealed[i]] = sealed[i], s
                    ar.had[:, s] = False
                    ar.pos[s * bs:(s + 1) * bs] = torch.arange(sealed[i] * bs, (sealed[i] + 1) * bs, device=device)
                ar.used[slots[i]] = ar.step
            rows = short[:, miss]  # rows: [B, m]
            t.gather([sealed[i] for i in miss], ar.kv, seqs=rows, zero_unread=False,
                     starts=[slots[i] * bs for i in miss])
            ar.had[:, [slots[i] for i in miss]] |= rows
        c = ar.slots * bs
        if open_len:
            t.gather([t.sealed], ar.kv, starts=[c])  # from the compute device
            ar.pos[c:c + open_len] = torch.arange(t.sealed * bs, t.length, device=device)
        mask = self._mask(sel, slots, ar.slots, b, hkv, bs, open_len, device)
        out = ar.kv[:, :, :, :c + open_len + 1]  # out: [2, B, Hkv, C*bs + open + 1, D]
        return Fetched(out, ar.pos[:c + open_len + 1], replace(sel, mask=mask))

    @staticmethod
    def _mask(sel: Selection, slots: list[int], n_slots: int, b: int, hkv: int, bs: int, open_len: int,
              device: torch.device) -> torch.Tensor:
        """[B, Hkv, C*bs + open]: sel's mask moved from its blocks' order to their slots."""
        n = len(slots)
        m = torch.zeros(b, hkv, n_slots, bs, dtype=torch.bool, device=device)  # m: [B, Hkv, C, bs]
        if sel.mask is None:
            m[:, :, slots] = True
            tail = torch.ones(b, hkv, open_len, dtype=torch.bool, device=device)
        else:
            src = sel.mask[:, :, :n * bs].reshape(b, hkv, n, bs)  # src: [B, Hkv, n, bs]
            m.index_copy_(2, torch.tensor(slots, dtype=torch.long, device=device), src)
            tail = sel.mask[:, :, n * bs:n * bs + open_len].expand(b, hkv, open_len)
        return torch.cat([m.flatten(2), tail], dim=2)

    def _new(self, t: BlockTable, n_slots: int, dtype: torch.dtype, device: torch.device, old: _Arena | None) -> _Arena:
        """A table's arena of n_slots slots (zeros: stale rows stay finite), keeping an old one's
        slots when it only grows."""
        _, b, hkv, bs, d = t.block_shape
        kv = torch.zeros(2, b, hkv, n_slots * bs + bs + 1, d, dtype=dtype, device=device)
        pos = torch.zeros(n_slots * bs + bs + 1, dtype=torch.long, device=device)
        ar = _Arena(kv, pos, [-1] * n_slots, {}, torch.zeros(b, n_slots, dtype=torch.bool), [0] * n_slots, t.rewinds)
        if old is not None and old.rewinds == t.rewinds and old.kv.dtype == dtype:
            c = old.slots
            kv[:, :, :, :c * bs] = old.kv[:, :, :, :c * bs]
            pos[:c * bs] = old.pos[:c * bs]
            ar.block_of[:c], ar.slot_of, ar.used[:c], ar.step = old.block_of, old.slot_of, old.used, old.step
            ar.had[:, :c] = old.had
        with self._lock:
            self._arenas[t] = ar
        return ar

    def clear(self) -> None:
        """Forget every table's arena."""
        with self._lock:
            self._arenas.clear()
