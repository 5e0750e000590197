"""FlexGen's --attn-sparsity: each head attends only its top share of the keys by score."""
from __future__ import annotations

import math

import torch


def topk_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          valid: torch.Tensor | None, keep: float) -> torch.Tensor:
    """FlexGen's --attn-sparsity: full scores, keep the top ceil(keep*T) keys per head,
    softmax renormalised over the kept keys only. q: [B, H, 1, D]; k, v: [B, Hkv, T, D];
    valid: [B, T] or [B, Hkv, T]."""
    b, h, sq, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    qg = q.float().view(b, hkv, h // hkv, sq, d)
    scores = torch.einsum("bkgqd,bktd->bkgqt", qg, k.float()) / math.sqrt(d)
    if valid is not None:
        m = valid[:, None, None, None, :] if valid.dim() == 2 else valid[:, :, None, None, :]
        scores = scores.masked_fill(~m, float("-inf"))
    n = max(1, min(t, math.ceil(keep * t - 1e-9)))  # 0.07 * 100 is 7.000000000000001
    top, idx = scores.topk(n, dim=-1)  # top: [B, Hkv, G, Sq, n]
    p = torch.softmax(top, dim=-1)
    vg = v.float()[:, :, None, None].expand(b, hkv, h // hkv, sq, t, d)
    picked = torch.gather(vg, 4, idx[..., None].expand(*idx.shape, d))  # [B, Hkv, G, Sq, n, D]
    out = (p[..., None] * picked).sum(-2)
    return out.reshape(b, h, sq, d).to(q.dtype)
