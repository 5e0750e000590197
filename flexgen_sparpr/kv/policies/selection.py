"""The block selection the query-aware block policies share (Quest, SparPR): budget -> scores ->
one budgeted top-k -> the Selection, then a policy's plan for how the chosen blocks arrive.

A decode step calls `select` once per layer, so its cost is paid num_layers times a step. It is
built to issue a constant, small number of tensor calls per layer whatever the batch, heads or
block count, with no Python loop over blocks or sequences:
- What depends only on the step's context length and left padding (each sealed block's valid
  tokens, the blocks every step reads, the tokens they take, the budgets) is the same for every
  layer's table of a GPU batch: it is computed once per step (`StepView`) and shared.
- A policy supplies its block scores (`block_scores`: a fused op over its summaries).
- `budgeted_pick` ranks and takes blocks with tensor ops (`top_pick`, one top-k, where no left
  padding makes every block hold bs tokens); `selection_from_pick` turns the pick into the blocks
  to move, their readers and the token mask with one host sync.
- Where the cache is resident on the CPU, one compiled call takes the last two steps at once
  (fused_pick.py), to the same pick and Selection.
- `finish` is the policy's plan (SparPR: copy or rebuild each span, dense fallback).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import compress

import torch

from ..block_table import BlockTable
from ..policy import Selection
from .base import token_budget
from .fused_pick import fused_selection
from .scoring import BlockScoringPolicy, budgeted_pick, top_pick

_VIEWS = 16  # step views kept per policy (a few GPU batches' worth of the current step)


@dataclass(eq=False)
class StepView:
    """What a step's selection needs that depends only on the context length and left padding."""

    length: int
    sealed: int
    valid: torch.Tensor  # [B, L] cached tokens that are not left padding
    counts: torch.Tensor  # [B, nb] valid tokens of each sealed block
    own: torch.Tensor | None  # [B, nb] blocks every step reads (None: none)
    used: torch.Tensor  # [B] tokens the own blocks and the open block take from the budget
    open_tokens: torch.Tensor  # [] valid tokens of the open block, summed over the batch
    n_valid: list[int]  # [B] valid cached tokens, on the host
    pad_bias: torch.Tensor | None  # [B, sealed * bs] 0 or -inf (None: no left padding)
    live: torch.Tensor | None  # [B, nb] blocks holding a valid token (None: all of them)
    used_host: int | None  # no left padding: `used` of every sequence (all alike), on the host; else None
    rooms: dict = field(default_factory=dict)  # keep target -> its Room


@dataclass(eq=False)
class Room:
    """What the budgeted pick may add at one keep target."""

    tokens: torch.Tensor  # [B] tokens the picked blocks may add
    blocks: int | None  # with no left padding, the same for every sequence: tokens // bs blocks; else None


def selection_from_pick(table: BlockTable, pick: torch.Tensor, view: StepView) -> Selection:
    """pick: [B, nb] (every KV head alike) or [B, Hkv, nb] bool over the sealed blocks -> the
    Selection moving every block some sequence picked (and the open block), each only for the
    sequences that picked it, with a mask keeping each (sequence, head) to its own blocks. One
    sequence reading the same blocks on every head needs no mask."""
    b, hkv, bs = table.block_shape[1], table.block_shape[2], table.bs
    open_len = view.length - view.sealed * bs
    if b == 1 and pick.dim() == 2:  # one sequence, every head alike: the blocks alone (one host sync)
        blocks = pick[0].nonzero().view(-1).tolist()
        nseq = [1] * len(blocks)
        return Selection(blocks + [view.sealed] if open_len else blocks, nseq=nseq)
    per_seq = pick if pick.dim() == 2 else pick.any(dim=1)  # per_seq: [B, nb]
    readers = per_seq.sum(dim=0)  # readers: [nb] sequences that picked each block
    most, *host = torch.cat([per_seq.sum(dim=1).amax()[None], readers]).tolist()  # the one host sync
    blocks = list(compress(range(len(host)), host))  # the picked blocks, ascending (no Python loop per block)
    nseq = list(filter(None, host))
    if open_len:
        blocks.append(view.sealed)
    # chosen: [n] the picked block ids, ascending, sorted out on the device (no second sync)
    chosen = torch.argsort((readers == 0).to(torch.uint8), stable=True)[:len(nseq)]
    if b > 1 and table.store.resident:
        return _rows_selection(table, pick, per_seq, chosen, blocks, nseq, most, view)
    m = pick.index_select(-1, chosen)  # m: [B, (Hkv,) n]
    mask = m.repeat_interleave(bs, dim=-1)  # mask: [B, (Hkv,) n * bs]
    seqs = per_seq.index_select(1, chosen)  # seqs: [B, n]
    if open_len:
        mask = torch.cat([mask, mask.new_ones(*mask.shape[:-1], open_len)], dim=-1)  # + the open block
        seqs = torch.cat([seqs, seqs.new_ones(b, 1)], dim=1)
    if pick.dim() == 2:
        mask = mask[:, None].expand(b, hkv, mask.shape[-1])  # mask: [B, Hkv, T]
    return Selection(blocks, mask, seqs=table.devices.streams.on_host(seqs), nseq=nseq)


