"""The compiled group-quantized product's side of the int4 format (models/packed.py,
weight_kernel.cpp): the order its codes are stored in, and how it rounds a decode step's
activations (what a reference must do to equal it)."""
from __future__ import annotations

import torch

GROUP = 32  # inputs per int4 / grouped-int8 scale (GGUF's Q4_1 and Q8_0 block)

CHUNK = 16  # groups a chunk of the kernel's layout (one int32 lane each)


def chunk_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [out, in] (0..15 for bits 4; 0..255 for bits 8) -> the kernel's layout (weight_kernel.cpp):
    per chunk of CHUNK groups, steps of four codes of each group; 4-bit codes two a byte, step 2L in
    the low nibbles and 2L + 1 in the high. Returns [out, in * bits / 8] uint8."""
    out, inn = codes.shape
    g = codes.to(torch.uint8).reshape(out, inn // GROUP, 8, 4)  # g: [out, G, step, 4]
    parts = []
    for c in range(0, inn // GROUP, CHUNK):
        part = g[:, c:c + CHUNK]  # part: [out, gc, 8, 4]
        if bits == 4:
            part = part[:, :, 0::2] | (part[:, :, 1::2] << 4)  # part: [out, gc, 4, 4]
        parts.append(part.transpose(1, 2).reshape(out, -1))  # steps outer, groups inner
    return torch.cat(parts, dim=1).contiguous()


def unchunk_codes(q: torch.Tensor, inn: int, bits: int) -> torch.Tensor:
    """chunk_codes' inverse: q [out, in * bits / 8] uint8 -> codes [out, in/G, G] uint8."""
    out, groups, steps = q.shape[0], inn // GROUP, 8 if bits == 8 else 4  # steps: 4 bytes of each group
    parts, at = [], 0
    for c in range(0, groups, CHUNK):
        gc = min(CHUNK, groups - c)
        part = q[:, at:at + steps * gc * 4].reshape(out, steps, gc, 4).transpose(1, 2)  # [out, gc, steps, 4]
        if bits == 4:
            part = torch.stack([part & 15, part >> 4], dim=3)  # [out, gc, 4, 2, 4]
        parts.append(part.reshape(out, gc, GROUP))
        at += steps * gc * 4
    return torch.cat(parts, dim=1)


def quantized_rows(x2: torch.Tensor, wide: bool = False):
    """x2 [M, in] float32 as the compiled product rounds it: codes per group of 32 with s = max|x| / top,
    top 127 (8 bits: the int4 projections') or 32767 (wide, 16 bits: the 8-bit head's). Returns
    (codes [M, in/G, G], s [M, in/G]), for references."""
    top = 32767.0 if wide else 127.0
    g = x2.float().reshape(x2.shape[0], -1, GROUP)  # g: [M, G, 32]
    amax = g.abs().amax(-1)  # amax: [M, G]
    inv = torch.where(amax > 0, top / amax, torch.zeros_like(amax))
    return (g * inv[..., None]).round().clamp(-top, top), amax / top
