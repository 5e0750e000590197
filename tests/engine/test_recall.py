"""A selective policy's offloaded reads go through each table's arena (engine/recall.py): a
block a slot already holds is attended in place, only the rest is read. Attention sees the same
tokens, so the output equals reading every selected block afresh; fewer bytes cross the links."""
from __future__ import annotations

import pytest
import torch

from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.engine.recall import Recall
from flexgen_sparpr.kv.policies import make_policy
from flexgen_sparpr.runtime.costs import CostModel
from flexgen_sparpr.weights.resolve import resolve_source

PROMPTS = [list(range(3, 163)), list(range(50, 195))]  # the second is left-padded
GEN = 24  # three blocks of 8 sealed while decoding: new blocks join the selection
PLACEMENTS = {"disk": dict(cache_gpu_percent=0, cache_cpu_percent=0), "cpu": dict(cache_gpu_percent=0,
                                                                                  cache_cpu_percent=100)}


def run(model_dir, tmp_path, policy: str, placement: str, recall: bool, ngb: int = 1, device: str = "cpu"):
    knobs = {"keep_ratio": 0.2, "min_keep_tokens": 0}
    if policy == "sparpr":
        knobs["costs"] = CostModel(disk_read_Bps=1e9, matmul_flops={"float32": 1e9}, live=False)
    if policy == "quest":
        knobs["dense_layers"] = 0  # the tiny models have two layers
    pol = make_policy(policy, **knobs)
    cfg = EngineConfig(device=device, dtype="float32", kv_dtype="float32", block_size=8, offload_dir=str(tmp_path),
                       direct_io=True)
    with Engine(resolve_source(str(model_dir), ""), Policy(gpu_batch_size=len(PROMPTS) // ngb, num_gpu_batches=ngb,
                                                          **PLACEMENTS[placement]), cfg) as eng:
        eng.set_kv_policy(pol)
        if not recall:
            eng.reader.recall = None
        st = eng.prefill(PROMPTS, GEN, keep_logits=True)
        eng.decode(st)
        moved = eng.devices.counters.snapshot()
        return torch.stack(st.tokens, 1).tolist(), st.logits, moved


@pytest.mark.parametrize("placement", ["disk", "cpu"])
@pytest.mark.parametrize("policy", ["sparpr", "quest", "streaming-llm"])
def test_recall_changes_nothing_but_the_bytes(tiny_model_dir, tmp_path, policy, placement, device):
    ref_tokens, ref_logits, ref_moved = run(tiny_model_dir, tmp_path / "a", policy, placement, False, device=device)
    tokens, logits, moved = run(tiny_model_dir, tmp_path / "b", policy, placement, True, device=device)
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)  # the same tokens, summed in another order
    link = "disk->cpu" if placement == "disk" else "cpu->compute"
    if placement == "disk" or device == "cuda":  # a CPU engine's CPU tier is its compute device: nothing crosses
        assert moved[link] < 0.7 * ref_moved[link], (moved[link], ref_moved[link])


def test_recall_with_two_gpu_batches_on_the_prefetch_path(tiny_model_dir, tmp_path):
    """Two GPU batches select one cell early and gather on the I/O pool: through the arena too."""
    ref_tokens, ref_logits, _ = run(tiny_model_dir, tmp_path / "a", "sparpr", "disk", recall=False, ngb=2)
    tokens, logits, _ = run(tiny_model_dir, tmp_path / "b", "sparpr", "disk", recall=True, ngb=2)
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_restored_snapshot_starts_its_arenas_afresh(tiny_model_dir, tmp_path):
    """Two decodes from one snapshot give the same tokens: the arena of the first decode (whose
    later blocks the second overwrites) is not reused after the rewind."""
    pol = make_policy("sparpr", keep_ratio=0.3, min_keep_tokens=0, costs=CostModel(disk_read_Bps=1e9, matmul_flops={"float32": 1e9},
                                                                live=False))
    cfg = EngineConfig(device="cpu", dtype="float32", kv_dtype="float32", block_size=8, offload_dir=str(tmp_path),
                       direct_io=True)
    with Engine(resolve_source(str(tiny_model_dir), ""), Policy(gpu_batch_size=2, **PLACEMENTS["disk"]), cfg) as eng:
        eng.set_kv_policy(pol)
        st = eng.prefill(PROMPTS, GEN)
        snap = eng.snapshot(st)
        eng.decode(st)
        first = torch.stack(st.tokens, 1).tolist()
        st2 = eng.restore(snap)
        eng.decode(st2)
        assert torch.stack(st2.tokens, 1).tolist() == first


