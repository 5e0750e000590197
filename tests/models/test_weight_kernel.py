"""The compiled group-quantized and bfloat16 products (weight_kernel.cpp, bf16_kernel.cpp) and a decode step's one-call ops
(glue_kernel.cpp) against float64 references and torch's own ops, and the fallbacks where the kernel
does not serve (a prefill's rows, no kernel). The products round each group of 32 activations to
8-bit codes (as llama.cpp does): the reference rounds them alike (packed.quantized_rows)."""
import shutil

import pytest
import torch
import torch.nn.functional as F

from flexgen_sparpr.models import cpu_kernel, group_codes, layers, packed as P

BUILDABLE = cpu_kernel.has_simd() and shutil.which("g++") is not None and shutil.which("ninja") is not None
pytestmark = pytest.mark.skipif(not BUILDABLE, reason="no AVX-512 or AVX2 CPU, g++ or ninja: the kernel is not built")


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# out rows not a multiple of the rows a call takes together; 5 groups (fewer than the 16 whose scales
# widen together) and 37 (two chunks and a tail); tails of 2 (SmolLM2's 576 inputs), 11 and 12 (AVX2's
# second half of a chunk partly filled, odd and even)
@pytest.mark.parametrize("out, groups", [(37, 5), (64, 37), (3, 18), (5, 27), (9, 12)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
def test_packed_products_equal_their_dequantized_weights(out, groups, rows):
    gen = torch.Generator().manual_seed(out * 100 + groups + rows)
    w = torch.randn(out, 32 * groups, generator=gen)
    x = torch.randn(rows, 32 * groups, generator=gen)
    for p in (P.pack_int4(w), P.pack_int8g(w)):
        codes, s = group_codes.quantized_rows(x, wide=isinstance(p, P.Int8gWeight))  # codes: [rows, groups, 32]
        xq = (codes.double() * s.double()[..., None]).reshape(x.shape)  # the activations as the kernel rounds them
        want = xq @ p.dequantized(torch.float64).T  # what the codes and float16 scales hold
        got = p.matmul(x)
        assert got.dtype == torch.float32 and got.shape == (rows, out)
        # float32 sums only (the head's 16-bit integer sums pass 2^24: float32 rounds them on conversion)
        assert rel(got, want) < (1e-6 if isinstance(p, P.Int4Weight) else 1e-5)
        # rounding the activations costs under 1 % of the product (8 bits), 1e-4 (16 bits: the head's)
        assert rel(got, x.double() @ p.dequantized(torch.float64).T) < (0.01 if isinstance(p, P.Int4Weight) else 1e-4)
        # the packed weight is the float one up to its codes' step (and no bfloat16 rounding)
        assert rel(got, x.double() @ w.double().T) < (0.12 if isinstance(p, P.Int4Weight) else 0.015)


def test_the_kernels_rounding_of_activations_is_the_references():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 32 * 37, generator=gen) * torch.rand(3, 32 * 37, generator=gen).pow(4) * 10
    x[1, :32] = 0  # an all-zero group: scale 0, codes 0
    for wide, top in ((False, 127), (True, 32767)):
        codes, s = cpu_kernel.kernel().quantize_rows(x.contiguous(), wide)
        want_codes, want_s = group_codes.quantized_rows(x, wide)
        # -ffast-math: a division may round differently, and a code land one step off
        assert float((codes.reshape(want_codes.shape).float() - want_codes).abs().max()) <= (0 if top == 127 else 1)
        torch.testing.assert_close(s, want_s, rtol=1e-6, atol=0)
        assert float(codes.abs().max()) == top and float(s[1, 0]) == 0


def test_the_kernel_layout_round_trips():
    gen = torch.Generator().manual_seed(6)
    for groups in (1, 16, 18, 37):
        c4 = torch.randint(0, 16, (5, 32 * groups), generator=gen)
        c8 = torch.randint(0, 256, (5, 32 * groups), generator=gen)
        assert torch.equal(group_codes.unchunk_codes(group_codes.chunk_codes(c4, 4), 32 * groups, 4).reshape(c4.shape), c4.to(torch.uint8))
        assert torch.equal(group_codes.unchunk_codes(group_codes.chunk_codes(c8, 8), 32 * groups, 8).reshape(c8.shape), c8.to(torch.uint8))


def test_longer_inputs_widen_the_weight_once_and_agree():
    gen = torch.Generator().manual_seed(1)
    w, x = torch.randn(48, 96, generator=gen), torch.randn(20, 96, generator=gen)
    for p in (P.pack_int4(w), P.pack_int8g(w)):
        assert P._kernel(x) is None and P._kernel(x[:P.MAX_ROWS]) is not None
        whole = p.matmul(x)  # 20 rows: F.linear over the widened weight
        by_rows = torch.cat([p.matmul(x[i:i + 4]) for i in range(0, 20, 4)])  # the kernel
        assert rel(by_rows, whole) < 0.01  # the kernel rounds the activations to 8 bits


def test_a_checkpoints_float16_scales_are_kept_exactly():
    """A Q4_1 group whose scale and minimum are float16 values (as GGUF stores them) comes back exact."""
    gen = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (16, 2, 32), generator=gen).float()
    codes[..., 0], codes[..., 1] = 0, 15
    scale = (torch.rand(16, 2, 1, generator=gen) * 0.01 + 1e-3).half().float()
    low = (-7.5 * scale).half().float()
    w = (low + codes * scale).reshape(16, 64)
    assert torch.equal(P.pack_int4(w).dequantized(torch.float32), w)


