"""Hand-made SparPR block tables and cost models shared by the tests of tests/kv/ (test_sparpr*.py)."""
from __future__ import annotations

import torch

from flexgen_sparpr.kv.block_table import BlockTable
from flexgen_sparpr.runtime.costs import CostModel
from flexgen_sparpr.storage.tiers import Devices, Tier

CPU = Devices(torch.device("cpu"))


def fixed(disk_Bps=1e9, flops=1e9, latency=0.0) -> CostModel:
    """A cost model with given speeds, not refreshed from the engine's counters."""
    return CostModel(disk_read_Bps=disk_Bps, matmul_flops={"float32": flops},
                     matmul_latency_s={"float32": latency}, live=False)


def fill(t: BlockTable, n: int, seed: int) -> None:
    """Append n random tokens (keys and values) to t and run its store jobs."""
    gen = torch.Generator().manual_seed(seed)
    _, b, hkv, _, d = t.block_shape
    k = torch.randn(b, hkv, n, d, generator=gen)
    for job in t.append(k, torch.randn(b, hkv, n, d, generator=gen)):
        job()


def resident(batch=2, hkv=2, d=4, bs=8, blocks=12) -> BlockTable:
    """An empty table whose blocks all live on the compute tier (the CPU)."""
    return BlockTable(name="sel", batch=batch, num_kv_heads=hkv, head_dim=d, block_size=bs, max_len=bs * blocks,
                      dtype=torch.float32, homes=[Tier.COMPUTE] * blocks, devices=CPU)
