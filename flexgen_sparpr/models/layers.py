"""Functional building blocks shared by every architecture: norms, RoPE, attention.

All functions take plain tensors (weights included) so one code path serves every device.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .cpu_kernel import kernel as compiled_kernel, usable as kernel_usable
from .packed import Packed, bf16_kernel, f32_kernel


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


_GLUE_DTYPES = (torch.float32, torch.bfloat16)


def _glue(*ts: torch.Tensor):
    """The compiled kernel where its one-call CPU ops (glue_kernel.cpp: float32 or bfloat16 tensors of
    one dtype, float32 arithmetic) serve these tensors."""
    for t in ts:
        if t.dtype != ts[0].dtype or t.dtype not in _GLUE_DTYPES or t.device.type != "cpu":
            return None
    return compiled_kernel()


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    k = _glue(x, w)
    if k is not None:  # one fused call, the same values as below (HF's order)
        return k.rms_norm_rows(x.reshape(-1, x.shape[-1]).contiguous(), w.contiguous(), eps).view(x.shape)
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


class Transposed(NamedTuple):
    """A projection weight stored as [in, out]: single-row products on CPU BLAS run ~1.6x
    faster against this layout (the engine stores it so when its batch is one sequence)."""

    t: torch.Tensor  # [in, out]


_ROW_PRODUCTS = {torch.bfloat16: (bf16_kernel, "bf16_matmul"), torch.float32: (f32_kernel, "f32_matmul")}


def linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., in]; w: [out, in] (or Transposed: [in, out]) -> [..., out]."""
    if isinstance(w, Transposed):
        y = x @ w.t
        return y + b if b is not None else y
    if isinstance(w, Packed):  # --weight-format: the packed kernels take [rows, in]
        y = w.matmul(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], w.shape[0])
        return y + b if b is not None else y
    rows = x.numel() // x.shape[-1]
    # decode rows of a bfloat16 run (torch's bfloat16 product of one row runs at a third of its float32
    # one here) or a float32 batch (2-8 rows): each weight row read once for all rows (bf16_kernel.cpp)
    pick = _ROW_PRODUCTS.get(w.dtype)
    k = pick[0](x.reshape(rows, -1)) if pick and x.dtype == w.dtype else None
    if k is not None:
        y = getattr(k, pick[1])(x.reshape(rows, -1).contiguous(), w.contiguous()).view(*x.shape[:-1], w.shape[0])
        return y + b if b is not None else y
    if x.device.type == "cpu" and rows <= 16:
        # decode-sized inputs: CPU BLAS is much faster as W @ x^T than as x @ W^T (measured
        # 1.8x at 4 rows); contiguous so later kernels (SDPA) keep their fast paths
        y = torch.mm(w, x.reshape(rows, -1).T).T.contiguous().view(*x.shape[:-1], w.shape[0])
        return y + b if b is not None else y
    return F.linear(x, w, b)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """positions: [B, S] int -> cos, sin: [B, 1, S, D] (HF rotate_half layout)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    ang = positions.float()[..., None] * inv  # ang: [B, S, D/2]
    ang = torch.cat([ang, ang], dim=-1)  # ang: [B, S, D]
    return ang.cos().to(dtype)[:, None], ang.sin().to(dtype)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, S, D]; rotates pairs (i, i + D/2)."""
    k = _glue(x, cos, sin) if x.shape[2] <= 16 else None  # decode-sized: one call
    if k is not None:
        return k.rope_rows(x, cos, sin)
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu: [..., 2F], gate | up (a fused gate|up product) -> silu(gate) * up: [..., F]."""
    k = _glue(gu)
    if k is not None:
        return k.silu_mul_rows(gu.reshape(-1, gu.shape[-1]).contiguous()).view(*gu.shape[:-1], gu.shape[-1] // 2)
    gate, up = gu.chunk(2, dim=-1)  # [..., F] each
    return F.silu(gate) * up


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    b, s, _ = x.shape
    return x.view(b, s, num_heads, -1).transpose(1, 2)  # [B, S, H*D] -> [B, H, S, D]


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    b, h, s, d = x.shape
    return x.transpose(1, 2).reshape(b, s, h * d)  # [B, H, S, D] -> [B, S, H*D]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     valid: torch.Tensor | None) -> torch.Tensor:
    """Prefill attention. q: [B, H, S, D]; k, v: [B, Hkv, S, D]; valid: [B, S] bool or None.

    Padded (invalid) queries attend only to themselves, so no row is all -inf.
    """
    s = q.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if valid is None or bool(valid.all()):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    pads = (~valid).sum(dim=1)  # pads: [B]
    if not torch.equal(valid, torch.arange(s, device=valid.device)[None, :] >= pads[:, None]):
        causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        mask = causal & valid[:, None, None, :]  # mask: [B, 1, S, S]
        return masked_attention(q, k, v, mask | torch.eye(s, dtype=torch.bool, device=q.device))
    # left padding: each sequence's valid suffix is plain causal attention, with no mask, so SDPA
    # keeps its fused kernels (no [B, H, S, S] scores) and GQA needs no K/V copies
    g = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for p in sorted(set(pads.tolist())):
        rows = (pads == p).nonzero()[:, 0]  # rows: the sequences with p pads
        out[rows, :, p:] = F.scaled_dot_product_attention(q[rows, :, p:], k[rows, :, p:], v[rows, :, p:],
                                                          is_causal=True, enable_gqa=gqa)
        out[rows, :, :p] = v[rows, :, :p].repeat_interleave(g, dim=1)  # a pad attends only itself
    return out


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA under a boolean mask (broadcastable to [B, H, Sq, T]). q: [B, H, Sq, D]; k, v:
    [B, Hkv, T, D]. With grouped KV heads the K/V heads are expanded first: CUDA's fused kernels
    take a mask or enable_gqa but not both, and the math kernel they fall back to materializes
    float32 [B, H, Sq, T] scores."""
    g = q.shape[1] // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # k, v: [B, H, T, D]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     valid: torch.Tensor | None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """One query position over T keys. q: [B, H, 1, D]; k, v: [B, Hkv, T, D];
    valid: [B, T] or per KV head [B, Hkv, T] bool. rows: [1|B, T'] int64 or None: attend rows
    rows[b] of k and v, read in place (the compiled CPU kernel only: `cpu_kernel.usable`), valid's
    T being T'."""
    if rows is not None or kernel_usable(q, k, v):
        o = kernel_decode(q, k, v, valid, rows, keep_dtype=True)[0]  # o: [B, H, 1, D]
        return o if o.dtype == q.dtype else o.to(q.dtype)
    k, v = k.to(q.dtype), v.to(q.dtype)  # a cache stored narrower than the compute dtype (no copy when alike)
    b, h, _, d = q.shape
    qg, ok = _grouped_query(q, k.shape[1], valid)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=ok)  # o: [B, Hkv, G, D]
    return o.reshape(b, h, 1, d)


