"""Weight formats a projection is stored and multiplied in (--weight-format).

A decode step on the CPU reads every weight once per token, so its time is the weights' bytes over
how fast the kernel streams them. runtime/probe.py times each format against a float32 product on
the machine, and engine/weights.py packs each projection once at load. Every format keeps the
product's contract: x [..., in] -> [..., out] in x's dtype.

- raw: the compute dtype, as loaded (float32 on the CPU).
- bfloat16: the weights rounded to bfloat16.
- int8: 8-bit codes with one scale per output row (symmetric; torch's `_weight_int8pack_mm`, whose
  activations and scales are bfloat16).
- int4: 4-bit codes with a scale and a minimum per group of 32 inputs (GGUF's Q4_1 layout: a Q4_1
  checkpoint packs without changing a code); the LM head, whose 8-bit groups (Q8_0) a 4-bit code
  cannot hold, as 8-bit codes per group of 32. Decode rows (at most MAX_ROWS) go to the compiled
  product (weight_kernel.cpp), which widens each group in registers and multiplies it into float32
  activations; its scales are float16 (a Q4_1 / Q8_0 checkpoint's own), its sums float32. Longer
  inputs (a prefill) widen the weight once and take F.linear.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .cpu_kernel import kernel as compiled_kernel

FORMATS = ("auto", "raw", "bfloat16", "int8", "int4")
GROUP = 32  # inputs per int4 / grouped-int8 scale (GGUF's Q4_1 and Q8_0 block)
_BF16 = torch.bfloat16
MAX_ROWS = 8  # rows of x the compiled int4 product takes (weight_kernel.cpp): decode batches


class Packed:
    """A projection weight in a packed format: matmul(x) is x @ W^T."""

    fmt: str
    shape: tuple[int, int]  # (out, in), the weight's logical shape

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.__dict__.items() if isinstance(v, torch.Tensor)}

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:  # x2: [rows, in] -> [rows, out]
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def rows(self, start: int, stop: int) -> "Packed | None":
        """Output rows [start, stop) as a weight of their own, sharing this one's codes (the q or
        the k|v part of a fused q|k|v weight); None where the layout cannot be cut there."""
        return None


class Bf16Weight(Packed):
    fmt = "bfloat16"

    def __init__(self, w: torch.Tensor):
        self.w = w  # [out, in] bfloat16
        self.shape = tuple(w.shape)

    def matmul(self, x2):
        return F.linear(x2.to(_BF16), self.w).to(x2.dtype)

    def rows(self, start, stop):
        return Bf16Weight(self.w[start:stop])


class Int8Weight(Packed):
    fmt = "int8"

    def __init__(self, q: torch.Tensor, scales: torch.Tensor):
        self.q, self.scales = q, scales  # q: [out, in] int8; scales: [out] bfloat16
        self.shape = tuple(q.shape)

    def matmul(self, x2):
        return torch._weight_int8pack_mm(x2.to(_BF16), self.q, self.scales).to(x2.dtype)

    def rows(self, start, stop):
        return Int8Weight(self.q[start:stop], self.scales[start:stop])


class GroupWeight(Packed):
    """Codes with scales per group of GROUP inputs: decode rows go to the compiled product (its
    `_op` in weight_kernel.cpp, over `_kernel_args()`), longer inputs to F.linear over the weight
    widened once."""

    _op: str

    def _kernel_args(self) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:  # -> [out, in]
        raise NotImplementedError

    def matmul(self, x2):
        k = _kernel(x2)
        if k is not None:
            return getattr(k, self._op)(x2.float().contiguous(), *self._kernel_args()).to(x2.dtype)
        return F.linear(x2, self.dequantized(x2.dtype))


class Int4Weight(GroupWeight):
    fmt = "int4"
    _op = "q4_matmul"

    def __init__(self, q: torch.Tensor, dm: torch.Tensor, shape: tuple[int, int]):
        self.q = q  # [out, in/2] uint8: a group's byte j holds its input j (low nibble) and j + 16 (high)
        self.dm = dm  # [out, in/GROUP, 2] float16 (scale, low): w = low + code * scale
        self.shape = tuple(shape)

    def _kernel_args(self):
        return self.q, self.dm

    def dequantized(self, dtype):
        out, inn = self.shape
        q = self.q.view(out, inn // GROUP, GROUP // 2)
        codes = torch.cat([q & 15, q >> 4], dim=-1).to(torch.float32)  # codes: [out, in/G, G]
        dm = self.dm.to(torch.float32)
        return (codes * dm[..., :1] + dm[..., 1:]).reshape(out, inn).to(dtype)

    def rows(self, start, stop):
        return Int4Weight(self.q[start:stop], self.dm[start:stop], (stop - start, self.shape[1]))


class Int8gWeight(GroupWeight):
    """8-bit codes with one scale per group of 32 inputs (GGUF's Q8_0): the LM head under int4."""

    fmt = "int4"
    _op = "q8_matmul"

    def __init__(self, q: torch.Tensor, d: torch.Tensor):
        self.q, self.d = q, d  # q: [out, in] int8; d: [out, in/GROUP] float16: w = code * d
        self.shape = tuple(q.shape)

    def _kernel_args(self):
        return self.q, self.d

    def dequantized(self, dtype):
        out, inn = self.shape
        w = self.q.view(out, inn // GROUP, GROUP).to(torch.float32) * self.d.to(torch.float32)[..., None]
        return w.reshape(out, inn).to(dtype)

    def rows(self, start, stop):
        return Int8gWeight(self.q[start:stop], self.d[start:stop])


def _kernel(x2: torch.Tensor):
    """The compiled group-quantized product (weight_kernel.cpp) where it serves x2: decode rows on the
    CPU (multiplied in float32); elsewhere (a prefill's thousands of rows, no kernel) the weight is
    widened to x2's dtype for F.linear."""
    if x2.device.type == "cpu" and x2.shape[0] <= MAX_ROWS:
        return compiled_kernel()
    return None


@functools.cache
def int4_tile() -> int | None:
    """Rows torch's CPU int4 kernel packs together (kv/policies/sparpr_int4.py packs SparPR's key codes
    for it; whole tiles pack alone, as they do inside a bigger weight), found once, with the kernel's arithmetic checked (code c means (c - 8) x scale + zero);
    None: no such kernel here."""
    conv = getattr(torch, "_convert_weight_to_int4pack_for_cpu", None)
    mm = getattr(torch, "_weight_int4pack_mm_for_cpu", None)
    if conv is None or mm is None:
        return None
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (256, GROUP), generator=gen, dtype=torch.int32)  # codes: [N, K]
    x = torch.randn(3, GROUP, generator=gen).to(_BF16)  # x: [M, K]
    try:
        whole = conv(codes, 1)  # whole: [N, K / 2]
        sz = torch.stack([torch.ones(1, 256), torch.zeros(1, 256)], dim=-1).to(_BF16)  # sz: [1, N, 2]
        got = mm(x, whole, GROUP, sz).float()  # got: [M, N]
    except RuntimeError:
        return None
    want = x.float() @ (codes.float() - 8).T  # want: [M, N]
    if not torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max())):
        return None
    for tile in (16, 32, 64, 128):
        if all(torch.equal(conv(codes[i:i + tile].contiguous(), 1), whole[i:i + tile]) for i in range(0, 256, tile)):
            return tile
    return None


