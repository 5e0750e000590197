"""SparPR's mean summaries in host memory (`summaries_on="cpu"`, issue 17 item 1): nothing of
them on the compute device, the same blocks picked as with device summaries, and the query and
scores crossing the link counted. On a CUDA machine the cuda-marked cases run with the cache on
the GPU and the summaries on the host."""
from __future__ import annotations

import pytest
import torch

from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.kv.block_table import BlockTable
from flexgen_sparpr.kv.knobs import KnobError
from flexgen_sparpr.kv.policies.sparpr import SparPR
from flexgen_sparpr.storage.tiers import Devices, Tier
from flexgen_sparpr.weights.resolve import resolve_source

from tests.kv.sparpr_tables import fixed


def filled(device: str, seed: int, bs=8, blocks=16, batch=2, hkv=2, d=8) -> BlockTable:
    t = BlockTable(name="h", batch=batch, num_kv_heads=hkv, head_dim=d, block_size=bs, max_len=bs * blocks,
                   dtype=torch.float32, homes=[Tier.COMPUTE] * blocks, devices=Devices(torch.device(device)))
    gen = torch.Generator().manual_seed(seed)
    n = bs * (blocks - 1) - 3  # an open block too
    for job in t.append(torch.randn(batch, hkv, n, d, generator=gen).to(device),
                        torch.randn(batch, hkv, n, d, generator=gen).to(device)):
        job()
    return t


@pytest.mark.parametrize("head_score", ["sum", "softmax"])
def test_host_summaries_pick_what_device_summaries_pick(device, head_score):
    for seed in range(4):
        q = torch.randn(2, 4, 1, 8, generator=torch.Generator().manual_seed(100 + seed)).to(device)
        picks = {}
        for home in ("compute", "cpu"):
            t = filled(device, seed)
            pol = SparPR(keep_ratio=0.3, min_keep_tokens=0, costs=fixed(), fallback=False, head_score=head_score, summaries_on=home,
                         summary="mean")
            sel = pol.select(t, 0, q)
            picks[home] = (sel.blocks, sel.mask.cpu())
            parts = pol._sums[t].parts
            assert all(p.device.type == ("cpu" if home == "cpu" else torch.device(device).type) for p in parts)
            if home == "cpu":
                assert pol.summary_bytes(t) == 0 and pol.host_summary_bytes(t) == sum(p.nbytes for p in parts)
                links = t.devices.counters.snapshot()  # on a CUDA cache: the query out, the scores back
                want = {"compute->cpu": q.nbytes, "cpu->compute": 2 * (t.length // t.bs) * 4} if t.devices.is_cuda else {}
                assert {k: links.get(k, 0) for k in want} == want
            else:
                assert pol.summary_bytes(t) > 0 and pol.host_summary_bytes(t) == 0
        assert picks["cpu"][0] == picks["compute"][0] and torch.equal(picks["cpu"][1], picks["compute"][1])


def test_resident_share_counts_no_device_bytes_for_host_summaries():
    assert SparPR(summaries_on="cpu").resident_share(64, 2) == 0.0
    assert SparPR(summary="mean").resident_share(64, 2) == 1 / 8  # 4-token means in the cache's dtype
    assert SparPR().resident_share(64, 2) == 1 / 16  # the default: every key's 4-bit codes at rank D / 2
    assert SparPR(summaries_on="cpu").summary == "mean"  # auto: the means where summaries live on the host


def test_host_summaries_are_the_mean_ones():
    with pytest.raises(KnobError, match="summaries_on"):
        SparPR(summary="lowrank", summaries_on="cpu")
    with pytest.raises(KnobError, match="summaries_on"):
        SparPR(summaries_on="disk")


def test_engine_generates_the_same_tokens_with_host_summaries(tiny_llama_dir, tmp_path, device):
    prompts = [list(range(3, 43)), list(range(50, 79))]
    out = {}
    for home in ("compute", "cpu"):
        cfg = EngineConfig(device=device, block_size=8, offload_dir=str(tmp_path))
        with Engine(resolve_source(str(tiny_llama_dir), ""), Policy(gpu_batch_size=2, cache_gpu_percent=0), cfg) as eng:
            eng.set_kv_policy(SparPR(keep_ratio=0.4, min_keep_tokens=0, costs=fixed(), summaries_on=home, summary="mean"))
            out[home] = eng.generate(prompts, 8).tokens
    assert out["cpu"] == out["compute"]