def kernel_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None,
                  rows: torch.Tensor | None = None, keep_dtype: bool = False):
    """One query per head by the compiled CPU kernel (cpu_kernel.py; `usable` must hold). q: [B, H, 1, D];
    k, v: [B, Hkv, T, D] (float32, bfloat16 or float16); valid: [B, T'] or [B, Hkv, T'] bool or None;
    rows: [1|B, T'] int64, the rows of k and v attended (None: all T, T' = T). Returns out: [B, H, 1, D]
    (float32; keep_dtype: a bfloat16 q's own dtype, read and rounded in the kernel, no conversion calls)
    and lse: [B, H, 1] float32 (a row with no valid key: 0 and -inf)."""
    if q.dtype != torch.float32 and not (keep_dtype and q.dtype == torch.bfloat16):
        q = q.float()
    mask = None if valid is None else (valid[:, None] if valid.dim() == 2 else valid).contiguous()  # [B, 1|Hkv, T']
    out, lse = compiled_kernel().decode_attention_heads(q, k, v, mask, rows)  # out: [B, H, 1, D]; lse: [B, H, 1]
    return out, lse


def kernel_decode_parts(q: torch.Tensor, parts: list) -> torch.Tensor:
    """One query per head over keys that lie in several places, by one call of the compiled CPU kernel
    (one softmax over them all; `usable` must hold for each part). q: [B, H, 1, D]; parts: (k, v: [B,
    Hkv, T, D] (float32, bfloat16 or float16), valid: [B, T'] or [B, Hkv, T'] bool or None, rows: [1|B,
    T'] int64 or None) each, as kernel_decode takes them. Returns out: [B, H, 1, D] in q's dtype."""
    b, h, _, d = q.shape
    hkv = parts[0][0].shape[1]
    qg = q.reshape(b, hkv, h // hkv, d)  # qg: [B, Hkv, G, D]
    qg = (qg if q.dtype == torch.bfloat16 else qg.float()).contiguous()
    masks = [None if m is None else (m[:, None] if m.dim() == 2 else m).contiguous() for _, _, m, _ in parts]
    out, _ = compiled_kernel().decode_attention_parts(qg, [p[0] for p in parts], [p[1] for p in parts], masks,
                                                      [p[3] for p in parts])  # out: [B, Hkv, G, D]
    return out.reshape(b, h, 1, d).to(q.dtype)


def _grouped_query(q: torch.Tensor, hkv: int, valid: torch.Tensor | None):
    """One decode query per head laid out for a kernel without group-query support: the query heads
    of a KV head become that head's query rows (no K/V expansion). q: [B, H, 1, D]; valid: [B, T]
    or [B, Hkv, T]. Returns qg: [B, Hkv, G, D] and the mask ok: [B, 1|Hkv, 1, T] bool (or None)."""
    b, h, _, d = q.shape
    return q.reshape(b, hkv, h // hkv, d), None if valid is None else _grouped_mask(valid)


def _grouped_mask(valid: torch.Tensor) -> torch.Tensor:
    """valid: [B, T] or [B, Hkv, T] -> [B, 1|Hkv, 1, T], the layout of _grouped_query's rows."""
    return valid[:, None, None, :] if valid.dim() == 2 else valid[:, :, None, :]


# torch's fused CPU flash-attention kernel, which also returns the log-sum-exp (the public
# scaled_dot_product_attention does not); absent from a build: the einsum path below serves
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


class KeyMask(NamedTuple):
    """A key mask made once for many decode steps (attention_with_lse's `valid`, from key_mask):
    the boolean mask and what the fused CPU kernel needs of it, which would otherwise be made
    again at every call."""

    valid: torch.Tensor  # [B, T] or [B, Hkv, T] bool
    additive: torch.Tensor | None  # [B, 1|Hkv, 1, T] float32, 0 or -inf; None: every key valid
    dead: torch.Tensor | None  # [B, 1|Hkv, 1] bool: the rows with no valid key; None: there are none


def key_mask(valid: torch.Tensor, once: bool = True) -> KeyMask:
    """valid: [B, T] or [B, Hkv, T] bool -> a KeyMask to pass as attention_with_lse's `valid`.
    `once` (a mask made for many calls): also look whether it masks anything at all, so that the
    calls that take it skip what it would not change."""
    if valid.device.type != "cpu" or _FLASH_CPU is None:
        return KeyMask(valid, None, None)
    ok = _grouped_mask(valid)  # ok: [B, 1|Hkv, 1, T]
    if once and bool(ok.all()):
        return KeyMask(valid, None, None)
    dead = ~ok.any(dim=-1)  # dead: [B, 1|Hkv, 1]
    additive = torch.zeros(ok.shape, dtype=torch.float32).masked_fill_(~ok, float("-inf"))
    return KeyMask(valid, additive, dead if not once or bool(dead.any()) else None)


def _decode_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          valid: torch.Tensor | KeyMask | None):
    """attention_with_lse for one query per head, float32 on the CPU, in one fused kernel: a KV
    head's G query heads go in as its G query positions (no K/V expanded to H heads)."""
    b, h, _, d = q.shape
    if valid is not None and not isinstance(valid, KeyMask):
        valid = key_mask(valid, once=False)  # the kernel takes an additive mask only
    mask, dead = (None, None) if valid is None else valid[1:]
    qg = q.reshape(b, k.shape[1], h // k.shape[1], d)  # qg: [B, Hkv, G, D]
    out, lse = _FLASH_CPU(qg, k, v, attn_mask=mask)  # out: [B, Hkv, G, D]; lse: [B, Hkv, G]
    if dead is not None:  # the kernel gives a row with no valid key lse 0, not -inf
        lse = lse.masked_fill(dead, float("-inf"))
    return out.reshape(b, h, 1, d), lse.reshape(b, h, 1)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       valid: torch.Tensor | KeyMask | None = None):
    """Partial attention that also returns its log-sum-exp, for merging.

    q: [B, H, Sq, D]; k, v: [B, Hkv, T, D]; valid: [B, T] bool or [B, Hkv, T] bool, or a KeyMask
    of one (key_mask: for a mask that serves many steps).
    Returns out: [B, H, Sq, D] (float32), lse: [B, H, Sq] (float32; -inf where nothing is valid).
    """
    b, h, sq, d = q.shape
    hkv = k.shape[1]
    if k.shape[2] == 0:  # nothing to attend
        return (torch.zeros(b, h, sq, d, dtype=torch.float32, device=q.device),
                torch.full((b, h, sq), float("-inf"), dtype=torch.float32, device=q.device))
    if sq == 1 and kernel_usable(q, k, v):
        return kernel_decode(q, k, v, valid.valid if isinstance(valid, KeyMask) else valid)
    if sq == 1 and _FLASH_CPU is not None and q.device.type == "cpu" and \
            q.dtype == k.dtype == v.dtype == torch.float32:
        return _decode_attention_cpu(q, k, v, valid)
    if isinstance(valid, KeyMask):
        valid = valid.valid
    qg = q.float().view(b, hkv, h // hkv, sq, d)  # qg: [B, Hkv, G, Sq, D]
    scores = torch.einsum("bkgqd,bktd->bkgqt", qg, k.float()) / math.sqrt(d)
    if valid is not None:
        m = valid[:, None, None, None, :] if valid.dim() == 2 else valid[:, :, None, None, :]
        scores = scores.masked_fill(~m, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)  # top: [B, Hkv, G, Sq, 1]
    top = torch.where(torch.isinf(top), 0.0, top)  # a row with nothing valid: its weights are all 0
    p = torch.exp(scores - top)  # one pass of exp: the weights and their sum
    den = p.sum(dim=-1)  # den: [B, Hkv, G, Sq]
    out = torch.einsum("bkgqt,bktd->bkgqd", p, v.float()) / den.clamp(min=torch.finfo(den.dtype).tiny)[..., None]
    lse = den.log() + top[..., 0]  # lse: [B, Hkv, G, Sq], -inf where nothing is valid
    return out.reshape(b, h, sq, d), lse.reshape(b, h, sq)


def merge_attention(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Merge partial attentions [(out [B,H,Sq,D], lse [B,H,Sq]), ...] by log-sum-exp."""
    lses = torch.stack([lse for _, lse in parts])  # lses: [P, B, H, Sq]
    total = torch.logsumexp(lses, dim=0)
    total = torch.where(torch.isinf(total), torch.zeros_like(total), total)
    w = torch.exp(lses - total)[..., None]  # w: [P, B, H, Sq, 1]
    return sum(wi * out for wi, (out, _) in zip(w, parts))