def test_glue_ops_equal_torchs():
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 3, 576, generator=gen), torch.randn(576, generator=gen)
    torch.testing.assert_close(layers.rms_norm(x, w, 1e-5), F.rms_norm(x, (576,), w, 1e-5), rtol=1e-5, atol=1e-5)
    # q as the heads of a fused product's columns: strided, as split_heads leaves it
    q = layers.split_heads(torch.randn(2, 1, 3 * 9 * 64, generator=gen)[..., :9 * 64], 9)  # q: [2, 9, 1, 64]
    cos, sin = layers.rope_cos_sin(torch.tensor([[5], [700]]), 64, 10000.0, torch.float32)
    half = torch.cat([-q[..., 32:], q[..., :32]], dim=-1)
    torch.testing.assert_close(layers.apply_rope(q, cos, sin), q * cos + half * sin, rtol=1e-5, atol=1e-6)
    gu = torch.randn(2, 1, 2 * 1536, generator=gen)
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(layers.silu_mul(gu), F.silu(gate) * up, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("out, inputs", [(37, 100), (64, 576), (5, 16)])
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
def test_bfloat16_products_are_exact_up_to_float32_sums(out, inputs, rows):
    """bf16_kernel.cpp widens each bfloat16 weight: the product is the float64 one of the same values;
    a bfloat16 input gives a bfloat16 output (one rounding)."""
    gen = torch.Generator().manual_seed(out + inputs + rows)
    w = torch.randn(out, inputs, generator=gen).bfloat16()
    x = torch.randn(rows, inputs, generator=gen)
    p = P.pack(w.float(), "bfloat16")
    assert P.bf16_kernel(x) is not None and P.bf16_kernel(torch.randn(9, inputs)) is None
    got = p.matmul(x)
    assert got.dtype == torch.float32 and rel(got, x.double() @ w.double().T) < 1e-6
    xb = x.bfloat16()
    got_b = cpu_kernel.kernel().bf16_matmul(xb, w)
    want_b = (xb.double() @ w.double().T).bfloat16()
    assert got_b.dtype == torch.bfloat16 and rel(got_b, want_b) < 4e-3  # one bfloat16 step at most
    # a bfloat16 run's decode row through models/layers.linear takes the kernel, alike
    torch.testing.assert_close(layers.linear(xb[:1], w), got_b[:1], rtol=0, atol=0)


@pytest.mark.parametrize("out, inputs", [(37, 100), (64, 576), (5, 16), (130, 7)])
@pytest.mark.parametrize("rows", [2, 3, 4, 5, 8])
def test_float32_products_of_a_batch_equal_float64(out, inputs, rows):
    """bf16_kernel.cpp f32_matmul: 2-8 float32 rows times float32 weights, each weight row read once for
    all rows; the product is the float64 one up to float32 sums, with a bias, through models/layers.linear
    (a batch's decode rows), shaped as the caller's [B, 1, in]. One row and nine stay on torch."""
    gen = torch.Generator().manual_seed(out + inputs + rows)
    w, b = torch.randn(out, inputs, generator=gen), torch.randn(out, generator=gen)
    x = torch.randn(rows, 1, inputs, generator=gen)
    assert P.f32_kernel(x.view(rows, -1)) is not None
    assert P.f32_kernel(torch.randn(1, inputs)) is None and P.f32_kernel(torch.randn(9, inputs)) is None
    assert P.f32_kernel(torch.randn(rows, inputs).bfloat16()) is None
    got = cpu_kernel.kernel().f32_matmul(x.view(rows, -1), w)
    assert got.dtype == torch.float32 and rel(got, x.view(rows, -1).double() @ w.double().T) < 1e-6
    y = layers.linear(x, w, b)
    assert y.shape == (rows, 1, out)
    torch.testing.assert_close(y, (got + b).view(rows, 1, out), rtol=0, atol=0)  # the kernel served it


def test_glue_ops_in_bfloat16_round_torchs_float32_values_once():
    """The bfloat16 glue ops compute in float32 and round each output once: within one bfloat16 step of
    torch's ops on the same values (which round after each op)."""
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(2, 3, 576, generator=gen).bfloat16(), torch.randn(576, generator=gen).bfloat16()
    xf = x.float()
    want = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()  # HF's bfloat16 order
    got = layers.rms_norm(x, w, 1e-5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-3)
    q = layers.split_heads(torch.randn(2, 1, 3 * 9 * 64, generator=gen)[..., :9 * 64], 9).bfloat16()
    cos, sin = layers.rope_cos_sin(torch.tensor([[5], [700]]), 64, 10000.0, torch.bfloat16)
    qf, half = q.float(), torch.cat([-q[..., 32:], q[..., :32]], dim=-1).float()
    got = layers.apply_rope(q, cos, sin)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), (qf * cos.float() + half * sin.float()).bfloat16().float(), rtol=8e-3, atol=1e-2)
    gu = torch.randn(2, 1, 2 * 1536, generator=gen).bfloat16()
    gate, up = gu.float().chunk(2, dim=-1)
    got = layers.silu_mul(gu)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), (F.silu(gate) * up).bfloat16().float(), rtol=8e-3, atol=1e-3)


