"""Shared by the DKV tests: a small block shape and an encode that also gives the pure low-rank
reconstruction."""
from __future__ import annotations

import torch

from flexgen_sparpr.kv.dkv.codec import DKVCodec

SHAPE = (2, 2, 3, 16, 8)  # [planes, B, Hkv, bs, D]


def lowrank_kv(c: DKVCodec, kv: torch.Tensor):
    """Encode and give (row, the pure low-rank reconstruction without residual rows)."""
    row = c.encode(kv)
    p = c.parts(row)
    x = p.anchor[:, None] + p.coeffs @ p.basis.mT  # x: [B, bs, F]
    return row, c.from_rows(x)
