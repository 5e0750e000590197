"""Bringing a Selection's KV blocks to the compute device: copied from their home tier, or
rebuilt from hidden-state checkpoints through the K/V projections alone (SparPR's recompute)."""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from ..kv.block_table import BlockTable
from ..kv.policy import Selection


@dataclass
class Fetched:
    """A decode step's gathered KV with one spare last slot for the step's new token."""

    kv: torch.Tensor  # [2, B, Hkv, T+1, D]
    pos: torch.Tensor  # [T+1] cache positions (last: filled in by the step)
    sel: Selection
    hidden: torch.Tensor | None = None  # [B, Tr, hidden] checkpoints of the blocks to rebuild
    slots: torch.Tensor | None = None  # [Tr] where the rebuilt tokens go in kv


def _ranges(t: BlockTable, blocks, device) -> torch.Tensor:
    if not blocks:
        return torch.empty(0, dtype=torch.long, device=device)
    return torch.cat([torch.arange(b * t.bs, b * t.bs + t.block_len(b), device=device) for b in blocks])


class GatherRing:
    """Reused buffers for the gathered KV of decode cells. A cell's buffer lives until its
    attention is done, and at most one more gather (the next cell's prefetch) runs meanwhile, so
    two buffers, taken in turn, serve every cell. Reusing them spares each cell a fresh
    multi-megabyte tensor, whose first touch costs page faults on the CPU (measured: a third of a
    SparPR decode step at 4k tokens). Buffers start as zeros and then only ever hold gathered KV
    values, so their stale rows are finite: a per-sequence gather need not zero the rows it skips
    (masked out, they get exactly zero attention weight)."""

    def __init__(self, n: int = 2):
        self._bufs: list[torch.Tensor | None] = [None] * n
        self._next = 0
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A tensor of `shape`, finite but stale, on the next buffer of the ring (grown by 1/4 when short)."""
        numel = 1
        for n in shape:
            numel *= n
        with self._lock:
            i, self._next = self._next, (self._next + 1) % len(self._bufs)
            buf = self._bufs[i]
            if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
                buf = self._bufs[i] = torch.zeros(numel + numel // 4, dtype=dtype, device=device)
        return buf[:numel].view(shape)


def gather_selection(t: BlockTable, sel: Selection, dtype: torch.dtype, device: torch.device,
                     ring: GatherRing | None = None) -> Fetched:
    """I/O half: copy the blocks to copy, and the checkpoints of the blocks to rebuild (into the
    ring's next buffer when given, else a new tensor)."""
    rebuild = sorted(set(sel.recompute) & set(sel.blocks)) if t.checkpoints is not None else []
    lens = [t.block_len(b) for b in sel.blocks]
    total = sum(lens)
    _, b, hkv, _, d = t.block_shape
    shape = (2, b, hkv, total + 1, d)
    out = ring.take(shape, dtype, device) if ring is not None else torch.empty(shape, dtype=dtype, device=device)
    pos = torch.cat([_ranges(t, sel.blocks, device), torch.zeros(1, dtype=torch.long, device=device)])
    if not rebuild:
        t.gather(sel.blocks, out, seqs=sel.seqs, zero_unread=ring is None)
        return Fetched(out, pos, sel)
    copy = [blk for blk in sel.blocks if blk not in set(rebuild)]
    seqs = None if sel.seqs is None else sel.seqs[:, [i for i, blk in enumerate(sel.blocks) if blk in copy]]
    starts = dict(zip(sel.blocks, torch.tensor([0, *lens[:-1]]).cumsum(0).tolist()))
    slot_of = lambda blks: torch.cat([torch.arange(starts[x], starts[x] + t.block_len(x), device=device)
                                      for x in blks])  # noqa: E731
    if copy:
        kv, _ = t.gather(copy, seqs=seqs)  # a fresh tensor: its unread rows are zeroed
        out[:, :, :, slot_of(copy)] = kv
    h, _ = t.checkpoints.gather(rebuild)  # h: [1, B, 1, Tr, hidden]
    return Fetched(out, pos, sel, hidden=h[0, :, 0], slots=slot_of(rebuild))


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
