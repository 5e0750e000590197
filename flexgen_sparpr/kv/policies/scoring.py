"""What the block-scoring policies share (Quest, SparPR; the upstream SparPR hook uses the pick).

Summaries. Each sealed block keeps a summary on the compute device: made from its keys when it
seals (`table.on_seal`), made again with the padding known once the prefill is seen, and
backfilled from the cache for blocks sealed before the policy was attached (the only time a
policy reads an offloaded block to score it). A subclass says what a summary is
(`empty_summaries`, `summarise`) and scores blocks from them; the rest is here.

Pick. `budgeted_pick` takes, per row, the blocks a policy always reads, then the best-scoring
others in score order while their valid tokens fit the row's budget (whole blocks; it stops at
the first that does not fit).
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..block_table import BlockTable
from .base import BudgetPolicy


def budgeted_pick(score: torch.Tensor, counts: torch.Tensor, room: torch.Tensor,
                  own: torch.Tensor | None = None) -> torch.Tensor:
    """score: [..., nb] (-inf: never picked); counts: [..., nb] valid tokens of each block
    (broadcast to score); room: [...] tokens the picked blocks may add; own: [..., nb] bool, blocks
    always read (outside the budget and the ranking) or None. Returns pick: [..., nb] bool."""
    if own is not None:
        score, counts = score.masked_fill(own, -math.inf), counts.masked_fill(own, 0)
    ranked, order = score.sort(dim=-1, descending=True)  # ranked, order: [..., nb]
    taken = counts.expand_as(order).gather(-1, order).cumsum(dim=-1)  # taken: [..., nb]
    fits = (taken <= room[..., None]) & (ranked > -math.inf)
    pick = torch.zeros_like(fits).scatter_(-1, order, fits)
    return pick if own is None else own | pick


def exact_block_mass(table: BlockTable, q: torch.Tensor, sealed: int, pad_bias: torch.Tensor | None,
                     live: torch.Tensor | None, per_head: bool) -> torch.Tensor:
    """The attention mass each sealed block gets, from the cached keys themselves (every block
    read: the ceiling of any summary's choice, for study). q: [B, H, 1, D]; pad_bias: [B, sealed
    * bs] 0 or -inf or None; live: [B, nb] blocks holding a valid token (None: all) -> [B, Hkv, nb]
    (per_head: each KV head's query heads' softmax over the sealed tokens, summed) or [B, nb]
    (those summed over the KV heads as well); -inf: a block with no valid token."""
    kv, _ = table.gather()  # kv: [2, B, Hkv, L, D]; a view when the cache is resident
    b, h, _, d = q.shape
    hkv, t = kv.shape[2], sealed * table.bs
    qg = q.float().view(b, hkv, h // hkv, d)  # qg: [B, Hkv, G, D]
    logit = torch.einsum("bkgd,bktd->bkgt", qg, kv[0, :, :, :t].float()) / math.sqrt(d)  # logit: [B, Hkv, G, T]
    if pad_bias is not None:
        logit += pad_bias[:, None, None]
    mass = logit.softmax(dim=-1).sum(dim=2).view(b, hkv, sealed, table.bs).sum(dim=-1)  # mass: [B, Hkv, nb]
    score = mass if per_head else mass.sum(dim=1)  # score: [B, (Hkv,) nb]
    return score if live is None else score.masked_fill(~(live[:, None] if per_head else live), -math.inf)


def top_pick(score: torch.Tensor, k: int, own: torch.Tensor | None = None) -> torch.Tensor:
    """budgeted_pick where every block the ranking can take holds the same number c of valid tokens
    (no left padding): the k = room // c best blocks outside `own` with a finite score, and `own`.
    One top-k instead of a full sort and a running sum. score: [..., nb]; own: [..., nb] bool or
    None. Returns pick: [..., nb] bool."""
    if own is not None:
        score = score.masked_fill(own, -math.inf)
    k = min(k, score.shape[-1])
    pick = torch.zeros(score.shape, dtype=torch.bool, device=score.device)
    if k > 0:
        top, idx = score.topk(k, dim=-1, sorted=False)  # top, idx: [..., k]
        pick.scatter_(-1, idx, top > -math.inf)
    return pick if own is None else own | pick


def picked_tokens(pick: torch.Tensor, table: BlockTable) -> torch.Tensor:
    """pick: [..., nb] over the sealed blocks -> keep: [..., L] over the cached positions, the
    open (partial) block always kept."""
    sealed = pick.shape[-1] * table.bs
    keep = torch.ones(*pick.shape[:-1], table.length, dtype=torch.bool, device=pick.device)
    keep[..., :sealed] = pick.repeat_interleave(table.bs, dim=-1)
    return keep


@dataclass(eq=False)
class _Summaries:
    parts: tuple[torch.Tensor, ...]  # each with the block axis at its policy's summary_axes
    known: list[bool]
    checked: int = 0  # blocks below this were all known when last looked at (known only ever turns True)


@dataclass(eq=False)
class BlockScoringPolicy(BudgetPolicy):
    """Base of the policies that score sealed blocks by a per-block summary of their keys."""

    # per summary tensor, where it keeps its block axis (e.g. sequence-major, so that scoring a
    # prefix of blocks reads a view, not a copy)
    summary_axes: ClassVar[tuple[int, ...]] = ()

    def __post_init__(self):
        super().__post_init__()
        self._sums: weakref.WeakKeyDictionary[BlockTable, _Summaries] = weakref.WeakKeyDictionary()

    # --- what a subclass supplies ---
    def empty_summaries(self, table: BlockTable) -> tuple[torch.Tensor, ...]:
        """Zero summaries of all the table's blocks, on the compute device."""
        raise NotImplementedError

    def summarise(self, table: BlockTable, keys: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """keys: [B, Hkv, n, bs, D] float32 of n sealed blocks; valid: [B, n, bs] (False: left
        padding). Returns their summaries, each with a leading [n] axis."""
        raise NotImplementedError

    def seal_in_place(self, table: BlockTable, parts: tuple[torch.Tensor, ...], block: int, keys: torch.Tensor) -> bool:
        """A block just sealed (keys: [B, Hkv, bs, D] as the cache holds them) summarised straight into
        parts at block, where a subclass has a one-call way; False: summarise and _put do it."""
        return False

    # --- summaries ---
    def attach(self, table: BlockTable, layer: int) -> None:
        if table in self._sums:  # attached twice (engine policy and observer): one hook
            return
        nb, parts = table.capacity // table.bs, self.empty_summaries(table)
        assert len(parts) == len(self.summary_axes), "one block axis per summary tensor"
        sums = self._sums[table] = _Summaries(parts, [False] * nb)
        ref, tref = weakref.ref(sums), weakref.ref(table)  # the table holds the hook; the hook must not hold it

        def on_seal(block: int, kv: torch.Tensor) -> None:
            s, t = ref(), tref()
            # a prefill's own blocks (its padding not yet seen) are summarised in on_prefill, all at
            # once: one summarise per block here cost as much as the prefill's attention
            if s is None or t is None or t not in self._pads:
                return
            if not self.seal_in_place(t, s.parts, block, kv[0]):
                keys = kv[0].float()[:, :, None]  # keys: [B, Hkv, 1, bs, D]
                pos = block * t.bs + torch.arange(t.bs, device=keys.device)
                self._put(s, slice(block, block + 1), self.summarise(t, keys, self._valid(t, pos)[:, None]))
            s.known[block] = True
        table.on_seal.append(on_seal)

    def _valid(self, table: BlockTable, pos: torch.Tensor) -> torch.Tensor:
        """[B, T]: positions pos [T] that are not left padding (all of them before the prefill is seen:
        a prefill's blocks are summarised again in on_prefill, with its padding)."""
        pads = self._pads.get(table)
        if pads is None:
            return torch.ones(table.block_shape[1], pos.shape[0], dtype=torch.bool, device=pos.device)
        return pos[None, :] >= pads[:, None]

    def _put(self, s: _Summaries, ids, values: tuple[torch.Tensor, ...]) -> None:
        """Blocks `ids` (a slice or list) from summarise's values (leading [n])."""
        for t, axis, v in zip(s.parts, self.summary_axes, values):
            t[(slice(None),) * axis + (ids,)] = v.movedim(0, axis).to(device=t.device, dtype=t.dtype)

    def on_prefill(self, table: BlockTable, layer: int, q, k, valid) -> None:
        super().on_prefill(table, layer, q, k, valid)
        if table not in self._sums:
            self.attach(table, layer)
        s, bs = self._sums[table], table.bs
        sealed = table.length // bs
        if sealed and table.length == k.shape[2]:  # a prefill into an empty table: redo with its padding
            keys = k[:, :, :sealed * bs].float().unflatten(2, (sealed, bs))  # keys: [B, Hkv, n, bs, D]
            valid = valid[:, :sealed * bs].unflatten(1, (sealed, bs))  # valid: [B, n, bs]
            self._put(s, slice(0, sealed), self.summarise(table, keys, valid))
            s.known[:sealed] = [True] * sealed

    def summaries(self, table: BlockTable, layer: int, whole: bool = False) -> tuple[torch.Tensor, ...]:
        """The sealed blocks' summaries (views narrowed to them along each block axis; whole: every
        block's, as they lie); blocks sealed before this policy was attached are summarised once, from the cache."""
        if table not in self._sums:
            self.attach(table, layer)
        s, bs, sealed = self._sums[table], table.bs, table.length // table.bs
        missing = [i for i in range(s.checked, sealed) if not s.known[i]]
        s.checked = max(s.checked, sealed)
        if missing:
            kv, pos = table.gather(missing)
            keys = kv[0].float().unflatten(2, (len(missing), bs))  # keys: [B, Hkv, m, bs, D]
            valid = pos.view(len(missing), bs)[None] >= self.pads(table)[:, None, None]  # valid: [B, m, bs]
            self._put(s, missing, self.summarise(table, keys, valid))
            for i in missing:
                s.known[i] = True
        return s.parts if whole else tuple(t.narrow(axis, 0, sealed) for t, axis in zip(s.parts, self.summary_axes))

    # --- the pick ---
    def block_counts(self, table: BlockTable) -> tuple[torch.Tensor, torch.Tensor]:
        """(valid [B, L] cached tokens that are not padding, counts [B, nb] of each sealed block)."""
        b, bs, sealed = table.block_shape[1], table.bs, table.length // table.bs
        valid = self.valid_tokens(table)  # valid: [B, L]
        return valid, valid[:, :sealed * bs].view(b, sealed, bs).sum(dim=2)
