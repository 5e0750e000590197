"""Shared kernels: partial attention + log-sum-exp merge, RoPE against HF, attention masks."""
from __future__ import annotations

import math

import pytest
import torch

from flexgen_sparpr.models import layers
from flexgen_sparpr.models.layers import (apply_rope, attention_with_lse, causal_attention,
                                          decode_attention, key_mask, merge_attention, rms_norm, rope_cos_sin)


def naive_attention(q, k, v, valid=None, causal=False):
    """float64 reference. q: [B, H, Sq, D]; k, v: [B, Hkv, T, D]; valid: [B, T] or [B, Hkv, T].
    Rows with no valid key give 0."""
    b, h, sq, d = q.shape
    g = h // k.shape[1]
    k = k.double().repeat_interleave(g, 1)
    v = v.double().repeat_interleave(g, 1)
    s = q.double() @ k.transpose(-1, -2) / math.sqrt(d)  # [B, H, Sq, T]
    keep = torch.ones_like(s, dtype=torch.bool)
    if valid is not None:
        vm = valid[:, None, None, :] if valid.dim() == 2 else valid.repeat_interleave(g, 1)[:, :, None, :]
        keep = keep & vm
    if causal:
        t = k.shape[2]
        keep = keep & torch.ones(sq, t, dtype=torch.bool).tril(t - sq)
    s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v


def rand_qkv(b, h, hkv, sq, t, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, sq, d, generator=g), torch.randn(b, hkv, t, d, generator=g),
            torch.randn(b, hkv, t, d, generator=g))


# --- partial attention + merge ------------------------------------------------------------
@pytest.fixture(params=["fused", "einsum"])
def kernel(request, monkeypatch):
    """A decode query on the CPU goes through torch's fused flash kernel; the einsum path (other
    devices, dtypes, several queries) is run for it too."""
    if request.param == "einsum":
        monkeypatch.setattr(layers, "_FLASH_CPU", None)
    elif layers._FLASH_CPU is None:
        pytest.skip("this torch build has no _scaled_dot_product_flash_attention_for_cpu")
    return request.param


@pytest.mark.parametrize("h, hkv", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("sq", [1, 3])
@pytest.mark.parametrize("mask_kind", ["none", "per_seq", "per_head"])
def test_lse_merge_over_a_split_equals_attention_over_the_union(h, hkv, sq, mask_kind, kernel):
    b, t, d = 2, 23, 16
    q, k, v = rand_qkv(b, h, hkv, sq, t, d)
    g = torch.Generator().manual_seed(1)
    valid = None
    if mask_kind == "per_seq":
        valid = torch.rand(b, t, generator=g) > 0.3
        valid[:, -1] = True
    elif mask_kind == "per_head":
        valid = torch.rand(b, hkv, t, generator=g) > 0.3
        valid[..., -1] = True
    whole = naive_attention(q, k, v, valid).float()

    out, lse = attention_with_lse(q, k, v, valid)
    assert out.dtype == torch.float32 and lse.shape == (b, h, sq)
    torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-5)

    cuts = [0, 5, 6, 17, t]  # uneven parts, one of a single key
    parts = []
    for lo, hi in zip(cuts, cuts[1:]):
        vm = None if valid is None else valid[..., lo:hi]
        parts.append(attention_with_lse(q, k[:, :, lo:hi], v[:, :, lo:hi], vm))
    torch.testing.assert_close(merge_attention(parts), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merge_attention(parts[::-1]), whole, rtol=1e-5, atol=1e-5)


def test_keys_read_in_place_from_a_larger_cache(kernel):
    """K and V as slices of a bigger [planes, B, Hkv, T, D] cache (a block where it lives): the same
    attention as on contiguous copies."""
    b, h, hkv, d = 2, 6, 2, 8
    q, k, v = rand_qkv(b, h, hkv, 1, 40, d)
    cache = torch.stack([k, v])  # cache: [2, B, Hkv, 40, D]
    valid = torch.rand(b, 16, generator=torch.Generator().manual_seed(3)) > 0.3
    got = attention_with_lse(q, cache[0, :, :, 8:24], cache[1, :, :, 8:24], valid)
    want = attention_with_lse(q, k[:, :, 8:24].contiguous(), v[:, :, 8:24].contiguous(), valid)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_lse_is_the_log_sum_exp_of_the_scaled_scores(kernel):
    q, k, v = rand_qkv(1, 2, 2, 1, 9, 8)
    valid = torch.tensor([[True] * 6 + [False] * 3])
    _, lse = attention_with_lse(q, k, v, valid)
    s = (q.double() @ k.double().transpose(-1, -2))[..., :6] / math.sqrt(8)
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), rtol=1e-6, atol=1e-6)


