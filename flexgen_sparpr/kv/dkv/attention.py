"""DKV decode attention over encoded blocks: scores and values in low-rank space, never
decompressing K; partial attentions carry their log-sum-exp so they merge exactly.

For KV head g with key columns Kg and value columns Vg of the joint basis W (docs/dkv.md):
    q . k_t = q . a[Kg] + C_t . (W[Kg]^T q)          (project q once: r numbers per head)
    sum_t p_t v_t = (sum_t p_t) a[Vg] + (sum_t p_t C_t) @ W[Vg]^T
"""
from __future__ import annotations

import math

import torch

from .codec import DKVParts


def pick(parts: DKVParts, idx: torch.Tensor) -> DKVParts:
    """Per-sequence blocks: parts with leading [n] (block) over B -> leading [K, B] for
    idx: [B, K] block numbers (sequence b takes block idx[b, j] of its own row). Block-major, as
    the rows are: the attention below runs batched matmuls over (block, sequence)."""
    ar = torch.arange(idx.shape[0], device=idx.device)[None, :]  # ar: [1, B]
    return DKVParts(*(getattr(parts, f)[idx.T, ar] for f in DKVParts.__dataclass_fields__))


def _kv_split(x: torch.Tensor, hkv: int, d: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a joint F axis (K heads, then V heads) at `dim` into K and V, each [..., Hkv, D, ...]."""
    shp = x.shape
    x = x.reshape(*shp[:dim], 2, hkv, d, *shp[dim + 1:])
    return x.select(dim, 0), x.select(dim, 1)


def lowrank_scores(q: torch.Tensor, p: DKVParts, usable: torch.Tensor) -> torch.Tensor:
    """Scaled scores q.k / sqrt(D) of K blocks per sequence, in low-rank form.

    q: [B, H, 1, D]; p: parts with leading [K, B] (every sequence its own K blocks); usable:
    [K, B, bs] bool (False: -inf). Returns [K, B, H, bs] float32."""
    b, h, _, d = q.shape
    hkv = p.anchor.shape[-1] // (2 * d)
    qg = q.float().view(1, b, hkv, h // hkv, d)  # qg: [1, B, Hkv, G, D]
    a_k, _ = _kv_split(p.anchor.float(), hkv, d, dim=2)  # a_k: [K, B, Hkv, D]
    w_k, _ = _kv_split(p.basis.float(), hkv, d, dim=2)  # w_k: [K, B, Hkv, D, r]
    proj = torch.matmul(qg, w_k)  # proj: [K, B, Hkv, G, r] (q projected once per block: r numbers a head)
    base = torch.matmul(qg, a_k[..., None])  # base: [K, B, Hkv, G, 1]
    k_, b_ = proj.shape[:2]
    scores = torch.matmul(proj.reshape(k_, b_, h, -1), p.coeffs.float().mT)  # scores: [K, B, H, bs]
    scores = (scores + base.reshape(k_, b_, h, 1)) / math.sqrt(d)
    return scores.masked_fill_(~usable[:, :, None], float("-inf"))


def lowrank_attention(q: torch.Tensor, p: DKVParts, usable: torch.Tensor, scores: torch.Tensor | None = None):
    """Attention over K blocks per sequence in low-rank form.

    q: [B, H, 1, D]; p: parts with leading [K, B]; usable: [K, B, bs] bool (valid tokens that are
    not residual rows); scores: lowrank_scores(q, p, usable) when already computed.
    Returns out: [B, H, 1, D] float32 and lse: [B, H, 1] (-inf if empty)."""
    b, h, _, d = q.shape
    hkv = p.anchor.shape[-1] // (2 * d)
    _, a_v = _kv_split(p.anchor.float(), hkv, d, dim=2)  # a_v: [K, B, Hkv, D]
    _, w_v = _kv_split(p.basis.float(), hkv, d, dim=2)  # w_v: [K, B, Hkv, D, r]
    if scores is None:
        scores = lowrank_scores(q, p, usable)  # scores: [K, B, H, bs]
    lse = torch.logsumexp(scores, dim=(0, 3))  # lse: [B, H] over every block's tokens
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w = torch.exp(scores - safe[None, :, :, None])  # w: [K, B, H, bs]
    k_ = w.shape[0]
    wc = torch.matmul(w, p.coeffs.float())  # wc: [K, B, H, r] the weighted sum, in r dimensions
    out = torch.matmul(wc.view(k_, b, hkv, h // hkv, -1), w_v.mT)  # out: [K, B, Hkv, G, D] mapped back
    out = out.sum(0).reshape(b, h, d) + (w.sum(-1).view(k_, b, hkv, h // hkv, 1) * a_v[:, :, :, None]).sum(0).reshape(b, h, d)
    return out.reshape(b, h, 1, d), lse.reshape(b, h, 1)


def residual_kv(p: DKVParts, blocks: torch.Tensor, bs: int, d: int):
    """Exact residual tokens of n blocks. p: parts with leading [n]; blocks: [n] block ids.
    Returns k, v: [B, Hkv, n*m, D] and pos: [B, n*m] cache positions."""
    n, b, m, f = p.res_rows.shape
    hkv = f // (2 * d)
    rows = p.res_rows.permute(1, 0, 2, 3).reshape(b, n * m, 2, hkv, d)  # rows: [B, n*m, 2, Hkv, D]
    pos = (blocks[:, None, None] * bs + p.res_idx.long()).permute(1, 0, 2).reshape(b, n * m)
    k, v = rows.permute(2, 0, 3, 1, 4)  # k, v: [B, Hkv, n*m, D]
    return k, v, pos

