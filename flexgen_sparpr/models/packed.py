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
  product (weight_kernel.cpp): each group of 32 activations rounded to integer codes with a float
  scale (8-bit for the 4-bit projections, as llama.cpp's Q8_1; 16-bit for the head, whose near ties
  decide the token), integer dots over the codes (AVX512-VNNI), scaled once a group; the weights'
  scales are float16 (a Q4_1 / Q8_0 checkpoint's own). The codes are stored in the kernel's chunked
  order (chunk_codes). Longer inputs (a prefill) widen the weight once and take F.linear.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .cpu_kernel import kernel as compiled_kernel
from .group_codes import GROUP, chunk_codes, unchunk_codes

FORMATS = ("auto", "raw", "bfloat16", "int8", "int4")
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
        k = bf16_kernel(x2)
        if k is not None:  # a decode step's rows: widened as read (bf16_kernel.cpp)
            return k.bf16_matmul(x2.contiguous(), self.w)
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
            x = x2 if x2.dtype in (torch.float32, _BF16) else x2.float()  # the kernel reads both
            return getattr(k, self._op)(x.contiguous(), *self._kernel_args()).to(x2.dtype)
        return F.linear(x2, self.dequantized(x2.dtype))


class Int4Weight(GroupWeight):
    fmt = "int4"
    _op = "q4_matmul"

    def __init__(self, q: torch.Tensor, dm: torch.Tensor, shape: tuple[int, int]):
        self.q = q  # [out, in/2] uint8: the codes two a byte, in the kernel's chunks (chunk_codes)
        self.dm = dm  # [out, 2, in/GROUP] float16: the groups' scales, then their lows: w = low + code * scale
        self.shape = tuple(shape)

    def _kernel_args(self):
        return self.q, self.dm

    def dequantized(self, dtype):
        dm = self.dm.to(torch.float32)
        codes = unchunk_codes(self.q, self.shape[1], 4).to(torch.float32)  # codes: [out, in/G, G]
        return (codes * dm[:, 0, :, None] + dm[:, 1, :, None]).reshape(self.shape).to(dtype)

    def rows(self, start, stop):
        return Int4Weight(self.q[start:stop], self.dm[start:stop], (stop - start, self.shape[1]))


class Int8gWeight(GroupWeight):
    """8-bit codes with one scale per group of 32 inputs (GGUF's Q8_0): the LM head under int4."""

    fmt = "int4"
    _op = "q8_matmul"

    def __init__(self, q: torch.Tensor, d: torch.Tensor):
        self.q, self.d = q, d  # q: [out, in] uint8, code + 128 in the kernel's chunks; d: [out, in/GROUP] float16
        self.shape = tuple(q.shape)

    def _kernel_args(self):
        return self.q, self.d

    def dequantized(self, dtype):
        codes = unchunk_codes(self.q, self.shape[1], 8).to(torch.float32) - 128  # codes: [out, in/G, G]
        return (codes * self.d.to(torch.float32)[..., None]).reshape(self.shape).to(dtype)

    def rows(self, start, stop):
        return Int8gWeight(self.q[start:stop], self.d[start:stop])


BF16_KERNEL_ROWS = 8  # measured, SmolLM2's shapes: 2.2x torch's bfloat16 at 1 row, 1.3-1.9x at 2-6, 1.3x at 8


def bf16_kernel(x2: torch.Tensor):
    """The compiled bfloat16-weight product (bf16_kernel.cpp) where it beats torch's for x2 [rows, in]:
    1 to 8 rows (a decode step's) on the CPU, float32 or bfloat16."""
    if x2.device.type == "cpu" and x2.shape[0] <= BF16_KERNEL_ROWS and x2.dtype in (torch.float32, _BF16):
        return compiled_kernel()
    return None


F32_KERNEL_ROWS = (2, 8)  # measured (SmolLM2's shapes, Intel Xeon): 1.6-2.8x torch's float32 product at 4-8 rows,
# 1.0-1.4x at 2; at one row torch's against the [in, out] layout is as fast (layers.Transposed)


def f32_kernel(x2: torch.Tensor):
    """The compiled float32-weight product (bf16_kernel.cpp f32_matmul) where it beats torch's for
    x2 [rows, in]: 2 to 8 float32 rows on the CPU."""
    if x2.device.type == "cpu" and F32_KERNEL_ROWS[0] <= x2.shape[0] <= F32_KERNEL_ROWS[1] and x2.dtype == torch.float32:
        return compiled_kernel()
    return None


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
    dm = torch.stack([scale, low], dim=1).to(torch.float16).contiguous()  # dm: [out, 2, in/G]
    return Int4Weight(chunk_codes(codes, 4), dm, tuple(codes.shape))


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
    return Int8gWeight(chunk_codes(codes + 128, 8), scale.to(torch.float16).contiguous())


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
