"""The compiled CPU decode kernel (models/cpu_kernel.py) against a float64 reference, and the
dispatch that sends decode attention to it."""
import math
import shutil
import subprocess
import sys

import pytest
import torch

from flexgen_sparpr.models import cpu_kernel, layers
from flexgen_sparpr.models.layers import attention_with_lse, decode_attention

# a machine that can build it must: a skip here would hide a broken build
BUILDABLE = cpu_kernel.has_simd() and shutil.which("g++") is not None and shutil.which("ninja") is not None


def reference(q, k, v, valid):
    """float64 attention of one query per head, with its log-sum-exp (0 and -inf where nothing is valid).
    q: [B, H, 1, D]; k, v: [B, Hkv, T, D]; valid: [B, T] or [B, Hkv, T] or None."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = q.double() @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1])  # s: [B, H, 1, T]
    if valid is not None:
        m = valid[:, None, None, :] if valid.dim() == 2 else valid.repeat_interleave(g, 1)[:, :, None, :]
        s = s.masked_fill(~m, float("-inf"))
    lse = torch.logsumexp(s, -1)  # lse: [B, H, 1]
    return (torch.softmax(s, -1).nan_to_num(0.0) @ vv), lse


def test_kernel_builds_where_it_can():
    if not BUILDABLE:
        pytest.skip("no AVX-512 or AVX2 CPU, g++ or ninja here: decode attention stays on torch's kernel")
    assert cpu_kernel.kernel() is not None, cpu_kernel.why_not()


needs_kernel = pytest.mark.skipif(not BUILDABLE, reason="no AVX-512 or AVX2 CPU, g++ or ninja: the kernel is not built")


@needs_kernel
def test_a_build_killed_midway_leaves_no_lock_that_hangs_the_next():
    # torch's loader locks a build by creating a file; a build killed by a timeout or a signal leaves
    # it behind, and torch's own loader then waits on it forever (what hung a CI dry run)
    assert cpu_kernel.kernel() is not None, cpu_kernel.why_not()
    folder = cpu_kernel.build_folder()
    (folder / "lock").touch()
    probe = "from flexgen_sparpr.models import cpu_kernel as c; print(c.kernel() is not None, c.why_not())"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert r.stdout.split()[0] == "True", r.stdout + r.stderr
    assert not (folder / "lock").exists()


def test_each_torch_install_builds_its_own(monkeypatch, tmp_path):
    # a second venv's torch (other headers) gets its own folder, so two venvs never rebuild in turn
    here = cpu_kernel.build_name()
    monkeypatch.setattr(cpu_kernel.torch, "__file__", str(tmp_path / "torch" / "__init__.py"))
    assert cpu_kernel.build_name() != here


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h, hkv, d", [(9, 3, 64), (4, 4, 128), (16, 2, 64)])
@pytest.mark.parametrize("mask_kind", ["none", "per_seq", "per_head"])
@pytest.mark.parametrize("t", [1, 511, 1300])
def test_kernel_matches_reference(dtype, h, hkv, d, mask_kind, t):
    b = 2
    g = torch.Generator().manual_seed(t + h)
    q = torch.randn(b, h, 1, d, generator=g)
    arena = torch.randn(2, b, hkv, t + 37, d, generator=g).to(dtype)  # a narrowed arena, as the cache is read
    k, v = arena[0, :, :, :t], arena[1, :, :, :t]
    valid = None
    if mask_kind != "none":
        shape = (b, t) if mask_kind == "per_seq" else (b, hkv, t)
        valid = torch.rand(shape, generator=g) > 0.3
        valid[..., -1] = True
    assert cpu_kernel.usable(q, k, v)
    out, lse = layers.kernel_decode(q, k, v, valid)
    ref, ref_lse = reference(q, k.float(), v.float(), valid)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-4, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_a_bfloat16_query_is_read_and_its_output_rounded_in_the_kernel(kv_dtype):
    """keep_dtype (decode_attention's call): a bfloat16 q goes in as it is and its output comes back in
    bfloat16, equal to the float32 call's output rounded once (no conversion calls around the kernel)."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 9, 1, 64, generator=g).bfloat16()
    k, v = (torch.randn(2, 3, 900, 64, generator=g).to(kv_dtype) for _ in range(2))
    valid = torch.rand(2, 900, generator=g) > 0.2
    out, lse = layers.kernel_decode(q, k, v, valid, keep_dtype=True)
    wide, wide_lse = layers.kernel_decode(q, k, v, valid)
    assert out.dtype == torch.bfloat16 and wide.dtype == lse.dtype == torch.float32
    assert torch.equal(out, wide.bfloat16()) and torch.equal(lse, wide_lse)
    assert decode_attention(q, k, v, valid).dtype == torch.bfloat16


@needs_kernel
def test_rows_with_no_valid_key_give_zero_and_minus_inf():
    q, k, v = torch.randn(2, 6, 1, 64), torch.randn(2, 3, 700, 64), torch.randn(2, 3, 700, 64)
    valid = torch.ones(2, 3, 700, dtype=torch.bool)
    valid[1, 2] = False  # sequence 1, KV head 2: nothing to attend
    out, lse = attention_with_lse(q, k, v, valid)
    ref, ref_lse = reference(q, k, v, valid)
    assert torch.all(out[1, 4:] == 0) and torch.all(lse[1, 4:] == float("-inf"))
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse[0].double(), ref_lse[0], rtol=1e-4, atol=1e-5)