@pytest.mark.parametrize("dtype, rows", [(torch.float32, 1), (torch.float32, 3), (torch.bfloat16, 1), (torch.bfloat16, 8)])
def test_fused_mlp_equals_the_layer_by_layer_mlp(dtype, rows):
    """models/fused.py q4_mlp (one compiled call) gives exactly what models/llama.py's MLP gives
    calling its four kernels one by one, and steps aside (None) where the kernel does not serve."""
    from flexgen_sparpr.models.fused import q4_mlp
    gen = torch.Generator().manual_seed(rows)
    h, f = 96, 160
    gu, down = P.pack_int4(torch.randn(2 * f, h, generator=gen)), P.pack_int4(torch.randn(h, f, generator=gen))
    ln = (1 + 0.1 * torch.randn(h, generator=gen)).to(dtype)
    x = torch.randn(rows, 1, h, generator=gen).to(dtype)
    act = layers.silu_mul(layers.linear(layers.rms_norm(x, ln, 1e-5), gu))
    want = x + layers.linear(act, down)  # want: [rows, 1, h]
    got = q4_mlp(x, ln, 1e-5, gu, down)
    assert got.shape == want.shape and got.dtype == dtype and torch.equal(got, want)
    assert q4_mlp(torch.randn(P.MAX_ROWS + 1, h).to(dtype), ln, 1e-5, gu, down) is None  # a prefill's rows
    assert q4_mlp(x, ln, 1e-5, P.pack(torch.randn(2 * f, h), "bfloat16"), down) is None  # not 4-bit
    assert q4_mlp(x, ln.double(), 1e-5, gu, down) is None  # norm weight of another dtype


