"""Speculative prefetch with one GPU batch (EngineConfig.speculative_prefetch): the next layer's
blocks are chosen from a query guessed from this layer's input and gathered while it computes;
the exact selection then keeps what the guess read and reads only what it missed
(engine/prefetch.py, recovery.py top_up). The output must not change."""
from __future__ import annotations

import pytest
import torch

from flexgen_sparpr.engine import cell, recovery
from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.engine.recovery import GatherRing, gather_selection, top_up
from flexgen_sparpr.kv.block_table import BlockTable
from flexgen_sparpr.kv.policy import Selection
from flexgen_sparpr.models.layers import decode_attention
from flexgen_sparpr.runtime.costs import CostModel
from flexgen_sparpr.storage.disk_store import DiskStore
from flexgen_sparpr.storage.tiers import Devices, Tier
from flexgen_sparpr.weights.resolve import resolve_source

PROMPTS = [list(range(3, 43)), list(range(50, 79))]  # the second is left-padded
GEN = 6
COSTS = CostModel(disk_read_Bps=1e9, matmul_flops={"float32": 1e9}, live=False)


def run(model_dir, out, name, speculate: bool, sep_layer: bool = True, device: str = "cpu"):
    args = {"keep_ratio": 0.3, "min_keep_tokens": 0} | ({"costs": COSTS} if name.startswith("sparpr") else {}) | \
        ({"dense_layers": 0} if name == "quest" else {})
    dkv = dict(cold_codec="dkv", codec_args={"rank": 1, "residuals": 3}) if name == "sparpr+dkv" else {}
    cfg = EngineConfig(device=device, dtype="float32", block_size=8, offload_dir=str(out),
                       kv_policy=name.removesuffix("+dkv"),
                       policy_args=args, speculative_prefetch=speculate, **dkv)
    policy = Policy(gpu_batch_size=2, num_gpu_batches=1, cache_gpu_percent=0, sep_layer=sep_layer)
    with Engine(resolve_source(str(model_dir), ""), policy, cfg) as eng:
        st = eng.prefill(PROMPTS, GEN, keep_logits=True)
        eng.decode(st)
        stats = eng.kv_policy.stats() if hasattr(eng.kv_policy, "stats") else None
        return torch.stack(st.tokens, 1).tolist(), st.logits, stats, eng.devices.counters.tagged("speculative")


@pytest.mark.parametrize("name, sep_layer", [("sparpr", True), ("sparpr", False), ("quest", True),
                                             ("flexgen-topk", True), ("sparpr+dkv", True)])
def test_speculation_changes_nothing_but_the_bytes(name, sep_layer, tiny_model_dir, tmp_path, monkeypatch, device):
    topped = []
    real = recovery.top_up

    def spy(*args):
        topped.append(args[2])
        return real(*args)
    monkeypatch.setattr(cell, "top_up", spy)
    ref = run(tiny_model_dir, tmp_path / "a", name, speculate=False, sep_layer=sep_layer, device=device)
    assert not topped and not ref[3]
    got = run(tiny_model_dir, tmp_path / "b", name, speculate=True, sep_layer=sep_layer, device=device)
    assert got[0] == ref[0]
    for a, b in zip(got[1], ref[1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    # the second of the two layers is guessed from the first one's input at every decode step
    assert len(topped) == GEN - 1 and got[3].get("disk->cpu", 0) > 0
    if name.startswith("sparpr"):  # statistics count the exact selections only
        assert got[2]["totals"]["calls"] == ref[2]["totals"]["calls"] == 2 * (GEN - 1)
        assert got[2]["totals"]["tokens_read"] == ref[2]["totals"]["tokens_read"]


# --- top_up on a hand-made table ---
CPU = Devices(torch.device("cpu"))


@pytest.fixture
def table(tmp_path):
    with DiskStore(tmp_path) as store:
        t = BlockTable(name="t", batch=2, num_kv_heads=2, head_dim=4, block_size=4, max_len=40,
                       dtype=torch.float32, homes=[Tier.DISK] * 10, devices=CPU, disk=store)
        gen = torch.Generator().manual_seed(0)
        for job in t.append(torch.randn(2, 2, 30, 4, generator=gen), torch.randn(2, 2, 30, 4, generator=gen)):
            job()
        yield t
        t.close()


def sel_of(t: BlockTable, picks: dict[int, list[int]]) -> Selection:
    """Sequence -> its blocks (the open block 7 for both), as a per-sequence selection."""
    blocks = sorted({x for bl in picks.values() for x in bl} | {7})
    seqs = torch.tensor([[x in picks[s] or x == 7 for x in blocks] for s in (0, 1)])
    lens = [t.block_len(x) for x in blocks]
    mask = torch.cat([seqs[:, i, None, None].expand(-1, 2, n) for i, n in enumerate(lens)], dim=2)
    return Selection(blocks, mask, seqs=seqs)


@pytest.mark.parametrize("guess", [{0: [0, 2], 1: [0, 3]},   # misses (2, seq 1)... and more
                                   {0: [0, 2, 5], 1: [0, 2, 3]},  # covers everything: nothing more read
                                   {0: [6], 1: [1]}])  # all wrong
@pytest.mark.parametrize("ring", [False, True], ids=["fresh", "in-place"])
def test_top_up_attends_what_a_fresh_gather_attends_and_reads_only_the_misses(table, guess, ring):
    t = table
    exact = sel_of(t, {0: [0, 2, 5], 1: [0, 2, 3]})
    g = gather_selection(t, Selection(**{**sel_of(t, guess).__dict__, "guess": True}), torch.float32, CPU.compute,
                         GatherRing() if ring else None, room=t.length if ring else 0)
    assert (g.room is not None) == ring
    before = CPU.counters.snapshot().get("disk->cpu", 0)
    got = top_up(t, g, exact, torch.float32, CPU.compute)
    read = CPU.counters.snapshot().get("disk->cpu", 0) - before
    ref = gather_selection(t, exact, torch.float32, CPU.compute)
    q = torch.randn(2, 4, 1, 4, generator=torch.Generator().manual_seed(1))
    k_new = torch.randn(2, 2, 1, 4, generator=torch.Generator().manual_seed(2))
    outs = []
    for f in (got, ref):
        f.kv[:, :, :, -1:] = torch.stack([k_new, k_new])
        valid = torch.cat([f.sel.mask, torch.ones(2, 2, 1, dtype=torch.bool)], dim=2)
        outs.append(decode_attention(q, f.kv[0], f.kv[1], valid))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=0)
    guessed = {(x, s) for s, bl in guess.items() for x in bl} | {(7, 0), (7, 1)}
    missed = {(x, s) for s, bl in {0: [0, 2, 5], 1: [0, 2, 3]}.items() for x in bl} - guessed
    by_block = {x: sum(1 for y, _ in missed if y == x) for x, _ in missed}
    assert read == sum(t.store.read_bytes(x, n) for x, n in by_block.items())
