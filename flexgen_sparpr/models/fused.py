"""A decode step's layer in three compiled calls where its weights are 4-bit (glue_kernel.cpp): the
attention input (`q4_qkv`: RMSNorm, the q|k|v product, heads, RoPE), the output projection with its
residual (`q4_out`) and the MLP half (`q4_mlp`: RMSNorm, the gate|up product, SiLU times up, the down
product, the residual).

Layer by layer, an MLP at one row is four kernel calls and about as long again in Python between
them: measured 125 us against 70 us for the same kernels called back to back (SmolLM2's 576 x 1536
MLP, int4, warm). Each fused call runs the same kernels in the same order and dtypes as
models/llama.py's layer-by-layer path, so its outputs equal that path's exactly. Each returns None
where the kernel does not serve (not 4-bit, a bias, more rows than a decode step's, another device or
dtype), and the caller's layer-by-layer path runs.
"""
from __future__ import annotations

import torch

from .cpu_kernel import kernel as compiled_kernel
from .packed import MAX_ROWS, Int4Weight

_DTYPES = (torch.float32, torch.bfloat16)


def _serves(x: torch.Tensor, same: torch.Tensor) -> bool:
    """Decode rows (at most MAX_ROWS) of x [..., hidden] on the CPU in float32 or bfloat16, with `same`
    in x's dtype (the kernel makes what it takes contiguous: a decode step's are already)."""
    return x.numel() <= MAX_ROWS * x.shape[-1] and x.dtype in _DTYPES and same.dtype == x.dtype and x.is_cpu


def q4_qkv(x: torch.Tensor, ln: torch.Tensor, eps: float, qkv, cos: torch.Tensor, sin: torch.Tensor,
           heads: int, kv_heads: int):
    """(h, q, k, v) of x [B, S, hidden] in one call: h = rms_norm(x) * ln [B, S, hidden]; q [B, H, S, D]
    and k [B, Hkv, S, D] with RoPE (cos, sin: [B, 1, S, D]); v [B, Hkv, S, D]. qkv: the fused [(H + 2
    Hkv) D, hidden] Int4Weight. None where the kernel does not serve."""
    if type(qkv) is not Int4Weight or x.shape[1] > 16 or not _serves(x, ln) or cos.dtype != x.dtype:
        return None
    k = compiled_kernel()
    return None if k is None else tuple(k.q4_qkv(x, ln, eps, qkv.q, qkv.dm, cos, sin, heads, kv_heads))


def q4_out(x: torch.Tensor, o: torch.Tensor, w) -> torch.Tensor | None:
    """x + merge_heads(o) @ w^T in one call: x [B, S, hidden], o [B, H, S, D], w an Int4Weight [hidden,
    H D] with no bias. None where the kernel does not serve."""
    if type(w) is not Int4Weight or not o.is_cpu or not _serves(x, x):
        return None
    k = compiled_kernel()
    return None if k is None else k.q4_out(x, o, w.q, w.dm)  # [B, S, hidden]


def q4_mlp(x: torch.Tensor, ln: torch.Tensor, eps: float, gate_up, down) -> torch.Tensor | None:
    """x + down(silu(gate) * up) of rms_norm(x) * ln in one call, where the kernel serves: x [..., H]
    decode rows (at most MAX_ROWS) on the CPU in float32 or bfloat16, ln [H] of x's dtype, gate_up
    [2F, H] and down [H, F] Int4Weight with no bias. None where it does not (the caller's layer-by-layer
    path then runs)."""
    if type(gate_up) is not Int4Weight or type(down) is not Int4Weight or not _serves(x, ln):
        return None
    k = compiled_kernel()
    return None if k is None else k.q4_mlp(x, ln, eps, gate_up.q, gate_up.dm, down.q, down.dm)  # [..., H]
