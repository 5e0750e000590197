"""Bringing a Selection's KV blocks to the compute device: copied from their home tier, or
rebuilt from hidden-state checkpoints through the K/V projections alone (SparPR's recompute)."""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import torch

from ..kv.block_table import BlockTable
from ..kv.policy import Selection
from ..storage.disk import aligned_empty


@dataclass
class Fetched:
    """A decode step's gathered KV with one spare last slot for the step's new token."""

    kv: torch.Tensor | None  # [2, B, Hkv, T+1, D]
    pos: torch.Tensor | None  # [T+1] cache positions, or [B, T+1] per sequence (sel.rows); last: the step's token
    sel: Selection
    hidden: torch.Tensor | None = None  # [B, Tr, hidden] checkpoints of the blocks to rebuild
    slots: torch.Tensor | None = None  # [Tr] where the rebuilt tokens go in kv
    room: torch.Tensor | None = None  # [2, B, Hkv, T+1+R, D] kv's buffer, R tokens longer (top_up)
    # read in place (a resident cache on the CPU kernel: no copy): kv and pos are None until the new
    # token joins; rows: [1|B, T] the cache positions attended (the arena's rows), one row shared or one a sequence
    rows: torch.Tensor | None = None
    # raw disk blocks attended where they landed (engine/cell.py `resident_split`): their ids (ascending)
    # and the blocks as read, [B, n, planes, Hkv, bs, D] (TierReads.land); kv holds the rest
    landed: tuple[list[int], torch.Tensor] | None = None
    # the rest of a split read is the open block at most (KVReader._rest): read where it is filled, kv and pos None
    open_in_place: bool = False


def _offsets(t: BlockTable, blocks: list[int]) -> dict[int, int]:
    """Block -> where its tokens start in a gather of `blocks` (in that order)."""
    return dict(zip(blocks, itertools.accumulate((t.block_len(x) for x in blocks[:-1]), initial=0)))