def test_merge_ignores_a_part_with_nothing_valid(kernel):
    b, h, hkv, d = 2, 4, 2, 8
    q, k, v = rand_qkv(b, h, hkv, 1, 12, d)
    valid = torch.ones(b, 12, dtype=torch.bool)
    valid[:, :4] = False  # the first part is wholly masked
    p0 = attention_with_lse(q, k[:, :, :4], v[:, :, :4], valid[:, :4])
    assert torch.isinf(p0[1]).all() and bool((p0[1] < 0).all())
    assert not torch.isnan(p0[0]).any()
    p1 = attention_with_lse(q, k[:, :, 4:], v[:, :, 4:], valid[:, 4:])
    merged = merge_attention([p0, p1])
    assert not torch.isnan(merged).any()
    torch.testing.assert_close(merged, naive_attention(q, k, v, valid).float(), rtol=1e-5, atol=1e-5)
    # a row with no valid key anywhere merges to zeros, not NaN
    none = merge_attention([p0, p0])
    assert bool((none == 0).all())


@pytest.mark.parametrize("kind", ["some masked", "a row with none", "all valid", "per KV head"])
def test_a_key_mask_made_once_attends_as_its_boolean_mask(kernel, kind):
    """key_mask's prepared form (made once for many steps) gives the attention of the mask it was
    made from, rows with no valid key included (lse -inf, out 0), whichever kernel runs."""
    b, h, hkv, d, t = 3, 6, 2, 8, 11
    q, k, v = rand_qkv(b, h, hkv, 1, t, d, seed=5)
    valid = torch.rand(b, hkv, t, generator=torch.Generator().manual_seed(4)) > 0.4
    valid = valid if kind == "per KV head" else valid[:, 0]
    if kind == "a row with none":
        valid[1] = False
    elif kind == "all valid":
        valid[:] = True
    mask = key_mask(valid)
    assert (mask.additive is None) == (kind == "all valid" or layers._FLASH_CPU is None)
    assert (mask.dead is not None) == (kind == "a row with none" and layers._FLASH_CPU is not None)
    out, lse = attention_with_lse(q, k, v, mask)
    want_out, want_lse = attention_with_lse(q, k, v, valid)
    torch.testing.assert_close(out, want_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, naive_attention(q, k, v, valid).float(), rtol=1e-5, atol=1e-5)
    assert bool(torch.isinf(lse[1]).all()) == (kind == "a row with none")


def test_masked_entries_do_not_leak_even_when_huge(kernel):
    q, k, v = rand_qkv(1, 2, 1, 1, 10, 8)
    k[:, :, 3] = 1e4  # a masked key with an enormous score
    v[:, :, 3] = 1e6
    valid = torch.ones(1, 10, dtype=torch.bool)
    valid[0, 3] = False
    out, _ = attention_with_lse(q, k, v, valid)
    torch.testing.assert_close(out, naive_attention(q, k, v, valid).float(), rtol=1e-5, atol=1e-5)
    parts = [attention_with_lse(q, k[:, :, :5], v[:, :, :5], valid[:, :5]),
             attention_with_lse(q, k[:, :, 5:], v[:, :, 5:], valid[:, 5:])]
    torch.testing.assert_close(merge_attention(parts), out, rtol=1e-5, atol=1e-5)


