"""SparPR's block scores in float16 inputs: summed in float32."""
from __future__ import annotations

import torch

from flexgen_sparpr.kv.policies.sparpr import block_scores


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
