"""DKV decode attention over encoded blocks: scores and values in low-rank space, never
decompressing K; partial attentions carry their log-sum-exp so they merge exactly.

For KV head g with key columns Kg and value columns Vg of the joint basis W (docs/dkv.md):
    q . k_t = q . a[Kg] + C_t . (W[Kg]^T q)          (project q once: r numbers per head)
    sum_t p_t v_t = (sum_t p_t) a[Vg] + (sum_t p_t C_t) @ W[Vg]^T

The anchor's score q . a[Kg] is the same for every token of a block, so within a block the
softmax is attention with the projected query W[Kg]^T q against the coefficients C as keys and
as values: one fused attention call (models/layers.attention_with_lse) attends every block of
every sequence on its own (the sequences as its KV heads), giving each block's mean coefficient
per head and its log mass; the anchor's score is added to that log mass afterwards. The routed
blocks then merge by their log masses and map back through W[Vg] and a[Vg] (lowrank_merge).

The parts are views into the encoded rows ([n, nbytes] uint8, one row per block, each row one
sub-row per sequence: kv/dkv/codec.py): a part's block and sequence axes merge into one axis of
stride sub-row, so one batched matmul over every (block, sequence) reads the parts in place (the
projections), and the value side copies only the routed (block, sequence) items' parts. A query
is laid out as [H, Hkv*D] with zeros off its own KV head's columns, so one matmul serves every
head of a group-query model."""
from __future__ import annotations

import math

import torch

from ...models.layers import KeyMask, attention_with_lse
from ...utils.threads import threads_back
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


def _per_block(x: torch.Tensor) -> torch.Tensor:
    """A part [n, B, ...] as [n*B, ...], one item per (block, sequence), block-major: a view, as
    the codec's row layout allows (kv/dkv/codec.py), so the batched matmuls read it in place."""
    return x.view(x.shape[0] * x.shape[1], *x.shape[2:])


def lowrank_blocks(q: torch.Tensor, p: DKVParts, usable: torch.Tensor | KeyMask,
                   threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every encoded block attended on its own in low-rank space, one fused attention call (run
    on `threads` intra-op threads where given: utils/threads.threads_back).

    q: [B, H, 1, D]; p: parts with leading [n]; usable: [n, B, bs] bool, or a KeyMask of it (one
    made when the blocks were encoded serves every step). Returns c: [n, B, H, r]
    float32, each head's softmax-weighted mean of the block's coefficients over its usable tokens,
    and lse: [B, n, H] float32, the log of the block's attention mass (its softmax denominator of
    the scaled scores q.k / sqrt(D)), -inf where it has no usable token. The anchor's score is the
    same for every token of a block: it shifts lse only, so the attention runs on the coefficients
    alone, with each block's projected query W[Kg]^T q and C as both keys and values."""
    b, h, _, d = q.shape
    n, _, bs, r = p.coeffs.shape
    hd = p.anchor.shape[-1] // 2  # Hkv * D: the K columns, then the V columns
    qr = head_rows(q / math.sqrt(d), hd // d)  # qr: [B, H, Hkv*D] scaled
    qx = qr.expand(n, -1, -1, -1).reshape(n * b, h, hd)  # qx: [n*B, H, Hkv*D] a block's sequence's query
    proj = torch.bmm(qx, _per_block(p.basis)[:, :hd].float())  # proj: [n*B, H, r]
    base = torch.bmm(qx, _per_block(p.anchor)[:, :hd, None].float())  # base: [n*B, H, 1] the anchors' scores
    # the attention's own 1/sqrt(r) undone: the scores stay q.k / sqrt(D)
    qc = (proj * math.sqrt(r)).view(n, b * h, 1, r)  # qc: [n, B*H, 1, r]
    with threads_back(threads, q.device):  # the sequences as KV heads: c: [n, B*H, 1, r]
        c, lse = attention_with_lse(qc, p.coeffs, p.coeffs, usable)
    return c.view(n, b, h, r), (lse.view(n, b, h) + base.view(n, b, h)).transpose(0, 1)


def lowrank_merge(q: torch.Tensor, p: DKVParts, c: torch.Tensor, lse: torch.Tensor,
                  route: torch.Tensor | None = None):
    """The routed blocks' attentions from lowrank_blocks merged into one, mapped back from
    low-rank space: sum_t p_t v_t = (sum_t p_t) a[Vg] + (sum_t p_t C_t) @ W[Vg]^T per block.

    q: [B, H, 1, D]; c: [n, B, H, r]; lse: [B, n, H]; route: [B, K] (None: all n). Returns out:
    [B, H, 1, D] float32 and lse: [B, H, 1] (-inf where nothing is attended)."""
    b, h, _, d = q.shape
    n, _, _, r = c.shape
    hd = p.anchor.shape[-1] // 2
    if route is None:
        route = torch.arange(n, device=q.device).expand(b, -1)  # route: [B, n]
    kk = route.shape[1]
    lse = lse.gather(1, route[:, :, None].expand(-1, -1, h))  # lse: [B, K, H]
    total = lse.logsumexp(dim=1)  # total: [B, H]
    alpha = torch.exp(lse - torch.where(torch.isinf(total), 0.0, total)[:, None])  # alpha: [B, K, H] block weights
    flat = (route * b + torch.arange(b, device=q.device)[:, None]).view(-1)  # flat: [B*K] (block, sequence) items
    ci = c.view(n * b, h, r).index_select(0, flat) * alpha.view(b * kk, h, 1)  # ci: [B*K, H, r] weighted means
    o = torch.bmm(ci, _per_block(p.basis)[:, hd:].index_select(0, flat).float().mT)  # o: [B*K, H, Hkv*D]
    anchors = _per_block(p.anchor)[:, hd:].index_select(0, flat).float().view(b, kk, hd)  # anchors: [B, K, Hkv*D]
    o = o.view(b, kk, h, hd).sum(1).baddbmm_(alpha.transpose(1, 2), anchors)  # o: [B, H, Hkv*D] + the anchors' share
    out = o.view(b, h, hd // d, d)[(slice(None), *_own_kv_head(h, hd // d, q.device))]  # out: [B, H, D] own KV head
    return out[:, :, None], total[:, :, None]


def residual_kv(p: DKVParts, blocks: torch.Tensor, bs: int, d: int):
    """Exact residual tokens of n blocks. p: parts with leading [n]; blocks: [n] block ids.
    Returns k, v: [B, Hkv, n*m, D] and pos: [B, n*m] cache positions."""
    n, b, m, f = p.res_rows.shape
    hkv = f // (2 * d)
    rows = p.res_rows.permute(1, 0, 2, 3).reshape(b, n * m, 2, hkv, d)  # rows: [B, n*m, 2, Hkv, D]
    pos = (blocks[:, None, None] * bs + p.res_idx.long()).permute(1, 0, 2).reshape(b, n * m)
    k, v = rows.permute(2, 0, 3, 1, 4)  # k, v: [B, Hkv, n*m, D]
    return k, v, pos