@pytest.mark.parametrize("dtype, batch", [(torch.float32, 1), (torch.float32, 3), (torch.bfloat16, 2)])
def test_fused_attention_input_and_output_equal_the_layer_by_layer_ones(dtype, batch):
    """models/fused.py q4_qkv (RMSNorm, the q|k|v product, heads, RoPE) and q4_out (output product
    and residual) give exactly what the layer-by-layer calls give, and step aside where they do not serve."""
    from flexgen_sparpr.models.fused import q4_out, q4_qkv
    gen = torch.Generator().manual_seed(batch)
    hidden, heads, kv_heads, d = 128, 4, 2, 32
    qkv = P.pack_int4(torch.randn((heads + 2 * kv_heads) * d, hidden, generator=gen))
    out = P.pack_int4(torch.randn(hidden, heads * d, generator=gen))
    ln = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    x = torch.randn(batch, 1, hidden, generator=gen).to(dtype)
    cos, sin = layers.rope_cos_sin(torch.arange(batch)[:, None] + 7, d, 10000.0, dtype)  # [B, 1, 1, D] each
    h = layers.rms_norm(x, ln, 1e-5)
    q, k, v = layers.linear(h, qkv).split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    want = (h, layers.apply_rope(layers.split_heads(q, heads), cos, sin),
            layers.apply_rope(layers.split_heads(k, kv_heads), cos, sin), layers.split_heads(v, kv_heads))
    got = q4_qkv(x, ln, 1e-5, qkv, cos, sin, heads, kv_heads)
    assert len(got) == 4 and all(g.shape == w.shape and g.dtype == dtype and torch.equal(g, w) for g, w in zip(got, want))
    o = torch.randn(batch, heads, 1, d, generator=gen).to(dtype)
    assert torch.equal(q4_out(x, o, out), x + layers.linear(layers.merge_heads(o), out))
    assert q4_qkv(x, ln, 1e-5, P.pack(torch.randn(qkv.shape[0], hidden), "bfloat16"), cos, sin, heads, kv_heads) is None
    assert q4_qkv(x, ln, 1e-5, qkv, cos.double(), sin.double(), heads, kv_heads) is None
    assert q4_out(torch.randn(P.MAX_ROWS + 1, 1, hidden).to(dtype), o, out) is None


@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_put_rows_writes_what_copy_writes(dst_dtype, src_dtype):
    """glue_kernel.cpp put_rows (a decode step's append, kv/block_table.py) writes each plane's rows
    where a sliced copy_ does, rounded as copy_ rounds, from strided planes into a strided buffer, and
    declines (False, nothing written) a dtype it does not take."""
    gen = torch.Generator().manual_seed(7)
    dst = torch.randn(2, 2, 3, 32, 64, generator=gen).to(dst_dtype)[:, :, :, 8:24]  # a block's view of an arena
    k = torch.randn(2, 3, 2, 64, generator=gen).to(src_dtype)
    v = torch.randn(2, 3, 64, 6, generator=gen).to(src_dtype).transpose(2, 3)[:, :, 1:3]  # D strided
    want = dst.clone()
    want[0, :, :, 5:7].copy_(k)
    want[1, :, :, 5:7].copy_(v)
    assert cpu_kernel.kernel().put_rows(dst, 5, [k, v]) and torch.equal(dst, want)
    before = dst.clone()
    assert not cpu_kernel.kernel().put_rows(dst, 0, [k.double(), v.double()]) and torch.equal(dst, before)
