"""The block-granular KV cache of one layer for one GPU batch: which block is where, how many
tokens it holds, sealing. The bytes live in its TierStore (kv/tier_store.py), which alone moves them.

Block b holds token positions [b*bs, (b+1)*bs) of every sequence in the batch as one tensor
kv: [2, B, Hkv, bs, D] (K then V). With planes=1 the same table keeps other per-token state
(SparPR's hidden-state checkpoints: [1, B, 1, bs, hidden]). Each block has a home tier fixed at
creation; the block being filled lives on the compute device until it is full ("sealed"), then
moves home. A codec (4-bit groups, or DKV's anchor + low-rank form) may encode the sealed blocks
of some tiers: those are kept as rows of codec.nbytes bytes, the other tiers' blocks raw.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..models.cpu_kernel import kernel as compiled_kernel
from ..storage.codec import GroupCodec, RawCodec
from ..storage.tiers import Devices, Tier
from .tier_store import TierStore


class BlockTable:
    def __init__(self, *, name: str, batch: int, num_kv_heads: int, head_dim: int, block_size: int,
                 max_len: int, dtype: torch.dtype, homes: list[Tier], devices: Devices,
                 disk=None, compress: bool = False, planes: int = 2, codec=None,
                 coded_tiers: tuple[Tier, ...] | None = None, store_dtype: torch.dtype | None = None,
                 resident_dtype: torch.dtype | None = None):
        self.bs, self.devices, self.dtype = block_size, devices, dtype
        self.block_shape = (planes, batch, num_kv_heads, block_size, head_dim)
        self.checkpoints: "BlockTable | None" = None  # hidden-state checkpoints, when kept
        # a raw copy of every block on a tier of its own, when the policy reads some blocks both
        # encoded and exact (DKV's exact routed blocks: kv_tables.build_tables); appended with this one
        self.raw_copies: "BlockTable | None" = None
        self.capacity = -(-max_len // block_size) * block_size
        self.homes = [devices.effective(t) for t in homes]
        if len(self.homes) * block_size < max_len:
            raise ValueError("fewer block homes than blocks")
        self.slot = [self.homes[:b].count(h) for b, h in enumerate(self.homes)]
        self.length = 0
        self.rewinds = 0  # times rewound: what a policy's per-table copies of the cache key on
        self.on_seal: list[Callable[[int, torch.Tensor], None]] = []  # policy hooks: (block, kv)
        self._on_cpu = devices.compute.type == "cpu"  # blocks are filled on the CPU: append's compiled path
        self._arange: torch.Tensor | None = None  # [capacity] 0, 1, ...: token_positions' (made once)
        if codec is None:
            codec = GroupCodec(self.block_shape, dtype) if compress else RawCodec(self.block_shape, dtype)
        self.store = TierStore(name=name, block_shape=self.block_shape, dtype=dtype, homes=self.homes,
                               slots=self.slot, devices=devices, disk=disk, codec=codec, coded_tiers=coded_tiers,
                               store_dtype=store_dtype, resident_dtype=resident_dtype)

    # --- bookkeeping ---
    @property
    def num_blocks(self) -> int:
        return -(-self.length // self.bs)

    @property
    def sealed(self) -> int:
        """Blocks that are full (and gone home)."""
        return self.length // self.bs

    def block_len(self, b: int) -> int:
        return min(self.bs, self.length - b * self.bs)

    def token_positions(self) -> torch.Tensor:
        """[length] every cached token's position, 0 to length - 1, on compute: a view of one range
        made once per table (a decode step reads it every layer; never written)."""
        if self._arange is None:
            self._arange = torch.arange(self.capacity, device=self.devices.compute)
        return self._arange[:self.length]

    def positions(self, blocks: list[int], device: torch.device | None = None) -> torch.Tensor:
        """[T] cache positions of the blocks' tokens, in the order given (gather's order)."""
        dev = self.devices.compute if device is None else device
        if not blocks:
            return torch.empty(0, dtype=torch.long, device=dev)
        if blocks[-1] - blocks[0] == len(blocks) - 1 and blocks == list(range(blocks[0], blocks[-1] + 1)):
            return torch.arange(blocks[0] * self.bs, min((blocks[-1] + 1) * self.bs, self.length), device=dev)
        ids = torch.tensor(blocks).to(dev, non_blocking=True)  # no sync: the host copy is staged at once
        pos = (ids[:, None] * self.bs + torch.arange(self.bs, device=dev)).flatten()  # pos: [n * bs]
        last = self.num_blocks - 1
        if self.length % self.bs and last in blocks:  # only the open block is short: drop its tail (no mask,
            i = blocks.index(last)  # which would sync)
            pos = torch.cat([pos[:i * self.bs + self.block_len(last)], pos[(i + 1) * self.bs:]])
        return pos

    # --- writing ---
    def append(self, *planes: torch.Tensor) -> list[Callable[[], None]]:
        """k, v (one tensor per plane): [B, Hkv, S, D] on compute. Returns store jobs for blocks
        sealed by this append (run them on the I/O pool; wait for them before the next read)."""
        jobs, s, off = [], planes[0].shape[2], 0
        if self.length + s > self.capacity:
            raise ValueError(f"KV cache full: {self.length}+{s} > {self.capacity} tokens")
        while off < s:
            b, pos = divmod(self.length, self.bs)
            n = min(self.bs - pos, s - off)
            kernel = compiled_kernel() if n == s and self._on_cpu else None
            buf, row = self.store.write_at(b) if kernel is not None else (None, 0)
            # a decode step's token: one compiled call for the planes, no view made (False: not its dtypes)
            if kernel is None or not kernel.put_rows(buf, row + pos, list(planes)):
                dst = self.store.writable(b)
                for i, x in enumerate(planes):
                    dst[i, :, :, pos:pos + n].copy_(x[:, :, off:off + n])
            self.length += n
            off += n
            if pos + n == self.bs:
                dst = self.store.writable(b)
                if self.on_seal:
                    full = dst.to(self.dtype)  # the policies see the compute dtype (a copy where it is stored otherwise)
                    for hook in self.on_seal:
                        hook(b, full)
                jobs.append(self.store.seal(b, dst))
        jobs = [j for j in jobs if j is not None]
        if self.raw_copies is not None:
            jobs += self.raw_copies.append(*planes)
        return jobs

    # --- reading (the store moves the bytes) ---
    def gather(self, blocks: list[int] | None = None, out: torch.Tensor | None = None,
               seqs: torch.Tensor | None = None, zero_unread: bool = True, starts: list[int] | None = None):
        """KV of the given blocks (ascending; default all) on compute.

        Returns kv: [planes, B, Hkv, T, D] and pos: [T] (absolute token positions). A fully resident
        cache read in full with no `out` buffer is returned as a view, with no copy. seqs: [B, n]
        bool, the sequences that need each block (None: all); rows of a sealed offloaded block no
        sequence needs are not read, where the block's home allows it (`store.reads_rows`), and are
        set to zeros unless zero_unread is False (an `out` known to hold finite values: masked-out
        rows need only be finite, so attention gives them exactly zero weight). starts: each
        block's token offset in a given `out` of an offloaded cache (None: one after the other).
        """
        nb = self.num_blocks
        blocks = list(range(nb)) if blocks is None else blocks
        dev = self.devices.compute
        if out is None and self.store.resident and blocks == list(range(nb)):  # a copy where resident_dtype differs
            return self.store.resident_view(self.length).to(self.dtype), torch.arange(self.length, device=dev)
        if self.store.resident:  # every token in one compute arena: indexed copies, whatever the blocks
            return self._resident_gather(blocks, out, dev)
        need = seqs.T.tolist() if seqs is not None else None  # need: [n][B] (no sync: seqs is a host tensor)
        lens = [self.bs] * len(blocks)  # every block is whole but the open one
        if blocks and blocks[-1] >= self.sealed:
            lens[-1] = self.block_len(blocks[-1])
        kv = self.store.gather(blocks, lens, self.sealed, out, need, zero_unread, starts)
        return kv, self.positions(blocks, dev)

    def _resident_gather(self, blocks: list[int], out: torch.Tensor | None, dev: torch.device):
        """gather for a wholly resident cache (blocks ascending): the whole blocks in one indexed copy
        of bs-token rows (a block's tokens copy as one run, not token by token), then the open
        block's tokens when it is asked for."""
        planes, b, hkv, bs, d = self.block_shape
        sealed = self.sealed
        whole = blocks[:-1] if blocks and blocks[-1] >= sealed else blocks
        n, open_len = len(whole), (self.length - sealed * bs if len(whole) < len(blocks) else 0)
        if out is None or out.shape[3] < n * bs + open_len:
            out = torch.empty(planes, b, hkv, n * bs + open_len, d, dtype=self.dtype, device=dev)
        kv = out[:, :, :, :n * bs + open_len]  # kv: [planes, B, Hkv, T, D]
        arena = self.store.resident_arena()  # arena: [planes, B, Hkv, cap, D]
        pos = self.positions(blocks, dev)  # pos: [T], the whole blocks' tokens first
        if n:
            ids = pos[:n * bs:bs] // bs  # ids: [n] the whole blocks (each block's first position)
            # every (plane, sequence, head) row as whole blocks of bs * D values: one 3-D indexed copy
            # (1.2-1.5x the 6-D one's speed on a CPU). The arena holds whole blocks, and kv is a token
            # slice of a contiguous [planes, B, Hkv, T, D] buffer, so both views exist
            rows = planes * b * hkv
            src = arena.view(rows, -1, bs * d)  # src: [rows, capacity / bs, bs * D]
            _select_into(src, ids, kv[:, :, :, :n * bs].view(rows, n, bs * d))  # [rows, n, bs * D]
        if open_len:
            kv[:, :, :, n * bs:].copy_(arena[:, :, :, sealed * bs:self.length])
        return kv, pos

    def gather_rows(self, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """A resident cache's tokens per sequence: rows: [B, T] cache positions of each sequence ->
        out: [planes, B, Hkv, T + 1, D] (given, contiguous) with each sequence's tokens in its own row
        and one spare last slot (filled with a copy of position 0: the step's new token goes there).
        One indexed copy over the arena seen as rows of D values."""
        planes, b, hkv, _, d = self.block_shape
        arena = self.store.resident_arena()  # arena: [planes, B, Hkv, cap, D]
        cap = arena.shape[3]
        base = torch.arange(b * hkv, device=rows.device).view(b, hkv, 1) * cap  # base: [B, Hkv, 1]
        spare = rows.new_zeros(b, 1)
        idx = base + torch.cat([rows, spare], dim=1)[:, None, :]  # idx: [B, Hkv, T + 1]
        _select_into(arena.view(planes, -1, d), idx.flatten(), out.view(planes, -1, d))
        return out

    def views(self, blocks: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The blocks' KV on compute, one (kv: [planes, B, Hkv, T, D], pos: [T]) per run of blocks:
        a block that lives on compute exact (raw, the open block, or an encoded block's exact copy)
        comes as a view with no copy, the others gathered (one gather per run of them). For
        attention that merges partial results (log-sum-exp) instead of reading one tensor."""
        out, pending = [], []
        for b in blocks:
            v = self.store.view(b, self.block_len(b), self.sealed)
            if v is None:
                pending.append(b)
                continue
            if pending:
                out.append(self.gather(pending))
                pending = []
            out.append((v, self.positions([b])))
        if pending:
            out.append(self.gather(pending))
        return out

    def rows(self, blocks: list[int]) -> torch.Tensor:
        """Encoded rows of sealed blocks on coded tiers, not decoded: [n, codec.nbytes] uint8 on
        compute (for policies that attend the encoded form, e.g. DKV)."""
        for b in blocks:
            if b >= self.sealed:
                raise ValueError(f"block {b} is not a sealed encoded block")
        return self.store.rows(blocks)

    def exact_rows(self, b: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Sealed encoded block b's exact rows held on compute (`store.hold_exact_rows`): (idx:
        [B, m] token index within the block, kv: [2, B, Hkv, m, D]), or None."""
        return self.store.exact_rows(b) if b < self.sealed else None

    # --- rewinding (one prefill, several decodes) ---
    def mark(self):
        """Remember the current length; the open block's buffer is copied since later appends
        reuse it."""
        ck = self.checkpoints.mark() if self.checkpoints is not None else None
        raw = self.raw_copies.mark() if self.raw_copies is not None else None
        return self.length, self.store.mark(), ck, raw

    def rewind(self, mark) -> None:
        """Go back to a mark. Blocks sealed after it are overwritten when refilled."""
        self.length, tail, ck, raw = mark
        self.rewinds += 1
        self.store.rewind(tail)
        if ck is not None:
            self.checkpoints.rewind(ck)
        if raw is not None:
            self.raw_copies.rewind(raw)

    def exact_cut(self, length: int) -> int:
        """The most tokens, at most `length`, that truncate keeps exactly: a cut inside a sealed
        block opens it again, which a block stored encoded cannot be (the cut then goes back to its
        start)."""
        b = length // self.bs
        if length % self.bs and b < self.sealed and self.homes[b] in self.store.coded:
            length = b * self.bs
        return min([length] + [t.exact_cut(length) for t in (self.checkpoints, self.raw_copies) if t is not None])

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens (a reused prefix): later appends overwrite the rest, and
        re-seal its blocks (their hooks, e.g. summaries, see them again). A cut inside a sealed block
        reads it back into the open buffer (an offloaded one from its tier)."""
        if not 0 <= length <= self.length or length != self.exact_cut(length):
            raise ValueError(f"cannot truncate {self.length} tokens to {length}")
        b = length // self.bs
        if length % self.bs and b < self.sealed and not self.store.is_raw_on_compute(b):
            kv, _ = self.gather([b])  # kv: [planes, B, Hkv, bs, D]
            self.store.writable(b).copy_(kv)
        self.length = length
        self.rewinds += 1
        for side in (self.checkpoints, self.raw_copies):
            if side is not None:
                side.truncate(length)

    def nbytes_on(self, tier: Tier) -> int:
        """Bytes of the sealed blocks homed on a tier (for reports)."""
        return self.store.nbytes_on(tier, self.sealed)

    def held_on(self, tier: Tier) -> int:
        """Bytes the table holds on a tier whatever its length (every block's room, its side tables'
        too): what keeping it costs."""
        own = self.store.nbytes_on(tier, len(self.homes))
        return own + sum(t.held_on(tier) for t in (self.checkpoints, self.raw_copies) if t is not None)

    def close(self) -> None:
        for side in (self.checkpoints, self.raw_copies):
            if side is not None:
                side.close()
        self.store.close()


def _select_into(src: torch.Tensor, idx: torch.Tensor, dst: torch.Tensor) -> None:
    """dst = src.index_select(1, idx), in dst's dtype: an arena stored in resident_dtype is widened as
    it lands (one indexed copy either way, then a cast where the dtypes differ)."""
    if src.dtype == dst.dtype:
        torch.index_select(src, 1, idx, out=dst)
    else:
        dst.copy_(torch.index_select(src, 1, idx))