def packable(fmt: str, shape: tuple[int, ...]) -> bool:
    """Whether a weight of this shape can be stored in fmt (the int4 kernel wants whole groups)."""
    if len(shape) != 2:
        return False
    return fmt != "int4" or shape[1] % GROUP == 0


def _groups(w: torch.Tensor) -> torch.Tensor:
    out, inn = w.shape
    return w.float().reshape(out, inn // GROUP, GROUP)  # [out, in/G, G]


def _int4(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> Int4Weight:
    """codes: [out, in] in 0..15; scale, low: [out, in/G]; w = low + code * scale."""
    out, inn = codes.shape
    c = codes.to(torch.uint8).reshape(out, inn // GROUP, 2, GROUP // 2)  # c: [out, in/G, 2, G/2]
    q = (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(out, inn // 2).contiguous()
    return Int4Weight(q, torch.stack([scale, low], dim=-1).to(torch.float16).contiguous(), (out, inn))


def int4_codes(w: torch.Tensor):
    """Q4_1-style asymmetric 4-bit codes of w [out, in]: (codes [out, in] uint8, scale, low [out, in/G])."""
    g = _groups(w)
    low, high = g.amin(-1), g.amax(-1)  # low, high: [out, in/G]
    scale = (high - low) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((g - low[..., None]) / safe[..., None]).round().clamp(0, 15)  # codes: [out, in/G, G]
    return codes.reshape(w.shape).to(torch.uint8), scale, low


def int8g_codes(w: torch.Tensor):
    """Q8_0-style symmetric 8-bit codes per group of 32: (codes [out, in] int, scale [out, in/G])."""
    g = _groups(w)
    scale = g.abs().amax(-1) / 127  # scale: [out, in/G]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (g / safe[..., None]).round().clamp(-127, 127)
    return codes.reshape(w.shape).to(torch.int16), scale


def pack_int4(w: torch.Tensor) -> Int4Weight:
    return _int4(*int4_codes(w))


def pack_int8g(w: torch.Tensor) -> Int8gWeight:
    codes, scale = int8g_codes(w)
    return Int8gWeight(codes.to(torch.int8).contiguous(), scale.to(torch.float16).contiguous())


def pack_int8(w: torch.Tensor) -> Int8Weight:
    scale = w.float().abs().amax(-1) / 127  # scale: [out]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (w.float() / safe[:, None]).round().clamp(-127, 127).to(torch.int8)
    return Int8Weight(q, scale.to(_BF16))


def pack(w: torch.Tensor, fmt: str, head: bool = False):
    """w [out, in] in the format fmt ("raw": w itself); the LM head (head=True) under int4 is
    stored as grouped 8-bit codes (Int8gWeight)."""
    if fmt == "raw" or not packable(fmt, tuple(w.shape)):
        return w
    if fmt == "bfloat16":
        return Bf16Weight(w.to(_BF16).contiguous())
    if fmt == "int8":
        return pack_int8(w)
    return pack_int8g(w) if head else pack_int4(w)


def on_grid(w: torch.Tensor, fmt: str, head: bool = False, tol: float = 1e-3) -> bool:
    """Whether w's values already lie on fmt's codes (a quantized checkpoint): every value within
    tol of a quantization step of its code, so packing changes nothing but the scales' rounding."""
    if not packable(fmt, tuple(w.shape)) or fmt not in ("int4", "bfloat16"):
        return False
    if fmt == "bfloat16":
        return bool(torch.equal(w.to(_BF16).to(w.dtype), w))
    g = _groups(w)
    if head:
        codes, scale = int8g_codes(w)
        back = codes.reshape(g.shape).float() * scale[..., None]
    else:
        codes, scale, low = int4_codes(w)
        back = codes.reshape(g.shape).float() * scale[..., None] + low[..., None]
    err = (back - g).abs().amax(-1)  # err: [out, in/G]
    return bool((err <= tol * scale.clamp(min=torch.finfo(torch.float32).tiny)).all())


def unpack_like(like, flat: dict[str, torch.Tensor]):
    """A packed weight of like's kind over the tensors `flat` (as like.tensors() names them), e.g.
    read back from a tier."""
    new = object.__new__(type(like))
    new.__dict__.update(like.__dict__)
    new.__dict__.update(flat)
    return new