@needs_kernel
def test_decode_attention_dispatch(monkeypatch):
    """SmolLM2's heads take the kernel; a head size it was not built for, or the switch off, take torch's."""
    calls = []
    real = layers.kernel_decode
    monkeypatch.setattr(layers, "kernel_decode", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = torch.randn(1, 9, 1, 64), torch.randn(1, 3, 300, 64), torch.randn(1, 3, 300, 64)
    fused = decode_attention(q, k, v, None)
    assert calls == [1]
    monkeypatch.setitem(cpu_kernel._state, "module", None)
    torch.testing.assert_close(decode_attention(q, k, v, None), fused, rtol=1e-5, atol=1e-5)
    q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 30, 16), torch.randn(1, 2, 30, 16)
    monkeypatch.undo()
    monkeypatch.setattr(layers, "kernel_decode", lambda *a, **kw: calls.append(2) or real(*a, **kw))
    decode_attention(q, k, v, None)
    assert calls == [1]


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv("FLEXGEN_SPARPR_CPU_KERNEL", "0")
    monkeypatch.setattr(cpu_kernel, "_state", {})
    assert cpu_kernel.kernel() is None and "FLEXGEN_SPARPR_CPU_KERNEL=0" in cpu_kernel.why_not()


@needs_kernel
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("per_head_mask", [False, True])
def test_rows_read_in_place_equal_a_gather(shared, per_head_mask):
    """rows: the keys attended are rows of k and v where they lie; the same as gathering them first."""
    b, h, hkv, t, d = 3, 9, 3, 900, 64
    g = torch.Generator().manual_seed(7)
    q = torch.randn(b, h, 1, d, generator=g)
    arena = torch.randn(2, b, hkv, t + 50, d, generator=g)
    k, v = arena[0, :, :, :t], arena[1, :, :, :t]
    n = 300
    rows = torch.stack([torch.randperm(t, generator=g)[:n].sort().values for _ in range(1 if shared else b)])
    valid = torch.rand((b, hkv, n) if per_head_mask else (b, n), generator=g) > 0.2
    idx = rows.expand(b, n)
    kk = torch.stack([k[i, :, idx[i]] for i in range(b)])  # kk: [B, Hkv, n, D], gathered
    vv = torch.stack([v[i, :, idx[i]] for i in range(b)])
    out = decode_attention(q, k, v, valid, rows)
    ref, _ = reference(q, kk, vv, valid)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    with pytest.raises(RuntimeError, match="within"):
        decode_attention(q, k, v, valid, rows.clone().fill_(t))


