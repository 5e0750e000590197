"""FlexGen-style group-wise asymmetric min/max quantization (4 or 8 bits).

A tensor is viewed as [pre, L, post] around `group_dim`; L is padded up to
`groups * group_size` by repeating its last slice (so padding never widens a
group's range) and each run of `group_size` consecutive elements along that dim
gets its own min `mn` and step `scale`:  x ~= q * scale + mn,  q in [0, 2^bits).
With 4 bits two codes are packed per byte: element 2k in the low nibble,
element 2k+1 in the high nibble.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

_INT_OF = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


@dataclass(frozen=True)
class CompressionConfig:
    """num_bits in {4, 8}; group_dim may be negative; only asymmetric is supported."""

    num_bits: int = 4
    group_size: int = 64
    group_dim: int = 0
    symmetric: bool = False

    def __post_init__(self):
        if self.num_bits not in (4, 8):
            raise ValueError(f"num_bits must be 4 or 8, got {self.num_bits}")
        if self.symmetric:
            raise ValueError("symmetric quantization is not supported; use symmetric=False")
        if self.group_size < 1 or (self.num_bits == 4 and self.group_size % 2):
            raise ValueError(f"group_size must be a positive (for 4 bits, even) int, got {self.group_size}")


@dataclass
class CompressedTensor:
    """Quantized tensor.

    data:  uint8 [pre, groups, group_size * num_bits // 8, post]
    mn, scale: [pre, groups, 1, post] in the original float dtype
    shape, dtype: those of the original tensor
    """

    data: torch.Tensor
    mn: torch.Tensor
    scale: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    config: CompressionConfig

    @property
    def nbytes(self) -> int:
        """Real bytes held: packed codes + per-group min and scale."""
        return self.data.nbytes + self.mn.nbytes + self.scale.nbytes

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to(self, device, non_blocking: bool = False) -> "CompressedTensor":
        """Copy of this tensor with data/mn/scale on `device`."""
        mv = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return dataclasses.replace(self, data=mv(self.data), mn=mv(self.mn), scale=mv(self.scale))


def group_layout(shape, cfg: CompressionConfig) -> tuple[int, int, int, int]:
    """(pre, L, post, groups) of `shape` around cfg.group_dim."""
    if len(shape) == 0:
        raise ValueError("cannot compress a 0-dim tensor")
    if not -len(shape) <= cfg.group_dim < len(shape):
        raise ValueError(f"group_dim {cfg.group_dim} out of range for shape {tuple(shape)}")
    dim = cfg.group_dim % len(shape)
    length = shape[dim]
    return math.prod(shape[:dim]), length, math.prod(shape[dim + 1:]), -(-length // cfg.group_size)


def compressed_nbytes(shape, dtype: torch.dtype, cfg: CompressionConfig) -> int:
    """Bytes `compress` would produce for a tensor of `shape`/`dtype` (to size buffers)."""
    pre, _, post, groups = group_layout(tuple(shape), cfg)
    cells = pre * groups * post
    item = torch.empty((), dtype=dtype).element_size()
    return cells * cfg.group_size * cfg.num_bits // 8 + 2 * cells * item


def _cast_up(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast non-negative `x` to `dtype`, rounding up so that result >= x."""
    y = x.to(dtype)
    if dtype == x.dtype:
        return y
    low = (y.to(x.dtype) < x).to(_INT_OF[dtype])
    return (y.view(_INT_OF[dtype]) + low).view(dtype)  # +1 ulp: next float up for positives


def compress(t: torch.Tensor, cfg: CompressionConfig = CompressionConfig()) -> CompressedTensor:
    """Quantize float tensor `t` (any shape, CPU or CUDA) group-wise along cfg.group_dim."""
    if not t.is_floating_point():
        raise TypeError(f"compress needs a floating-point tensor, got {t.dtype}")
    pre, length, post, groups = group_layout(t.shape, cfg)
    size, levels = cfg.group_size, (1 << cfg.num_bits) - 1
    work = torch.promote_types(t.dtype, torch.float32)  # do the arithmetic in >= fp32

    x = t.reshape(pre, length, post)
    pad = groups * size - length
    if pad:
        x = torch.cat([x, x[:, length - 1:].expand(pre, pad, post)], dim=1)
    x = x.reshape(pre, groups, size, post)

    mn = x.amin(dim=2, keepdim=True)  # an element of t, so exact in t.dtype
    mx = x.amax(dim=2, keepdim=True)
    # round the stored step up so mn + levels*scale covers mx even after the cast
    scale = _cast_up((mx.to(work) - mn.to(work)) / levels, t.dtype)
    step = scale.to(work).clamp_min(torch.finfo(work).tiny)  # constant group: 0 / tiny = 0
    q = ((x.to(work) - mn.to(work)) / step).round_().clamp_(0, levels).to(torch.uint8)
    if cfg.num_bits == 4:
        q = q[:, :, 0::2] | (q[:, :, 1::2] << 4)
    return CompressedTensor(q, mn.contiguous(), scale, t.shape, t.dtype, cfg)


def decompress(c: CompressedTensor, device=None) -> torch.Tensor:
    """Rebuild a tensor of c.shape / c.dtype, on `device` (default: c's device)."""
    if device is not None and torch.device(device) != c.device:
        c = c.to(device)
    pre, length, post, groups = group_layout(c.shape, c.config)
    q = c.data
    work = torch.promote_types(c.dtype, torch.float32)
    if post == 1 and groups * c.config.group_size == length:
        # groups along the last dim, no padding (a KV block's head_dim): rows of one group each, the
        # scale and min broadcast along the row (vectorizes; a trailing size-1 dim does not)
        r = pre * groups
        q = q.reshape(r, -1)
        if c.config.num_bits == 4:
            q = torch.stack([q & 0x0F, q >> 4], dim=2).view(r, -1)  # q: [r, size]
        x = (q.to(work) * c.scale.reshape(r, 1).to(work)).add_(c.mn.reshape(r, 1).to(work))  # x: [r, size]
        return x.to(c.dtype).reshape(c.shape)
    if c.config.num_bits == 4:
        q = torch.stack([q & 0x0F, q >> 4], dim=3)  # [pre, groups, size/2, 2, post]
    q = q.reshape(pre, groups, c.config.group_size, post)
    x = (q.to(work) * c.scale.to(work) + c.mn.to(work)).to(c.dtype)
    x = x.reshape(pre, groups * c.config.group_size, post)[:, :length]
    return x.reshape(c.shape).contiguous()