def _rows_selection(table: BlockTable, pick: torch.Tensor, per_seq: torch.Tensor, chosen: torch.Tensor,
                    blocks: list[int], nseq: list[int], most: int, view: StepView) -> Selection:
    """selection_from_pick for a resident cache's batch: each sequence's picked blocks in its own
    row (ascending, padded to the longest row with blocks it did not pick, masked out)."""
    b, hkv, bs = table.block_shape[1], table.block_shape[2], table.bs
    dev = pick.device
    order = torch.argsort((~per_seq).to(torch.uint8), dim=1, stable=True)[:, :most]  # order: [B, k] picked first
    tok = torch.arange(bs, device=dev)
    rows = (order[:, :, None] * bs + tok).flatten(1)  # rows: [B, k * bs]
    if pick.dim() == 2:
        mask = per_seq.gather(1, order).repeat_interleave(bs, dim=1)[:, None]  # mask: [B, 1, k * bs]
    else:
        mask = pick.gather(2, order[:, None].expand(b, hkv, most)).repeat_interleave(bs, dim=2)  # [B, Hkv, k * bs]
    open_len = view.length - view.sealed * bs
    if open_len:
        rows = torch.cat([rows, torch.arange(view.sealed * bs, view.length, device=dev).expand(b, open_len)], dim=1)
        mask = torch.cat([mask, mask.new_ones(*mask.shape[:2], open_len)], dim=2)
    seqs = per_seq.index_select(1, chosen)  # seqs: [B, n] (the union, as the statistics count it)
    if open_len:
        seqs = torch.cat([seqs, seqs.new_ones(b, 1)], dim=1)
    return Selection(blocks, mask.expand(b, hkv, mask.shape[2]), seqs=table.devices.streams.on_host(seqs), rows=rows,
                     nseq=nseq)


def shared_pick(score: torch.Tensor, view: StepView, room: Room) -> torch.Tensor:
    """One set of blocks for the whole batch: the sequences take turns by rank (rank 0 of every
    sequence, then rank 1, ...) while every one's budget holds. score: [B, nb]; room: [B] tokens
    each may add. Returns pick: [B, nb] (SparPR's --no-per-sequence ablation: a host loop)."""
    counts, own = view.counts, view.own
    budgets = (room.tokens + view.used).tolist()
    cand = ~own.all(dim=0) & (counts > 0).any(dim=0)  # cand: [nb] (another's sink may be one)
    ranked = score.masked_fill(~cand[None, :], -math.inf).argsort(dim=-1, descending=True)
    ranked = ranked[:, :int(cand.sum())].T.tolist()  # [rank][sequence] -> block id
    used = view.used.tolist()
    cnt, picked = (counts * ~own).T.tolist(), {}  # what a block adds to each sequence's reads
    for blk in (blk for row in ranked for blk in row):  # rank 0 of every sequence, then rank 1...
        if blk not in picked and all(u + c <= m for u, c, m in zip(used, cnt[blk], budgets)):
            picked[blk] = True
            used = [u + c for u, c in zip(used, cnt[blk])]
    pick = own.clone()
    pick[:, list(picked)] = True
    return pick


