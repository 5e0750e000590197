"""How a tensor of fixed shape is laid out on a tier: raw, or packed 4- or 8-bit group-wise (FlexGen)."""
from __future__ import annotations

import torch

from .compress import CompressedTensor, CompressionConfig, compress, compressed_nbytes, decompress


class Codec:
    """How a block of fixed shape is laid out on a tier: as is, or (`compressed`) one flat uint8
    row of `nbytes` bytes. The block table's store uses every codec through these alone."""

    compressed = False
    exact_recent = 0  # newest sealed blocks also kept exact on compute (a lossy codec's recency window)
    exact_first = 0  # first sealed blocks also kept exact on compute (the attention sinks every query reads)
    takes_hints = False  # encode uses a per-block hint (DKV: its tokens' importance [B, bs])
    nbytes: int

    def encode(self, block: torch.Tensor, hint: torch.Tensor | None = None) -> torch.Tensor:
        """block: `shape` -> [nbytes] uint8 (same device)."""
        raise NotImplementedError

    def decode(self, row: torch.Tensor) -> torch.Tensor:
        """row: [nbytes] uint8 on the compute device -> block of `shape`."""
        raise NotImplementedError

    def decode_many(self, rows: torch.Tensor) -> torch.Tensor:
        """rows: [k, nbytes] uint8, k blocks' rows one after the other -> [k, *shape] (one decode
        each; a codec that can decode them at once says so)."""
        return torch.stack([self.decode(r) for r in rows])

    def exact_rows(self, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The token rows the encoded form keeps exact, (idx: [B, m], kv: [planes, B, Hkv, m, D]) on
        row's device, or None (no row is exact, or every one is)."""
        return None


class RawCodec(Codec):
    """A tensor as is, in its dtype."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype):
        self.shape, self.dtype = shape, dtype
        self.nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


class GroupCodec(Codec):
    """A tensor packed into one flat uint8 row: 4-bit (FlexGen's --compress-cache, --kv-dtype q4)
    or 8-bit (--kv-dtype q8) codes, then group minima, then scales. KV blocks group along head_dim
    (FlexGen's cache config); weights along dim 0."""

    compressed = True

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype,
                 cfg: CompressionConfig = CompressionConfig(num_bits=4, group_size=64, group_dim=-1)):
        self.shape, self.dtype, self.cfg = tuple(shape), dtype, cfg
        self.nbytes = compressed_nbytes(self.shape, dtype, cfg)
        self._parts = None

    def _set_parts(self, c: CompressedTensor) -> None:
        self._parts = [(p.dtype, p.shape, p.numel() * p.element_size()) for p in (c.data, c.mn, c.scale)]
        assert sum(n for _, _, n in self._parts) == self.nbytes

    def encode(self, block: torch.Tensor, hint: torch.Tensor | None = None) -> torch.Tensor:
        """block: `shape` -> bytes: [nbytes] uint8 (same device)."""
        c = compress(block, self.cfg)
        if self._parts is None:
            self._set_parts(c)
        return torch.cat([p.contiguous().view(torch.uint8).flatten() for p in (c.data, c.mn, c.scale)])

    def decode(self, row: torch.Tensor) -> torch.Tensor:
        """row: [nbytes] uint8 on the compute device -> tensor of `shape`."""
        return self.decode_many(row[None])[0]

    def decode_many(self, rows: torch.Tensor) -> torch.Tensor:
        """rows: [k, nbytes] uint8 -> [k, *shape], every block in one pass of tensor ops (a span
        of blocks read from disk in one request: one decode per block cost ~10 small ops each).
        With the groups along a dim counted from the end, k rows are one compressed [k, *shape]."""
        k = rows.shape[0]
        if self.cfg.group_dim >= 0 and k > 1:  # a leading k would move the group dim: one at a time
            return super().decode_many(rows)
        if self._parts is None:
            self._set_parts(compress(torch.zeros(self.shape, dtype=self.dtype), self.cfg))
        parts, off = [], 0
        for dt, shape, n in self._parts:  # data [k, pre, groups, size*bits/8, post]; mn, scale [k, pre, groups, 1, post]
            parts.append(rows[:, off:off + n].contiguous().view(dt).view(k * shape[0], *shape[1:]))
            off += n
        shape = (k, *self.shape) if self.cfg.group_dim < 0 else self.shape  # (k is 1 in the second case)
        c = CompressedTensor(data=parts[0], mn=parts[1], scale=parts[2], shape=torch.Size(shape),
                             dtype=self.dtype, config=self.cfg)
        return decompress(c, rows.device).view(k, *self.shape)


def kv_group_codec(shape: tuple[int, ...], dtype: torch.dtype, bits: int = 4) -> GroupCodec:
    """A KV block's group codec: groups of 64 along head_dim (all of a smaller head), a min and a
    scale in the block's dtype per group."""
    return GroupCodec(shape, dtype, CompressionConfig(num_bits=bits, group_size=min(64, shape[-1]), group_dim=-1))

