"""Rebuilding KV blocks from hidden-state checkpoints through the K/V projections only."""
import pytest
import torch

from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.kv.policy import KVPolicy, Selection
from flexgen_sparpr.weights.resolve import resolve_source


class RebuildEvery(KVPolicy):
    """Reads every block; rebuilds every sealed block (or every `step`-th) from checkpoints."""

    needs_checkpoints = True

    def __init__(self, step: int = 1):
        self.step = step

    def plan(self, table, layer):
        sealed = table.length // table.bs
        return Selection(list(range(table.num_blocks)), recompute=tuple(range(0, sealed, self.step)))


PROMPTS = [list(range(5, 45)), list(range(7, 30))]  # left padding in the second row


@pytest.mark.parametrize("placement", [dict(), dict(cache_gpu_percent=0, cache_cpu_percent=0)],
                         ids=["compute", "disk"])
@pytest.mark.parametrize("step", [1, 2])
def test_rebuilt_kv_equals_stored_kv(tiny_model_dir, tmp_path, placement, step, device):
    src = resolve_source(str(tiny_model_dir), "")
    # stored exact: a float16 block and one rebuilt from a float16 checkpoint differ by rounding
    cfg = EngineConfig(block_size=8, offload_dir=str(tmp_path), device=device, dtype="float32", kv_dtype="float32")
    with Engine(src, Policy(gpu_batch_size=2, **placement), cfg) as eng:
        ref = eng.generate(PROMPTS, 8, keep_logits=True)
    with Engine(src, Policy(gpu_batch_size=2, **placement), cfg) as eng:
        eng.set_kv_policy(RebuildEvery(step))
        got = eng.generate(PROMPTS, 8, keep_logits=True)
    assert got.tokens == ref.tokens
    assert max((a - b).abs().max().item() for a, b in zip(got.logits, ref.logits)) < 1e-5


def test_rebuild_reads_checkpoints_not_kv(tiny_opt_dir, tmp_path, device):
    """OPT keeps K and V (2 x hidden per token) but a checkpoint is 1 x hidden: with every
    sealed block rebuilt, the disk->cpu bytes of a decode step halve for sealed blocks."""
    src = resolve_source(str(tiny_opt_dir), "")
    cfg = EngineConfig(block_size=8, offload_dir=str(tmp_path), device=device, dtype="float32")
    pol = Policy(gpu_batch_size=2, cache_gpu_percent=0, cache_cpu_percent=0, overlap=False)
    moved = []
    for policy in (None, RebuildEvery()):
        with Engine(src, pol, cfg) as eng:
            if policy:
                eng.set_kv_policy(policy)
            st = eng.prefill([list(range(5, 37))] * 2, 3)  # 32 tokens: 4 sealed blocks
            eng.devices.counters.reset()
            eng.decode(st)
            moved.append(eng.devices.counters.snapshot()["disk->cpu"])
    assert moved[1] * 2 == moved[0]
