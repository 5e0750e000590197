"""A decode step's MLP half in one compiled call (glue_kernel.cpp `q4_mlp`) where its weights are 4-bit.

Layer by layer, an MLP at one row is four kernel calls (RMSNorm, the gate|up product, SiLU times up,
the down product) and about as long again in Python between them: measured 130 us against 70 us for
the same kernels called back to back (SmolLM2's 576 x 1536 MLP, int4). The fused call runs the same
kernels in the same order and dtypes, so its output equals the layer-by-layer one exactly.
"""
from __future__ import annotations

import torch

from .cpu_kernel import kernel as compiled_kernel
from .packed import MAX_ROWS, Int4Weight

_DTYPES = (torch.float32, torch.bfloat16)


def q4_mlp(x: torch.Tensor, ln: torch.Tensor, eps: float, gate_up, down) -> torch.Tensor | None:
    """x + down(silu(gate) * up) of rms_norm(x) * ln in one call, where the kernel serves: x [..., H]
    decode rows (at most MAX_ROWS) on the CPU in float32 or bfloat16, ln [H] of x's dtype, gate_up
    [2F, H] and down [H, F] Int4Weight with no bias. None where it does not (the caller's layer-by-layer
    path then runs)."""
    if type(gate_up) is not Int4Weight or type(down) is not Int4Weight:
        return None
    rows = x.numel() // x.shape[-1]
    if rows > MAX_ROWS or x.device.type != "cpu" or x.dtype not in _DTYPES or ln.dtype != x.dtype:
        return None
    k = compiled_kernel()
    if k is None:
        return None
    return k.q4_mlp(x.reshape(rows, -1).contiguous(), ln.contiguous(), eps, gate_up.q, gate_up.dm,
                    down.q, down.dm).view(x.shape)  # [..., H]