class GatherRing:
    """Reused buffers for the gathered KV of decode cells. A cell's buffer lives until its
    attention is done, and at most one more gather (the next reading cell's prefetch, started
    while this one computes: engine/prefetch.py CacheReads) runs meanwhile, so two buffers, taken
    in turn, serve every cell. Reusing them spares each cell a fresh
    multi-megabyte tensor, whose first touch costs page faults on the CPU (measured: a third of a
    SparPR decode step at 4k tokens). Buffers start as zeros and then only ever hold gathered KV
    values, so their stale rows are finite: a per-sequence gather need not zero the rows it skips
    (masked out, they get exactly zero attention weight)."""

    def __init__(self, n: int = 2, aligned: bool = False):
        self._bufs: list[torch.Tensor | None] = [None] * n
        self._next = 0
        self._lock = threading.Lock()
        self.aligned = aligned  # buffers on huge pages (O_DIRECT reads land in them) and not zeroed

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A tensor of `shape`, finite but stale, on the next buffer of the ring (grown by 1/4 when short)."""
        numel = 1
        for n in shape:
            numel *= n
        with self._lock:
            i, self._next = self._next, (self._next + 1) % len(self._bufs)
            buf = self._bufs[i]
            if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
                n = numel + numel // 4
                buf = self._bufs[i] = (aligned_empty((n,), dtype, huge_from=0) if self.aligned else
                                       torch.zeros(n, dtype=dtype, device=device))
        return buf[:numel].view(shape)


def gather_selection(t: BlockTable, sel: Selection, dtype: torch.dtype, device: torch.device,
                     ring: GatherRing | None = None, room: int = 0) -> Fetched:
    """I/O half: copy the blocks to copy, and the checkpoints of the blocks to rebuild (into the
    ring's next buffer when given, else a new tensor; `room` more tokens of it for a top_up)."""
    _, b, hkv, _, d = t.block_shape
    if sel.rows is not None and t.store.resident and not room:  # each sequence its own tokens
        n = sel.rows.shape[1]
        shape = (2, b, hkv, n + 1, d)
        buf = ring.take(shape, dtype, device) if ring is not None else torch.empty(shape, dtype=dtype, device=device)
        pos = torch.cat([sel.rows, sel.rows.new_zeros(b, 1)], dim=1)  # pos: [B, T+1]
        return Fetched(t.gather_rows(sel.rows, buf), pos, sel)
    rebuild = sorted(set(sel.recompute) & set(sel.blocks)) if t.checkpoints is not None else []
    last = t.num_blocks - 1  # every block is whole but the open one (no Python loop per block)
    total = len(sel.blocks) * t.bs - (t.bs - t.block_len(last) if last in sel.blocks else 0)
    shape = (2, b, hkv, total + 1 + room, d)
    buf = ring.take(shape, dtype, device) if ring is not None else torch.empty(shape, dtype=dtype, device=device)
    out = buf[:, :, :, :total + 1]  # out: [2, B, Hkv, T+1, D]
    if not rebuild:
        _, pos = t.gather(sel.blocks, out, seqs=sel.seqs, zero_unread=ring is None)
        pos = torch.cat([pos, pos.new_zeros(1)])  # pos: [T+1], the last slot the step's new token's
        return Fetched(out, pos, sel, room=buf if room and ring is not None else None)
    pos = torch.cat([t.positions(sel.blocks, device), torch.zeros(1, dtype=torch.long, device=device)])
    copy = [blk for blk in sel.blocks if blk not in set(rebuild)]
    seqs = None if sel.seqs is None else sel.seqs[:, [i for i, blk in enumerate(sel.blocks) if blk in copy]]
    starts = _offsets(t, sel.blocks)
    slot_of = lambda blks: torch.cat([torch.arange(starts[x], starts[x] + t.block_len(x), device=device)
                                      for x in blks])  # noqa: E731
    if copy:
        kv, _ = t.gather(copy, seqs=seqs)  # a fresh tensor: its unread rows are zeroed
        out[:, :, :, slot_of(copy)] = kv
    h, _ = t.checkpoints.gather(rebuild)  # h: [1, B, 1, Tr, hidden]
    return Fetched(out, pos, sel, hidden=h[0, :, 0], slots=slot_of(rebuild))


def _readers(sel: Selection, b: int, device) -> torch.Tensor:
    """[B, len(blocks)] bool: which sequences read each block of sel."""
    if sel.seqs is not None:
        return sel.seqs.to(device, non_blocking=True)
    return torch.ones(b, len(sel.blocks), dtype=torch.bool, device=device)


def top_up(t: BlockTable, f: Fetched, sel: Selection, dtype: torch.dtype, device: torch.device) -> Fetched:
    """f was gathered for a guessed selection; sel is the exact one. Keeps what f read that sel
    wants and reads now only the (block, sequence) pairs the guess missed, appended after f's
    tokens (a block may then sit twice, each copy masked to its own sequences). Attention over
    the result equals attention over sel gathered afresh: the same tokens are attended, the
    others are masked out. A guess or a selection with rebuilds is gathered afresh instead."""
    if sel.recompute or f.hidden is not None:
        return gather_selection(t, sel, dtype, device)
    b, hkv = t.block_shape[1], t.block_shape[2]
    lens = [t.block_len(x) for x in sel.blocks]
    want = sel.mask if sel.mask is not None else \
        torch.ones(b, hkv, sum(lens), dtype=torch.bool, device=device)  # want: [B, Hkv, T_sel]
    start = _offsets(t, sel.blocks)
    # a sequence needs a block when its mask keeps any of its tokens, read whole or not (a DKV
    # block nobody reads whole is attended on its exact rows, held on compute: exact_rows.py)
    need = torch.stack([want[:, :, start[x]:start[x] + n].any(dim=2).any(dim=1)
                        for x, n in zip(sel.blocks, lens)], dim=1)  # need: [B, n_sel]
    reads, had = _readers(sel, b, device), _readers(f.sel, b, device)  # [B, n_sel], [B, n_guess] read whole
    col, sel_col = {x: i for i, x in enumerate(f.sel.blocks)}, {x: j for j, x in enumerate(sel.blocks)}
    tf = f.kv.shape[3] - 1
    keep = torch.zeros(b, hkv, tf, dtype=torch.bool, device=device)  # keep: [B, Hkv, T_guess]
    missing, miss_seqs, at = [], [], 0
    for x in f.sel.blocks:  # what the guess read and sel wants
        n = t.block_len(x)
        if x in sel_col:
            j = sel_col[x]
            keep[:, :, at:at + n] = want[:, :, start[x]:start[x] + n] & (had[:, col[x]] & need[:, j])[:, None, None]
        at += n
    for j, x in enumerate(sel.blocks):  # what it did not
        m = need[:, j] & ~had[:, col[x]] if x in col else need[:, j]
        if bool(m.any()):
            missing.append(x)
            miss_seqs.append(m)
    if not missing:
        return Fetched(f.kv, f.pos, Selection(f.sel.blocks, keep, seqs=f.sel.seqs))
    miss = torch.stack(miss_seqs, dim=1)  # miss: [B, n_missing]
    seqs = miss & reads[:, [sel_col[x] for x in missing]]  # seqs: [B, n_missing] the whole-row reads
    tm = sum(t.block_len(x) for x in missing)
    add = torch.cat([want[:, :, start[x]:start[x] + t.block_len(x)] & miss[:, i, None, None]
                     for i, x in enumerate(missing)], dim=2)  # add: [B, Hkv, T_m]
    pos = torch.cat([f.pos[:tf], t.positions(missing, f.pos.device), f.pos[tf:]])
    if f.room is not None and f.room.shape[3] >= tf + tm + 1:  # in place after the guessed tokens
        kv = f.room[:, :, :, :tf + tm + 1]  # kv: [2, B, Hkv, T+1, D]
        t.gather(missing, kv[:, :, :, tf:], seqs=seqs, zero_unread=False)  # stale rows are masked out
    else:
        kv_m, _ = t.gather(missing, seqs=seqs)  # kv_m: [2, B, Hkv, T_m, D] (unread rows zeroed)
        kv = torch.cat([f.kv[:, :, :, :tf], kv_m.to(dtype), f.kv[:, :, :, tf:]], dim=3)  # [2, B, Hkv, T+1, D]
    return Fetched(kv, pos, Selection(f.sel.blocks + missing, torch.cat([keep, add], dim=2)))


def rebuild_kv(f: Fetched, arch, w, pads: torch.Tensor | None) -> None:
    """Compute half: K, V of the checkpointed tokens through the K/V projections only (RoPE at
    each token's own position for Llama), written into their slots."""
    if f.hidden is None:
        return
    tok = f.pos[f.slots]  # tok: [Tr] cache positions
    b = f.hidden.shape[0]
    p = tok[None, :].expand(b, -1) if pads is None else (tok[None, :] - pads[:, None]).clamp(min=0)
    k, v = arch.kv(w, f.hidden, p)  # k, v: [B, Hkv, Tr, D]
    f.kv[0][:, :, f.slots] = k.to(f.kv.dtype)
    f.kv[1][:, :, f.slots] = v.to(f.kv.dtype)
