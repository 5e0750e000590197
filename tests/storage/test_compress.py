"""Tests for group-wise min/max quantization."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexgen_sparpr.storage.compress import (
    CompressedTensor, CompressionConfig, compress, compressed_nbytes, decompress,
)

FLOATS = [torch.float32, torch.float16, torch.bfloat16]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _per_element(g: torch.Tensor, c: CompressedTensor) -> torch.Tensor:
    """Broadcast a per-group [pre, groups, 1, post] tensor back to c.shape."""
    dim = c.config.group_dim % len(c.shape)
    length = c.shape[dim]
    pre, groups, _, post = g.shape
    g = g.expand(pre, groups, c.config.group_size, post).reshape(pre, -1, post)[:, :length]
    return g.reshape(c.shape)


def _check_error_bound(t: torch.Tensor, c: CompressedTensor, out: torch.Tensor) -> None:
    """|x - x'| <= scale/2 per group, plus float eps: the fp32 arithmetic on values of
    size |mn| + levels*scale, and the final rounding of the output to t.dtype."""
    x, y = t.double(), out.double()
    scale = _per_element(c.scale, c).double()
    span = _per_element(c.mn, c).double().abs() + scale * ((1 << c.config.num_bits) - 1)
    eps32, eps = torch.finfo(torch.float32).eps, torch.finfo(t.dtype).eps
    tol = scale / 2 + 4 * eps32 * span + eps * y.abs()
    assert bool(((x - y).abs() <= tol).all()), float(((x - y).abs() - tol).max())


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("group_dim", [0, 2, -1])
@pytest.mark.parametrize("shape", [(64, 3, 128), (100, 3, 7), (1, 2, 65), (130, 1, 1)])
def test_round_trip_error_bound(shape, group_dim, dtype):
    t = (torch.randn(shape) * 3 + 1).to(dtype)
    c = compress(t, CompressionConfig(group_dim=group_dim))
    out = decompress(c)
    assert out.shape == t.shape and out.dtype == dtype and out.is_contiguous()
    assert c.scale.dtype == dtype and c.mn.dtype == dtype and c.data.dtype == torch.uint8
    _check_error_bound(t, c, out)


@pytest.mark.parametrize("dtype", FLOATS)
def test_eight_bits_is_tighter(dtype):
    t = torch.randn(96, 40).to(dtype)
    c4 = compress(t, CompressionConfig(num_bits=4, group_dim=0))
    c8 = compress(t, CompressionConfig(num_bits=8, group_dim=0))
    out8 = decompress(c8)
    _check_error_bound(t, c8, out8)
    err4 = (decompress(c4).float() - t.float()).abs().mean()
    assert (out8.float() - t.float()).abs().mean() < err4 / 4
    assert c8.data.nbytes == 2 * c4.data.nbytes


def test_nbytes_exact_formula():
    t = torch.randn(128, 256)  # float32, 128 KiB
    c = compress(t, CompressionConfig(group_dim=0))  # 2 groups x 256 columns
    assert c.data.nbytes == t.nbytes // 8  # 4 bits per 32-bit value
    assert c.nbytes == 128 * 256 // 2 + 2 * (2 * 256) * 4 == 20480
    # padded: 100 -> 2 groups of 64 along dim 1; mn+scale are fp16 here
    t = torch.randn(3, 100, 5).half()
    cfg = CompressionConfig(group_dim=1)
    c = compress(t, cfg)
    assert c.nbytes == 3 * 2 * 5 * (64 // 2) + 2 * (3 * 2 * 5) * 2 == 1080
    assert compressed_nbytes(t.shape, t.dtype, cfg) == c.nbytes


def test_packing_layout_low_nibble_first():
    t = torch.tensor([0.0, 1.0, 2.0, 3.0])
    c = compress(t, CompressionConfig(group_size=4))
    # mn=0, scale=3/15: codes 0, 5, 10, 15 -> bytes (0 | 5<<4), (10 | 15<<4)
    assert c.data.flatten().tolist() == [0x50, 0xFA]
    assert torch.allclose(decompress(c), t)


def test_constant_groups_are_exact():
    t = torch.full((70, 3), -2.5, dtype=torch.bfloat16)
    c = compress(t)
    assert torch.equal(decompress(c), t)
    assert (c.scale == 0).all()


def test_padding_does_not_widen_last_group():
    # last group holds one real value; padding must not pull its min/max toward 0
    t = torch.cat([torch.randn(64), torch.tensor([5.0])])
    c = compress(t)
    assert c.scale.flatten()[1] == 0 and c.mn.flatten()[1] == 5.0
    assert decompress(c)[64] == 5.0


def test_config_validation():
    with pytest.raises(ValueError):
        CompressionConfig(num_bits=3)
    with pytest.raises(ValueError):
        CompressionConfig(symmetric=True)
    with pytest.raises(ValueError):
        CompressionConfig(group_size=0)
    with pytest.raises(ValueError):
        CompressionConfig(group_size=63)  # odd group cannot be packed two per byte
    CompressionConfig(num_bits=8, group_size=63)
    with pytest.raises(ValueError):
        compress(torch.randn(4, 4), CompressionConfig(group_dim=2))
    with pytest.raises(TypeError):
        compress(torch.ones(4, dtype=torch.int32))


def test_to_copies_all_parts():
    c = compress(torch.randn(64, 8))
    d = c.to("cpu")
    assert d is not c and d.config == c.config and d.shape == c.shape
    assert torch.equal(decompress(d), decompress(c, device="cpu"))


@CUDA
@pytest.mark.parametrize("dtype", FLOATS)
def test_cuda_matches_cpu(dtype):
    t = torch.randn(5, 130, 3).to(dtype)
    cfg = CompressionConfig(group_dim=1)
    c_cpu, c_gpu = compress(t, cfg), compress(t.cuda(), cfg)
    assert c_gpu.device.type == "cuda"
    assert torch.equal(c_gpu.data.cpu(), c_cpu.data)
    out = decompress(c_cpu, device="cuda")
    assert out.device.type == "cuda"
    _check_error_bound(t, c_cpu, out.cpu())
    _check_error_bound(t, c_gpu.to("cpu"), decompress(c_gpu).cpu())


@st.composite
def _shapes(draw, max_numel: int = 8192):
    """1-4 dims, sides up to 130, at most `max_numel` elements (keeps the test fast)."""
    shape, budget = [], max_numel
    for _ in range(draw(st.integers(1, 4))):
        shape.append(draw(st.integers(1, max(1, min(130, budget)))))
        budget //= shape[-1]
    return shape


@settings(max_examples=60, deadline=None)
@given(
    shape=_shapes(),
    data=st.data(),
    dtype=st.sampled_from(FLOATS),
    num_bits=st.sampled_from([4, 8]),
    group_size=st.sampled_from([2, 4, 64]),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_random_shapes(shape, data, dtype, num_bits, group_size, seed):
    nd = len(shape)
    group_dim = data.draw(st.integers(-nd, nd - 1), label="group_dim")
    gen = torch.Generator().manual_seed(seed)
    t = (torch.randn(shape, generator=gen) * 10 ** data.draw(st.integers(-3, 3))).to(dtype)
    cfg = CompressionConfig(num_bits=num_bits, group_size=group_size, group_dim=group_dim)
    c = compress(t, cfg)
    out = decompress(c)
    assert out.shape == t.shape and out.dtype == dtype
    assert c.nbytes == compressed_nbytes(shape, dtype, cfg)
    groups = math.ceil(shape[group_dim] / group_size)
    assert c.mn.numel() == groups * math.prod(shape) // shape[group_dim]
    _check_error_bound(t, c, out)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape, dtype", [((2, 3, 2, 16, 64), torch.float16), ((2, 1, 3, 4, 48), torch.float32),
                                          ((2, 2, 1, 8, 128), torch.bfloat16)])
def test_a_span_decodes_at_once_as_block_by_block(bits, shape, dtype):
    """GroupCodec.decode_many (a span read in one request): every block exactly as decode gives it."""
    from flexgen_sparpr.storage.codec import kv_group_codec
    codec = kv_group_codec(shape, dtype, bits)
    blocks = [torch.randn(shape).to(dtype) for _ in range(5)]
    rows = torch.stack([codec.encode(b) for b in blocks])  # rows: [5, nbytes]
    many = codec.decode_many(rows)
    assert many.shape == (5, *shape) and many.dtype == dtype
    for i, b in enumerate(blocks):
        one = codec.decode(rows[i])
        assert torch.equal(many[i], one)
        assert float((one.float() - b.float()).abs().max()) < (0.3 if bits == 4 else 0.03) * float(b.float().abs().max())
