"""SparPR's low-rank codes scored by torch's 4-bit weight kernel on the CPU.

A low-rank summary stores each key as r 4-bit codes c in 1..15 meaning c - 8 steps along its KV
head's directions (sparpr_lowrank.py). That is exactly a weight of the CPU int4 kernel
(`_weight_int4pack_mm_for_cpu`: code c means (c - 8) x scale + zero, here scale 1 and zero 0, one
group of r inputs), so q . k~ over a head's T tokens is one product of its [G, r] scaled queries by
a [T, r] int4 weight, read from the packed bytes: 2-4x faster than widening the codes to float32
and multiplying (a bfloat16 query and bfloat16 logits, ~3 significant digits: a block's score
moves by under 1 %, so only near-ties can swap). One kernel call per (sequence, KV head), each its
own weight.

The kernel packs rows a tile at a time (64 on AVX-512; models/packed.py `int4_tile` finds it), so the codes are
kept packed per table as [B * Hkv, capacity, r / 2] and repacked a tile at a time as blocks seal.
The path is taken on the CPU when the kernel is there and packs this way, r is a multiple of 32,
and the compute dtype is float32 or bfloat16; elsewhere (CUDA among them) the codes are scored in
float (lowrank_block_scores).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...models.packed import GROUP, int4_tile as kernel_tile  # r must be a whole group; the tile rows pack in

_BF16 = torch.bfloat16


def applies(device: torch.device, rank: int, dtype: torch.dtype) -> bool:
    """Whether a table's codes are scored by the int4 kernel (see the module docstring)."""
    return device.type == "cpu" and rank % GROUP == 0 and dtype in (torch.float32, _BF16) and \
        kernel_tile() is not None


@dataclass(eq=False)
class PackedCodes:
    """A table's low-rank codes in the kernel's layout, kept up to date with the sealed tokens."""

    packed: torch.Tensor  # [B * Hkv, capacity (whole tiles), r / 2] uint8, the kernel's layout
    scale_zero: torch.Tensor  # [1, capacity, 2] bfloat16: scale 1, zero 0 (codes mean c - 8)
    tile: int
    done: int = 0  # tokens packed (whole sealed tiles and the sealed part of the last)
    rewinds: int = 0  # the table's rewinds when last synced: a rewound table packs again

    @classmethod
    def empty(cls, bh: int, capacity: int, rank: int, device: torch.device) -> "PackedCodes":
        tile = kernel_tile()
        cap = -(-capacity // tile) * tile
        sz = torch.stack([torch.ones(1, cap), torch.zeros(1, cap)], dim=-1).to(device=device, dtype=_BF16)
        return cls(torch.zeros(bh, cap, rank // 2, dtype=torch.uint8, device=device), sz, tile)

    def sync(self, codes: torch.Tensor, tokens: int, rewinds: int) -> None:
        """codes: [B, Hkv, r / 2, L] uint8 (even directions low, odd high; tokens innermost), of
        which the first `tokens` are sealed: pack the tiles that changed since the last sync."""
        if rewinds != self.rewinds:
            self.done, self.rewinds = 0, rewinds
        if tokens <= self.done:
            return
        tile = self.tile
        start, end = self.done // tile * tile, min(-(-tokens // tile) * tile, codes.shape[-1])
        c = codes[..., start:end]  # c: [B, Hkv, r / 2, n]
        dirs = torch.stack([c & 15, c >> 4], dim=3).flatten(2, 3)  # dirs: [B, Hkv, r, n], direction order
        n = end - start
        rows = dirs.flatten(0, 1).transpose(1, 2)  # rows: [B * Hkv, n, r]
        if n % tile:  # the capacity ends inside a tile: pad it (never scored)
            rows = torch.cat([rows, rows.new_full((rows.shape[0], tile - n % tile, rows.shape[2]), 8)], dim=1)
        conv = torch._convert_weight_to_int4pack_for_cpu(rows.reshape(-1, rows.shape[2]).to(torch.int32), 1)
        self.packed[:, start:start + rows.shape[1]] = conv.view(rows.shape[0], rows.shape[1], -1)
        self.done = tokens

    def logits(self, qs: torch.Tensor, tokens: int) -> torch.Tensor:
        """qs: [B, Hkv, G, r] float32 (each query head's r coordinates, scaled by the steps) ->
        [B, Hkv, G, tokens] bfloat16 (the kernel's own output, not widened: the caller's reduction
        widens it as it reads): q . k~ of every sealed token, per query head."""
        b, hkv, g, r = qs.shape
        n = -(-tokens // self.tile) * self.tile
        xb = qs.to(_BF16).view(b * hkv, g, r)  # xb: [B * Hkv, G, r]
        sz, mm = self.scale_zero[:, :n], torch._weight_int4pack_mm_for_cpu
        out = torch.stack([mm(xb[i], self.packed[i, :n], r, sz) for i in range(b * hkv)])  # out: [B * Hkv, G, n]
        return out.view(b, hkv, g, n)[..., :tokens]


def packed_nbytes(packed: PackedCodes | None) -> int:
    """Bytes a table's packed codes take (0: none)."""
    if packed is None:
        return 0
    return sum(t.numel() * t.element_size() for t in (packed.packed, packed.scale_zero))



def synced_codes(cache, table, codes: torch.Tensor) -> PackedCodes | None:
    """The table's codes [B, Hkv, r / 2, T] in this kernel's layout, kept in `cache` (a mapping
    table -> PackedCodes) and synced with its sealed tokens, where the kernel scores them
    (`applies`); None elsewhere."""
    b, hkv, half, t = codes.shape
    if not applies(codes.device, 2 * half, table.dtype):
        return None
    packed = cache.get(table)
    if packed is None:
        packed = cache[table] = PackedCodes.empty(b * hkv, table.capacity, 2 * half, codes.device)
    packed.sync(codes, t, table.rewinds)
    return packed
