"""DKV's decode attention in low-rank space (kv/dkv/attention.py): scores and attention against
decompressed blocks, the routing mass, residual rows, and partial attentions merged by log-sum-exp."""
from __future__ import annotations

import pytest
import torch

from flexgen_sparpr.kv.dkv.attention import lowrank_blocks, lowrank_merge, residual_kv
from flexgen_sparpr.kv.dkv.codec import DKVCodec
from flexgen_sparpr.kv.policies.dkv import DKV
from flexgen_sparpr.models.layers import attention_with_lse, merge_attention
from tests.kv.dkv_blocks import SHAPE, lowrank_kv


@pytest.mark.parametrize("routed", [True, False])
def test_lowrank_attention_equals_attention_over_decompressed_blocks(routed):
    torch.manual_seed(2)
    n, b, h = 3, SHAPE[1], 6
    c = DKVCodec(SHAPE, torch.float32, rank=5, residuals=2)
    blocks = [torch.randn(SHAPE) for _ in range(n)]
    rows, approx = zip(*(lowrank_kv(c, kv) for kv in blocks))
    parts = c.parts(torch.stack(rows))  # leading [n]: the rows' own layout, every sequence in each
    q = torch.randn(b, h, 1, SHAPE[4])
    route = torch.tensor([[2, 0], [1, 2]]) if routed else torch.arange(n).expand(b, -1)  # route: [B, K]
    usable = torch.rand(n, b, SHAPE[3]) > 0.3  # usable: [n, B, bs]
    usable[1, 0] = False  # a block with no usable token: no mass, no weight
    cm, block_lse = lowrank_blocks(q, parts, usable)  # cm: [n, B, H, r]; block_lse: [B, n, H]
    out, lse = lowrank_merge(q, parts, cm, block_lse, route if routed else None)
    # each block's log mass per head: the log-sum-exp of the scores over decompressed keys
    for i in range(b):
        for j in range(n):
            ref = torch.einsum("hd,htd->ht", q[i, :, 0], approx[j][0, i].repeat_interleave(h // SHAPE[2], 0))
            ref = (ref / SHAPE[4] ** 0.5).masked_fill(~usable[j, i], float("-inf"))
            torch.testing.assert_close(block_lse[i, j], ref.logsumexp(-1), atol=1e-5, rtol=1e-5)
    assert torch.isneginf(block_lse[0, 1]).all() and torch.isfinite(out).all()
    # the merged attention over the routed blocks equals attention over their decompressed keys and values
    for i in range(b):
        k = torch.cat([approx[j][0, i] for j in route[i].tolist()], dim=1)[None]  # k: [1, Hkv, K*bs, D]
        v = torch.cat([approx[j][1, i] for j in route[i].tolist()], dim=1)[None]
        ok = torch.cat([usable[j, i] for j in route[i].tolist()])[None]
        o_ref, lse_ref = attention_with_lse(q[i:i + 1], k, v, ok)
        torch.testing.assert_close(out[i:i + 1], o_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[i:i + 1], lse_ref, atol=1e-5, rtol=1e-5)


def test_lowrank_blocks_same_without_the_fused_cpu_kernel(monkeypatch):
    """Where the fused CPU kernel does not serve (a GPU, half precision, a build without it),
    attention_with_lse's own path gives the same block means and log masses."""
    import flexgen_sparpr.models.layers as layers
    torch.manual_seed(4)
    c = DKVCodec(SHAPE, torch.float32, rank=3, residuals=1)
    parts = c.parts(torch.stack([c.encode(torch.randn(SHAPE)) for _ in range(4)]))
    q = torch.randn(SHAPE[1], 6, 1, SHAPE[4])
    usable = torch.rand(4, SHAPE[1], SHAPE[3]) > 0.3
    usable[2, 1] = False
    fused = lowrank_blocks(q, parts, usable)
    monkeypatch.setattr(layers, "_FLASH_CPU", None)
    for a, b in zip(fused, lowrank_blocks(q, parts, usable)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_residual_kv_positions_and_rows():
    c = DKVCodec(SHAPE, torch.float32, rank=2, residuals=3)
    kv = [torch.randn(SHAPE) for _ in range(2)]
    parts = c.parts(torch.stack([c.encode(x) for x in kv]))
    ids = torch.tensor([4, 7])
    k, v, pos = residual_kv(parts, ids, SHAPE[3], SHAPE[4])
    for b in range(SHAPE[1]):
        for j, p in enumerate(pos[b].tolist()):
            blk = kv[[4, 7].index(p // SHAPE[3])]
            assert torch.equal(k[b, :, j], blk[0, b, :, p % SHAPE[3]])
            assert torch.equal(v[b, :, j], blk[1, b, :, p % SHAPE[3]])


def test_attention_over_nothing_has_no_weight_in_a_merge():
    q, k, v = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    empty = attention_with_lse(q, k[:, :, :0], v[:, :, :0], torch.ones(2, 0, dtype=torch.bool))
    masked = attention_with_lse(q, k, v, torch.zeros(2, 5, dtype=torch.bool))
    for out, lse in (empty, masked):
        assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
        whole = attention_with_lse(q, k, v)
        torch.testing.assert_close(merge_attention([whole, (out, lse)]), whole[0])


def test_lse_merge_equals_attention_over_the_union():
    torch.manual_seed(3)
    q = torch.randn(2, 4, 1, 8)
    k, v = torch.randn(2, 2, 30, 8), torch.randn(2, 2, 30, 8)
    valid = torch.rand(2, 30) > 0.2
    full, _ = attention_with_lse(q, k, v, valid)
    cuts = [(0, 7), (7, 19), (19, 30)]
    parts = [attention_with_lse(q, k[:, :, a:b], v[:, :, a:b], valid[:, a:b]) for a, b in cuts]
    torch.testing.assert_close(merge_attention(parts), full, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("route", ["lowrank", "mean"])
def test_routing_finds_the_block_the_query_matches(route):
    """Block 2 holds keys along the query: both routings put it first, per sequence."""
    torch.manual_seed(7)
    c = DKVCodec(SHAPE, torch.float32, rank=4, residuals=2)
    blocks = [torch.randn(SHAPE) * 0.1 for _ in range(4)]
    q = torch.randn(SHAPE[1], 6, 1, SHAPE[4])  # q: [B, H, 1, D], 2 query heads per KV head
    for g in range(SHAPE[2]):  # keys of block 2 point along KV head g's queries
        blocks[2][0, :, g] += q[:, 2 * g:2 * g + 2, 0].sum(1)[:, None, :]
    pol = DKV(route=route, topk=1)
    mean = torch.stack([x[0].mean(dim=2) for x in blocks])  # mean: [n, B, Hkv, D]
    st = type("S", (), {"mean": mean})()
    p_all = c.parts(torch.stack([c.encode(x) for x in blocks]))  # leading [n]
    usable = torch.ones(4, SHAPE[1], SHAPE[3], dtype=torch.bool).scatter_(2, p_all.res_idx.long(), False)
    got = pol._route(q, lowrank_blocks(q, p_all, usable)[1], st.mean, 1)
    assert got.tolist() == [[2]] * SHAPE[1]