# --- the engine's attention kernels against the reference -----------------------------------
@pytest.mark.parametrize("h, hkv", [(4, 4), (4, 2)])
def test_causal_attention_with_left_padding(h, hkv):
    b, s, d = 3, 7, 8
    q, k, v = rand_qkv(b, h, hkv, s, s, d)
    pads = torch.tensor([0, 2, 6])
    valid = torch.arange(s)[None, :] >= pads[:, None]
    out = causal_attention(q, k, v, valid)
    ref = naive_attention(q, k, v, valid, causal=True).float()
    real = valid[:, None, :, None].expand_as(out)  # padded query rows are don't-care
    torch.testing.assert_close(out[real], ref[real], rtol=1e-5, atol=1e-5)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(causal_attention(q, k, v, None),
                               naive_attention(q, k, v, None, causal=True).float(), rtol=1e-5, atol=1e-5)


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Every SDPA call's (attn_mask given, enable_gqa) pair. CUDA's fused kernels take a mask or
    enable_gqa, not both: with both SDPA falls back to the math kernel's [B, H, S, S] float32
    scores (34 GB for a 7B Llama at batch 4 and 8k tokens), so no call may ask for both."""
    import torch.nn.functional as F
    calls, real = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, *args, enable_gqa=False, **kw):
        calls.append((attn_mask is not None, enable_gqa))
        return real(q, k, v, attn_mask, *args, enable_gqa=enable_gqa, **kw)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


@pytest.mark.parametrize("h, hkv", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("pads", [[0, 2, 6, 2], [3, 3, 3, 3], [0, 0, 0, 1]])
def test_padded_gqa_prefill_takes_no_mask_and_equals_the_masked_form(h, hkv, pads, sdpa_calls):
    b, s, d = len(pads), 9, 8
    q, k, v = rand_qkv(b, h, hkv, s, s, d, seed=sum(pads))
    valid = torch.arange(s)[None, :] >= torch.tensor(pads)[:, None]
    out = causal_attention(q, k, v, valid)
    assert sdpa_calls and not any(mask for mask, _ in sdpa_calls)  # left padding: plain causal SDPA
    ref = naive_attention(q, k, v, valid, causal=True).float()
    real = valid[:, None, :, None].expand_as(out)
    torch.testing.assert_close(out[real], ref[real], rtol=1e-5, atol=1e-5)
    # a padded query attends only to itself: its output is its own value
    own = v.repeat_interleave(h // hkv, 1)
    torch.testing.assert_close(out[~real], own[~real], rtol=0, atol=0)


def test_other_masks_expand_kv_heads_instead_of_enable_gqa(sdpa_calls):
    """A validity pattern that is not left padding takes the masked path, with K/V heads
    expanded (mask, no enable_gqa); the DKV block-sparse prefill likewise."""
    from flexgen_sparpr.kv.dkv.prefill import block_sparse_prefill
    b, h, hkv, s, d = 2, 4, 2, 24, 8
    q, k, v = rand_qkv(b, h, hkv, s, s, d)
    valid = torch.ones(b, s, dtype=torch.bool)
    valid[1, 5] = False  # a hole, not a left pad
    out = causal_attention(q, k, v, valid)
    ref = naive_attention(q, k, v, valid, causal=True).float()
    real = valid[:, None, :, None].expand_as(out)
    torch.testing.assert_close(out[real], ref[real], rtol=1e-5, atol=1e-5)
    block_sparse_prefill(q, k, v, torch.arange(s)[None, :] >= torch.tensor([[0], [3]]), bs=4, topk=1)
    assert any(mask for mask, _ in sdpa_calls) and not any(mask and gqa for mask, gqa in sdpa_calls)


@pytest.mark.parametrize("per_head", [False, True])
def test_decode_attention_masks(per_head):
    b, h, hkv, t, d = 2, 4, 2, 11, 8
    q, k, v = rand_qkv(b, h, hkv, 1, t, d, seed=3)
    g = torch.Generator().manual_seed(4)
    valid = torch.rand(b, hkv, t, generator=g) > 0.4 if per_head else torch.rand(b, t, generator=g) > 0.4
    valid[..., -1] = True
    torch.testing.assert_close(decode_attention(q, k, v, valid), naive_attention(q, k, v, valid).float(),
                               rtol=1e-5, atol=1e-5)


# --- RoPE and RMSNorm against transformers --------------------------------------------------
@pytest.mark.parametrize("head_dim, theta", [(16, 10000.0), (64, 100000.0), (128, 500000.0)])
def test_rope_matches_hf_llama(head_dim, theta):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    heads = 2
    cfg = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=1,
                      head_dim=head_dim, rope_theta=theta, max_position_embeddings=8192)
    assert cfg.rope_parameters["rope_theta"] == theta
    hf_rope = LlamaRotaryEmbedding(cfg)
    g = torch.Generator().manual_seed(0)
    b, s = 3, 9
    q = torch.randn(b, heads, s, head_dim, generator=g)
    k = torch.randn(b, 1, s, head_dim, generator=g)
    pos = torch.randint(0, 8000, (b, s), generator=g)
    pos[0] = torch.arange(s)  # the ordinary case, position 0 included
    cos_hf, sin_hf = hf_rope(q, pos)  # [B, S, D]
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos_hf, sin_hf)
    cos, sin = rope_cos_sin(pos, head_dim, theta, torch.float32)
    assert cos.shape == (b, 1, s, head_dim)
    torch.testing.assert_close(cos[:, 0], cos_hf, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin[:, 0], sin_hf, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(apply_rope(q, cos, sin), q_hf, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(apply_rope(k, cos, sin), k_hf, rtol=1e-5, atol=1e-5)


def test_rope_is_relative():
    """<rope(q, m), rope(k, n)> depends on m - n only."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, 32, generator=g), torch.randn(1, 1, 1, 32, generator=g)

    def dot(m, n):
        cq, sq = rope_cos_sin(torch.tensor([[m]]), 32, 10000.0, torch.float64)
        ck, sk = rope_cos_sin(torch.tensor([[n]]), 32, 10000.0, torch.float64)
        return (apply_rope(q.double(), cq, sq) * apply_rope(k.double(), ck, sk)).sum()

    # angles are float32 (as in HF), so equal only to ~1e-6 relative
    torch.testing.assert_close(dot(7, 3), dot(104, 100), rtol=1e-5, atol=1e-5)


def test_rms_norm_matches_hf():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 32, generator=g) * 3
    norm = LlamaRMSNorm(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32, generator=g))
        ref = norm(x)
    torch.testing.assert_close(rms_norm(x, norm.weight.detach(), 1e-6), ref, rtol=1e-6, atol=1e-6)
