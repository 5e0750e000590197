"""The packed weight formats (models/packed.py): each product equals the one with the weights it
holds, a quantized checkpoint's values pack without changing a code, and only whole groups pack."""
from __future__ import annotations

import pytest
import torch

from flexgen_sparpr.models import packed as P
from flexgen_sparpr.models.layers import linear

# the bfloat16 and int8 kernels round activations and scales to bfloat16 (8 bits of mantissa): a
# product's relative error from that alone is a few 1e-3 (measured 2.8e-3 - 3.1e-3 on these shapes)
BF16_PRODUCT = 1e-2
# int4 multiplies float32 activations by its codes with float16 scales (11 bits): the scales' rounding
FP16_SCALES = 2e-3


def q4_grid(out: int, inn: int, seed: int = 0) -> torch.Tensor:
    """Weights that a Q4_1 checkpoint holds: per 32 inputs, min + code * scale, codes 0..15 with
    both ends used (as llama.cpp's quantizer makes them)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out, inn // 32, 32), generator=g).float()
    codes[..., 0], codes[..., 1] = 0, 15
    scale = torch.rand(out, inn // 32, 1, generator=g) * 0.01 + 1e-3
    low = -7.5 * scale + torch.randn(out, inn // 32, 1, generator=g) * 1e-3
    return (low + codes * scale).reshape(out, inn)


def q8_grid(out: int, inn: int, seed: int = 0) -> torch.Tensor:
    """Weights that a Q8_0 checkpoint holds: per 32 inputs, code * scale, codes -127..127."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (out, inn // 32, 32), generator=g).float()
    codes[..., 0] = 127
    scale = torch.rand(out, inn // 32, 1, generator=g) * 1e-3 + 1e-4
    return (codes * scale).reshape(out, inn)


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("fmt, head", [("bfloat16", False), ("int8", False), ("int4", False), ("int4", True)])
def test_each_format_multiplies_what_it_holds(fmt, head):
    w = q8_grid(64, 96) if head else q4_grid(64, 96)
    p = P.pack(w, fmt, head)
    assert isinstance(p, P.Packed) and p.shape == (64, 96)
    x = torch.randn(3, 5, 96)
    y = linear(x, p)  # y: [3, 5, 64]
    assert y.shape == (3, 5, 64) and y.dtype == torch.float32
    # int8 requantizes per row (a grid it does not share): its own step size bounds it
    assert rel(y, x @ w.T) < {"int8": 0.02, "int4": FP16_SCALES}.get(fmt, BF16_PRODUCT)


def test_a_q4_checkpoint_packs_without_changing_a_code():
    w = q4_grid(32, 64)
    codes, scale, low = P.int4_codes(w)
    back = (codes.float().reshape(32, 2, 32) * scale[..., None] + low[..., None]).reshape(32, 64)
    assert torch.allclose(back, w, atol=1e-6)
    assert P.on_grid(w, "int4") and not P.on_grid(torch.randn(32, 64), "int4")
    assert P.on_grid(q8_grid(32, 64), "int4", head=True) and not P.on_grid(w * 1.37 + 0.001, "int4", head=True)
    eye = torch.eye(64)
    # the kernel's own view of the weights (identity input): only the float16 rounding of the scales
    assert rel(P.pack_int4(w).matmul(eye).T, w) < FP16_SCALES


def test_bfloat16_grid_and_shapes_that_do_not_pack():
    w = torch.randn(32, 64).bfloat16().float()
    assert P.on_grid(w, "bfloat16") and not P.on_grid(w + 1e-4, "bfloat16")
    assert not P.packable("int4", (32, 48))  # not whole groups of 32 inputs
    assert P.packable("int4", (24, 64))  # any number of outputs
    odd = torch.randn(24, 48)
    assert P.pack(odd, "int4") is odd and P.pack(odd, "raw") is odd
    assert isinstance(P.pack(odd, "int8"), P.Int8Weight)


def test_a_packed_weight_rebuilds_from_its_tensors():
    p = P.pack(q8_grid(32, 64), "int4", head=True)
    back = P.unpack_like(p, {k: t.clone() for k, t in p.tensors().items()})
    x = torch.randn(2, 64)
    assert torch.equal(back.matmul(x), p.matmul(x))
    assert p.nbytes == sum(t.numel() * t.element_size() for t in p.tensors().values()) < 32 * 64 * 4 / 2


@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "int4"])
def test_rows_of_a_fused_weight_multiply_as_the_part_alone(fmt):
    """A fused q|k|v weight's q rows and k|v rows (engine/weights.py FUSED), cut out of the packed
    weight without copying its codes: the same products as the parts packed alone, at any cut."""
    w = q4_grid(192, 96)
    fused = P.pack(w, fmt)
    x = torch.randn(2, 96)
    for start, stop in ((0, 128), (128, 192), (1, 192)):
        cut = fused.rows(start, stop)
        assert cut is not None and cut.shape == (stop - start, 96)
        torch.testing.assert_close(linear(x, cut), linear(x, P.pack(w[start:stop], fmt)))
