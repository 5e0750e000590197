"""DKV decode attention over encoded blocks: scores and values in low-rank space, never
decompressing K; partial attentions carry their log-sum-exp so they merge exactly.

For KV head g with key columns Kg and value columns Vg of the joint basis W (docs/dkv.md):
    q . k_t = q . a[Kg] + C_t . (W[Kg]^T q)          (project q once: r numbers per head)
    sum_t p_t v_t = (sum_t p_t) a[Vg] + (sum_t p_t C_t) @ W[Vg]^T

The parts are views into the encoded rows ([n, nbytes] uint8, one row per block holding every
sequence): for one sequence b, a part over the n blocks is a 3-D view whose matrices are
contiguous and whose block stride is the row size, which batched matmuls read in place. So the
scores run one sequence at a time over all its blocks at once with no part copied (a matmul over
both the block and the sequence axes would copy every part first: the two strides do not merge),
and the value side, also one sequence at a time, copies only its K routed blocks' parts. A query is
laid out as [H, Hkv*D] with zeros off its own KV head's columns, so one matmul serves every head
of a group-query model."""
from __future__ import annotations

import math

import torch

from .codec import DKVParts


def _own_kv_head(h: int, hkv: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(query heads 0..H-1, the KV head each reads): index pairs into an [..., H, Hkv, ...] axis pair."""
    heads = torch.arange(h, device=device)
    return heads, heads // (h // hkv)


def head_rows(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """q: [B, H, 1, D] -> [B, H, Hkv*D] float32: query head h's vector in its KV head's D columns,
    zeros elsewhere."""
    b, h, _, d = q.shape
    out = torch.zeros(b, h, hkv, d, dtype=torch.float32, device=q.device)  # out: [B, H, Hkv, D]
    out[(slice(None), *_own_kv_head(h, hkv, q.device))] = q[:, :, 0].float()
    return out.view(b, h, hkv * d)


def lowrank_scores(q: torch.Tensor, p: DKVParts, usable: torch.Tensor) -> torch.Tensor:
    """Scaled scores q.k / sqrt(D) of n encoded blocks, in low-rank form, read in place.

    q: [B, H, 1, D]; p: parts with leading [n] (every sequence reads every block: the rows'
    own layout); usable: [n, B, bs] bool (False: -inf). Returns [B, n, H, bs] float32."""
    b, h, _, d = q.shape
    n, _, bs, r = p.coeffs.shape
    hd = p.anchor.shape[-1] // 2  # Hkv * D: the K columns, then the V columns
    qr = head_rows(q / math.sqrt(d), hd // d)  # qr: [B, H, Hkv*D] scaled
    out = torch.empty(b, n, h, bs, dtype=torch.float32, device=q.device)
    for i in range(b):  # one sequence at a time: its parts are 3-D views the matmuls read in place
        proj = torch.bmm(qr[i].expand(n, -1, -1), p.basis[:, i, :hd].float())  # proj: [n, H, r]
        base = p.anchor[:, i, :hd].float() @ qr[i].T  # base: [n, H] the anchors' scores
        torch.baddbmm(base[..., None], proj, p.coeffs[:, i].float().mT, out=out[i])  # [n, H, bs]
    return out.masked_fill_(~usable.transpose(0, 1)[:, :, None], float("-inf"))


def block_weights(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass of exp over every block's scores [B, n, H, bs]: w = exp(scores - top) [B, n, H, bs]
    with top: [B, H] each head's largest score (0 where it has none), so a block's attention mass
    and the attention itself come from the same w."""
    top = scores.amax(dim=(1, 3))  # top: [B, H]
    top = torch.where(torch.isinf(top), 0.0, top)
    return torch.exp(scores - top[:, None, :, None]), top


def block_mass(w: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """log of each block's attention mass summed over heads, from block_weights: [B, n]."""
    return (w.sum(-1).log() + top[:, None]).logsumexp(dim=2)  # [B, n, H] -> [B, n]


def lowrank_attention(q: torch.Tensor, p: DKVParts, w: torch.Tensor, top: torch.Tensor,
                      route: torch.Tensor | None = None):
    """Attention over encoded blocks in low-rank form, from block_weights(scores).

    q: [B, H, 1, D]; p: parts with leading [n]; w: [B, n, H, bs], top: [B, H]; route: [B, K] the
    blocks each sequence attends (None: all n). Only the routed blocks' value side is read: one
    gather of K blocks per sequence. Returns out: [B, H, 1, D] float32 and lse: [B, H, 1] (-inf
    where nothing is attended)."""
    b, h, _, d = q.shape
    hd = p.anchor.shape[-1] // 2
    if route is None:
        route = torch.arange(w.shape[1], device=q.device).expand(b, -1)  # route: [B, n]
    o = torch.empty(b, h, hd, dtype=torch.float32, device=q.device)  # o: [B, H, Hkv*D]
    den = torch.empty(b, h, dtype=torch.float32, device=q.device)  # den: [B, H]
    # one sequence at a time: index_select along its parts' block axis copies each routed block's
    # part whole (one advanced index over the block and sequence axes at once was ~2x slower on the CPU)
    for i in range(b):
        idx = route[i]  # idx: [K]
        wi = w[i].index_select(0, idx)  # wi: [K, H, bs]
        wsum = wi.sum(-1)  # wsum: [K, H]
        wc = torch.bmm(wi, p.coeffs[:, i].index_select(0, idx).float())  # wc: [K, H, r] weighted sums in r dims
        oi = torch.bmm(wc, p.basis[:, i, hd:].index_select(0, idx).float().mT).sum(0)  # oi: [H, Hkv*D] mapped back
        oi += wsum.T @ p.anchor[:, i, hd:].index_select(0, idx).float()  # the anchors' share: [H, Hkv*D]
        o[i] = oi
        den[i] = wsum.sum(0)
    out = o.view(b, h, hd // d, d)[(slice(None), *_own_kv_head(h, hd // d, q.device))]  # out: [B, H, D] own KV head
    out = out / den.clamp(min=torch.finfo(den.dtype).tiny)[..., None]
    return out[:, :, None], (den.log() + top)[:, :, None]


def residual_kv(p: DKVParts, blocks: torch.Tensor, bs: int, d: int):
    """Exact residual tokens of n blocks. p: parts with leading [n]; blocks: [n] block ids.
    Returns k, v: [B, Hkv, n*m, D] and pos: [B, n*m] cache positions."""
    n, b, m, f = p.res_rows.shape
    hkv = f // (2 * d)
    rows = p.res_rows.permute(1, 0, 2, 3).reshape(b, n * m, 2, hkv, d)  # rows: [B, n*m, 2, Hkv, D]
    pos = (blocks[:, None, None] * bs + p.res_idx.long()).permute(1, 0, 2).reshape(b, n * m)
    k, v = rows.permute(2, 0, 3, 1, 4)  # k, v: [B, Hkv, n*m, D]
    return k, v, pos