@needs_kernel
@pytest.mark.parametrize("bf16_q", [False, True])
def test_keys_in_parts_are_one_softmax_over_them_all(bf16_q):
    """decode_attention_parts: keys in three places of three dtypes, one read by rows, masks of both
    kinds and a part with nothing valid for one head, attend as one softmax over their concatenation."""
    b, h, hkv, d = 2, 6, 3, 64
    g = torch.Generator().manual_seed(3)
    q = torch.randn(b, h, 1, d, generator=g)
    q = q.bfloat16() if bf16_q else q
    a = torch.randn(2, b, hkv, 700, d, generator=g)  # a float32 arena, 600 of its rows read in place
    rows = torch.randperm(700, generator=g)[:600].sort().values[None]  # rows: [1, 600]
    bk, bv = torch.randn(2, b, hkv, 1100, d, generator=g).bfloat16().unbind(0)
    hk, hv = torch.randn(2, b, hkv, 5, d, generator=g).half().unbind(0)
    m1 = torch.rand(b, 600, generator=g) > 0.2
    m3 = torch.rand(b, hkv, 5, generator=g) > 0.3
    m3[0, 1] = False  # sequence 0, KV head 1: nothing valid in this part
    parts = [(a[0], a[1], m1, rows), (bk, bv, None, None), (hk, hv, m3, None)]
    got = layers.kernel_decode_parts(q, parts)
    kk = torch.cat([a[0][:, :, rows[0]], bk.float(), hk.float()], 2)  # kk: [B, Hkv, 1705, D]
    vv = torch.cat([a[1][:, :, rows[0]], bv.float(), hv.float()], 2)
    valid = torch.cat([m1[:, None].expand(b, hkv, 600), torch.ones(b, hkv, 1100, dtype=torch.bool), m3], 2)
    ref, _ = reference(q.float(), kk, vv, valid)
    assert got.dtype == q.dtype
    torch.testing.assert_close(got.double(), ref, rtol=1e-2 if bf16_q else 1e-4, atol=1e-2 if bf16_q else 1e-5)
    one = layers.kernel_decode_parts(q, parts[1:2])  # one part: decode_attention's own call
    torch.testing.assert_close(one, decode_attention(q, bk, bv, None), rtol=0, atol=0)


@needs_kernel
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("g, r, bs, nb", [(3, 32, 16, 40), (2, 2, 4, 9), (8, 12, 8, 33)])
def test_lowrank_scores_match_the_float_path(padded, g, r, bs, nb):
    """SparPR's block scores by the compiled kernel equal the float torch path's (kv/policies/sparpr_lowrank.py)."""
    from flexgen_sparpr.kv.policies.sparpr_lowrank import (compiled_block_scores, encode, fit_basis, kernel_scores,
                                                           lowrank_block_scores)
    b, hkv, d = 2, 3, 64
    gen = torch.Generator().manual_seed(g + r)
    t = nb * bs
    keys = torch.randn(b, hkv, t, d, generator=gen)
    basis = fit_basis(keys, torch.ones(b, t, dtype=torch.bool), r)
    store = torch.zeros(b, hkv, r // 2, t + 5 * bs, dtype=torch.uint8)  # the summaries' buffer, narrowed as the policy reads it
    store[..., :t] = encode(keys, basis).mT
    codes = store[..., :t]
    q = torch.randn(b, hkv * g, 1, d, generator=gen)
    bias = None
    if padded:
        bias = torch.zeros(b, t)
        bias[1, :bs + 3] = float("-inf")  # sequence 1: one block and 3 tokens of left padding
    live = None if bias is None else (bias.view(b, nb, bs) == 0).any(-1)
    assert kernel_scores(q, codes, "softmax") and not kernel_scores(q, codes, "sum")
    want = lowrank_block_scores(q, codes, basis, bs, "softmax", bias, live)
    got = lowrank_block_scores(q, codes, basis, bs, "softmax", bias, live, compiled=True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    whole = store.view(b, hkv, r // 2, nb + 5, bs)  # the table's layout, read as it lies (SparPR.block_scores)
    assert kernel_scores(q, whole, "softmax")
    torch.testing.assert_close(compiled_block_scores(q, whole, nb, bs, basis, bias, live), want, rtol=1e-4, atol=1e-6)