def test_the_arena_grows_and_keeps_what_it_holds(tmp_path):
    """A selection larger than the arena grows it, keeping the blocks its slots hold; the arena's
    kept tokens are the selected blocks' values at their own positions."""
    from flexgen_sparpr.kv.block_table import BlockTable
    from flexgen_sparpr.kv.policy import Selection
    from flexgen_sparpr.storage.disk_store import DiskStore
    from flexgen_sparpr.storage.tiers import Devices, Tier
    devs = Devices(torch.device("cpu"))
    with DiskStore(tmp_path) as disk:
        t = BlockTable(name="t", batch=1, num_kv_heads=1, head_dim=4, block_size=2, max_len=16, dtype=torch.float32,
                       homes=[Tier.DISK] * 8, devices=devs, disk=disk)
        kv = torch.arange(2 * 9 * 4, dtype=torch.float32).view(2, 1, 1, 9, 4)  # kv: [2, B, Hkv, T, D]
        for job in t.append(kv[0], kv[1]):  # four sealed blocks and one open token
            job()
        rec = Recall()
        rec.gather(t, Selection([0, 4]), torch.float32, devs.compute)
        assert rec._arenas[t].slots == 2 and rec._arenas[t].slot_of == {0: 0}
        before = disk.files[next(iter(disk.files))].bytes_read
        got = rec.gather(t, Selection([0, 1, 2, 4]), torch.float32, devs.compute)
        ar = rec._arenas[t]
        assert ar.slots >= 3 and ar.slot_of[0] == 0  # grown; block 0 kept its slot
        assert disk.files[next(iter(disk.files))].bytes_read - before == 2 * t.store.codec_of(Tier.DISK).nbytes
        keep = got.sel.mask[0, 0]  # keep: [C*bs + open]
        pos = got.pos[:-1][keep]
        assert sorted(pos.tolist()) == [0, 1, 2, 3, 4, 5, 8]
        assert torch.equal(got.kv[:, :, :, :-1][:, :, :, keep], kv[:, :, :, pos])


def test_the_arenas_are_counted_where_they_live():
    """A selective policy's arena share is ARENA_SLACK x its read share (none for dense, for H2O,
    which observes attention's reads, or under a cold codec), and the placement's compute-device
    working set grows by exactly that share of the offloaded cache."""
    from flexgen_sparpr.kv.policy import ARENA_SLACK
    from flexgen_sparpr.runtime.placement import Workload, tier_use
    from flexgen_sparpr.models.spec import opt_spec
    sparpr = make_policy("sparpr", keep_ratio=0.1, min_keep_tokens=0)
    assert sparpr.arena_share() == pytest.approx(ARENA_SLACK * sparpr.read_share())
    assert make_policy("dense").arena_share() == make_policy("h2o", keep_ratio=0.1).arena_share() == 0
    assert sparpr.arena_share(cold=make_policy("dkv")) == 0
    spec = opt_spec("opt-1.3b")
    base = Workload(spec, 512, 32, batch_size=4, kv_read_share=0.1)
    with_arena = Workload(spec, 512, 32, batch_size=4, kv_read_share=0.1, kv_arena_share=0.125)
    cg = 0.25
    grow = [tier_use(w, True, 0.5, 0.5, cg, 0.75, 4, False)["compute"]["working"] for w in (base, with_arena)]
    kv = 4 * (512 + 32) * 2 * spec.kv_dim * 2 * spec.num_layers  # the raw cache in float16
    assert grow[1] - grow[0] == pytest.approx((1 - cg) * 0.125 * kv)
