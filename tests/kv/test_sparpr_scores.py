"""SparPR's block scores and selection: against a hand computation, sub-block summaries, per-sequence
top-k, the selection knobs; float16 inputs summed in float32."""
from __future__ import annotations

import pytest
import torch

from flexgen_sparpr.kv.policies.base import token_budget
from flexgen_sparpr.kv.policies.sparpr import SparPR, masked_mean_keys
from flexgen_sparpr.kv.policies.sparpr_mean import block_scores

from tests.kv.sparpr_tables import fill, fixed, resident


def test_sum_head_score_is_float32_for_float16_inputs():
    """The "sum" score adds the query heads of a KV head and dots them with each summary in
    float32: in float16 a head sum over 65504 overflows to inf, and scores 1000.0 and 1000.2
    round to one value (a tie where the second block is better)."""
    q = torch.tensor([[1000.0, 1.0], [0.0, 0.0],  # KV head 0's two query heads
                      [40000.0, 0.0], [30000.0, 0.0]]).view(1, 4, 1, 2).half()  # q: [B, H, 1, D]
    summ = torch.tensor([[[[1.0, 0.0]], [[1.0, 0.2]]],  # KV head 0: block 0, block 1
                         [[[0.0, 0.0]], [[0.0, 0.0]]]])[None].half()  # summ: [B, Hkv, nb, P, D]
    got = block_scores(q, summ, torch.ones(1, 2, 1, dtype=torch.bool), head_score="sum")
    assert torch.isfinite(got).all() and got[0, 1] > got[0, 0], got


# --- selection refinements: per-head softmax, sub-block summaries, per-sequence top-k ---
def hand_scores(q, keys, t: int, head_score: str) -> list[list[float]]:
    """Per sequence and sealed block: the best run of t tokens' score, in plain Python loops.
    q: [B, H, 1, D]; keys: [B, Hkv, L, D] (no padding)."""
    b, h, _, d = q.shape
    hkv, n = keys.shape[1], keys.shape[2] // t
    out = []
    for s in range(b):
        dots = [[float(q[s, j, 0] @ keys[s, j // (h // hkv), p * t:(p + 1) * t].mean(0)) for p in range(n)]
                for j in range(h)]  # dots[head][part]
        if head_score == "softmax":
            dots = [torch.tensor(row).div(d ** 0.5).softmax(0).tolist() for row in dots]
        out.append([sum(dots[j][p] for j in range(h)) for p in range(n)])
    return out


@pytest.mark.parametrize("head_score", ["sum", "softmax"])
@pytest.mark.parametrize("summary_tokens", [0, 2, 4])
def test_block_scores_equal_a_hand_computation(head_score, summary_tokens):
    t = resident(bs=8)
    fill(t, 8 * 6, seed=12)  # 6 sealed blocks, no open tokens
    q = torch.randn(2, 4, 1, 4, generator=torch.Generator().manual_seed(13))  # 2 query heads per KV head
    pol = SparPR(keep_ratio=0.5, min_keep_tokens=0, costs=fixed(), head_score=head_score, summary="mean", summary_tokens=summary_tokens)
    got = block_scores(q, *pol.summaries(t, 0), head_score)  # got: [B, nb]
    run = summary_tokens or 8
    parts = hand_scores(q, t.gather()[0][0], run, head_score)
    want = [[max(row[blk * 8 // run:(blk + 1) * 8 // run]) for blk in range(6)] for row in parts]
    torch.testing.assert_close(got, torch.tensor(want), atol=1e-5, rtol=1e-5)


def test_sub_block_means_skip_left_padding():
    keys = torch.arange(2 * 1 * 1 * 8 * 1, dtype=torch.float32).view(2, 1, 1, 8, 1)  # [B, Hkv, n, bs, D]
    valid = torch.ones(2, 1, 8, dtype=torch.bool)
    valid[1, 0, :5] = False  # row 1: 5 pads, so its first run of 4 is all padding
    mean, live = masked_mean_keys(keys, valid, parts=2)  # mean: [n, B, Hkv, P, D]
    assert mean[0, :, 0, :, 0].tolist() == [[1.5, 5.5], [0.0, 14.0]]  # row 1, run 2: (13+14+15)/3
    assert live[0].tolist() == [[True, True], [False, True]]


def test_a_sub_block_summary_finds_a_short_needle_that_the_block_mean_dilutes():
    """One 2-token run of block 5 matches the query; the other 6 tokens point away from it. The
    block's mean ranks it last; its 2-token summary ranks it first, and the step reads it."""
    t = resident(batch=1, hkv=1, d=4, bs=8, blocks=10)
    k = torch.zeros(1, 1, 64, 4)
    k[..., 0] = 0.3  # every filler key: a little along the query
    k[0, 0, 42:44] = torch.tensor([4.0, 0, 0, 0])  # the needle: 2 tokens along the query
    k[0, 0, 44:48] = torch.tensor([-2.0, 0, 0, 0])  # the rest of block 5 points away
    for job in t.append(k, torch.randn(1, 1, 64, 4)):
        job()
    q = torch.tensor([1.0, 0, 0, 0]).view(1, 1, 1, 4)
    budget = dict(keep_ratio=0.375, min_keep_tokens=0, costs=fixed(), fallback=False)  # 24 tokens: sink, window, one more block
    assert 5 not in SparPR(**budget, summary="mean", summary_tokens=0).select(t, 0, q).blocks
    assert 5 in SparPR(**budget, summary="mean", summary_tokens=2).select(t, 0, q).blocks


def test_per_sequence_top_k_moves_the_union_and_masks_each_sequence_to_its_own():
    t = resident(batch=3, hkv=2, d=4, bs=4, blocks=16)
    fill(t, 48, seed=14)  # 12 sealed blocks: sink 0, window 11, candidates 1..10
    q = torch.randn(3, 4, 1, 4, generator=torch.Generator().manual_seed(15))
    pol = SparPR(keep_ratio=0.5, min_keep_tokens=0, costs=fixed(), per_sequence=True, head_score="softmax", summary="mean")
    sel = pol.select(t, 0, q)
    budget = token_budget(0.5, 48, pol.floor(t))  # 24: sink + window + 4 more blocks
    scores = hand_scores(q, t.gather()[0][0], 4, "softmax")
    mine = []
    for s in range(3):
        best = sorted(range(1, 11), key=lambda blk: -scores[s][blk])[:(budget - 8) // 4]
        mine.append({0, 11, *best})
        pos = sel.rows[s] if sel.rows is not None else t.positions(sel.blocks)  # a resident batch: its own row
        assert {p // 4 for p in pos[sel.mask[s, 0]].tolist()} == mine[s]
        assert torch.equal(sel.mask[s, 0], sel.mask[s, 1]) and int(sel.mask[s, 0].sum()) == 4 * len(mine[s]) <= budget
    assert sel.blocks == sorted(set().union(*mine))  # the union moves; nobody's block is left behind


@pytest.mark.parametrize("bad", [dict(head_score="max"), dict(summary_tokens=-1), dict(summary="max"),
                                 dict(summary_rank=0), dict(summary_rank=1.5)])
def test_bad_selection_knobs_are_refused(bad):
    with pytest.raises(ValueError):
        SparPR(**bad)


def test_summary_tokens_must_divide_the_block_size():
    with pytest.raises(ValueError, match="does not divide"):
        SparPR(summary="mean", summary_tokens=3, quest_only=True).attach(resident(bs=8), 0)