@dataclass(eq=False)
class BlockSelectionPolicy(BlockScoringPolicy):
    """Base of the policies that pick sealed blocks by a query-aware score under a token budget."""

    def __post_init__(self):
        super().__post_init__()
        self._views: dict[tuple, StepView] = {}

    # --- what a subclass supplies ---
    def block_scores(self, table: BlockTable, layer: int, q: torch.Tensor, view: StepView) -> torch.Tensor:
        """q: [B, H, 1, D] -> [B, nb] (one choice for all KV heads) or [B, Hkv, nb] scores of the
        sealed blocks; -inf: never picked."""
        raise NotImplementedError

    def own_blocks(self, table: BlockTable, counts: torch.Tensor) -> torch.Tensor | None:
        """[B, nb] bool: sealed blocks every step reads besides the open block (None: none)."""
        return None

    def keep_target(self, table: BlockTable, q: torch.Tensor) -> tuple[float, float]:
        """(the keep ratio this step's budget uses, rho: the cost ratio that set it, or nan)."""
        return self.keep_ratio, math.nan

    def pick(self, table: BlockTable, score: torch.Tensor, view: StepView, room: Room) -> torch.Tensor:
        """The budgeted top-k: [B, nb] or [B, Hkv, nb] bool, like score."""
        own = view.own if view.own is None or score.dim() == 2 else view.own[:, None]
        if room.blocks is not None:  # every block holds bs tokens: the room's best blocks, one top-k
            return top_pick(score, room.blocks, own)
        if score.dim() == 3:
            return budgeted_pick(score, view.counts[:, None], room.tokens[:, None], own)
        return budgeted_pick(score, view.counts, room.tokens, own)

    def picks_top(self) -> bool:
        """Whether `pick` is the base's budgeted top-k (then a compiled call may take it and its
        Selection at once: fused_pick.py); a policy with its own pick says False."""
        return type(self).pick is BlockSelectionPolicy.pick

    def finish(self, table: BlockTable, layer: int, sel: Selection, pick: torch.Tensor, view: StepView,
               target: float, rho: float, q: torch.Tensor) -> Selection:
        """The policy's plan for the chosen blocks (default: copy them all)."""
        return sel

    # --- the step ---
    def select(self, table: BlockTable, layer: int, q: torch.Tensor) -> Selection:
        if self.is_dense_layer(layer):
            return Selection.all(table)
        view = self.step_view(table)
        target, rho = self.keep_target(table, q)
        score = self.block_scores(table, layer, q, view)  # score: [B, (Hkv,) nb]
        room = self.room(table, view, target)
        fused = fused_selection(table, score, view, room) if self.picks_top() else None
        if fused is not None:
            pick, sel = fused
        else:
            pick = self.pick(table, score, view, room)
            sel = selection_from_pick(table, pick, view)
        return self.finish(table, layer, sel, pick, view, target, rho, q)

    def room(self, table: BlockTable, view: StepView, target: float) -> Room:
        """What the picked blocks may add at keep `target` (the budget less what the own blocks and
        the open block take); once per step and target."""
        room = view.rooms.get(target)
        if room is None:
            floor = self.budget_floor(table)
            budgets = [token_budget(target, n, floor) for n in view.n_valid]
            blocks = None if view.used_host is None else max(0, budgets[0] - view.used_host) // table.bs
            if len(view.rooms) >= _VIEWS:  # a live cost model moves the target a little every step
                view.rooms.clear()
            tokens = torch.tensor(budgets).to(view.used.device) - view.used  # tokens: [B]
            room = view.rooms[target] = Room(tokens, blocks)
        return room

    def step_view(self, table: BlockTable) -> StepView:
        """The step's StepView for this table's context and padding (shared by the layers)."""
        pads = self.host_pads(table)
        key = (table.length, table.bs, self.floor(table), tuple(pads))
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= _VIEWS:
                self._views.pop(next(iter(self._views)))
            view = self._views[key] = self._make_view(table, pads)
        return view

    def _make_view(self, table: BlockTable, pads: list[int]) -> StepView:
        bs, length, sealed = table.bs, table.length, table.length // table.bs
        valid, counts = self.block_counts(table)  # valid: [B, L]; counts: [B, nb]
        own = self.own_blocks(table, counts)
        open_tokens = valid[:, sealed * bs:].sum(dim=1)  # open_tokens: [B]
        used = open_tokens + (0 if own is None else (counts * own).sum(dim=1))  # used: [B]
        padded = any(pads)
        bias = None
        if padded:
            bias = torch.zeros(valid.shape[0], sealed * bs, device=valid.device)  # bias: [B, sealed * bs]
            bias.masked_fill_(~valid[:, :sealed * bs], -math.inf)
        used_host = None if padded else used[0].item()  # once per step: every sequence alike
        return StepView(length, sealed, valid, counts, own, used, open_tokens.sum(), [length - p for p in pads], bias,
                        counts > 0 if padded else None, used_host)
