"""SparPR's `follow` knob: a block scores at least as high as the blocks before it, so a needle
that runs on past its block's end is read whole (the block after it comes along)."""
from __future__ import annotations

import pytest
import torch

from flexgen_sparpr.kv.block_table import BlockTable
from flexgen_sparpr.kv.knobs import KnobError
from flexgen_sparpr.kv.policies.sparpr import SparPR
from flexgen_sparpr.runtime.costs import CostModel
from flexgen_sparpr.storage.tiers import Devices, Tier

COSTS = CostModel(disk_read_Bps=1e9, matmul_flops={"float32": 1e9}, matmul_latency_s={"float32": 0.0}, live=False)


def needle_table() -> BlockTable:
    """8 sealed blocks of 8 tokens: block 5 along the query, block 2 a little less, block 6 (the
    needle's continuation) pointing away, the rest filler."""
    t = BlockTable(name="f", batch=1, num_kv_heads=1, head_dim=4, block_size=8, max_len=80, dtype=torch.float32,
                   homes=[Tier.COMPUTE] * 10, devices=Devices(torch.device("cpu")))
    k = torch.zeros(1, 1, 64, 4)
    k[..., 0] = 0.3
    k[0, 0, 16:24, 0] = 2.0
    k[0, 0, 40:48, 0] = 4.0
    k[0, 0, 48:56, 0] = -2.0
    for job in t.append(k, torch.randn(1, 1, 64, 4)):
        job()
    return t


@pytest.mark.parametrize("follow, want", [(0, [0, 2, 5, 7]), (1, [0, 5, 6, 7])])
def test_the_block_after_a_strong_one_comes_along(follow, want):
    q = torch.tensor([1.0, 0, 0, 0]).view(1, 1, 1, 4)
    pol = SparPR(keep_ratio=0.5, costs=COSTS, fallback=False, dynamic_budget=False, follow=follow)  # sink, recent, 2 more
    assert pol.select(needle_table(), 0, q).blocks == want
    assert pol.stats()["config"]["follow"] == follow


def test_follow_is_checked():
    with pytest.raises(KnobError, match="follow"):
        SparPR(follow=-1)
