"""DKV cold blocks under SparPR (--kv-policy sparpr --cold-codec dkv): the table keeps each coded
block's exact rows on compute, and every block SparPR leaves out is still attended on them
(kv/dkv/exact_rows.py; docs/dkv.md, "Composed with SparPR")."""
from __future__ import annotations

import torch

from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.kv.block_table import BlockTable
from flexgen_sparpr.kv.dkv.codec import DKVCodec
from flexgen_sparpr.kv.dkv.exact_rows import with_exact_rows
from flexgen_sparpr.kv.policy import Selection
from flexgen_sparpr.storage.tiers import Devices, Tier
from flexgen_sparpr.weights.resolve import resolve_source

PROMPTS = [list(range(3, 43)), list(range(50, 79))]


def engine(model_dir, tmp_path, **kw):
    policy = Policy(gpu_batch_size=2, cache_gpu_percent=kw.pop("gpu", 100))
    cfg = EngineConfig(device="cpu", block_size=8, offload_dir=str(tmp_path), **kw)
    return Engine(resolve_source(str(model_dir), ""), policy, cfg)


def coded_table(keep_rows: bool = True):
    shape = (2, 2, 2, 8, 4)
    t = BlockTable(name="t", batch=2, num_kv_heads=2, head_dim=4, block_size=8, max_len=32, dtype=torch.float32,
                   homes=[Tier.COMPUTE] * 4, devices=Devices(torch.device("cpu")),
                   codec=DKVCodec(shape, torch.float32, rank=1, residuals=3))
    t.store.hold_exact_rows = keep_rows
    k, v = torch.randn(2, 2, 24, 4), torch.randn(2, 2, 24, 4)
    for job in t.append(k, v):
        job()
    return t, k, v


def test_table_holds_a_coded_blocks_exact_rows_and_fills_only_them():
    torch.manual_seed(11)
    t, k, v = coded_table()
    idx, kv = t.exact_rows(0)  # idx: [B, m]; kv: [2, B, Hkv, m, D]
    assert idx.shape == (2, 3) and kv.shape == (2, 2, 2, 3, 4)
    assert torch.equal(idx, t.store.codec.parts(t.rows([0])[0]).res_idx.long())
    for b in range(2):
        assert torch.equal(kv[0, b], k[b, :, idx[b]]) and torch.equal(kv[1, b], v[b, :, idx[b]])
    # block 0 read by no sequence: only its exact rows are filled (zeros elsewhere), block 1 whole
    out, _ = t.gather([0, 1], seqs=torch.tensor([[False, True], [False, True]]))
    for b in range(2):
        rows = torch.zeros(8, dtype=torch.bool).index_fill_(0, idx[b], True)
        assert torch.equal(out[0, b, :, :8][:, rows], k[b, :, idx[b]])
        assert not out[:, b, :, :8][:, :, ~rows].any()
    torch.testing.assert_close(out[:, :, :, 8:], t.store.codec.decode(t.rows([1])[0]))
    assert coded_table(keep_rows=False)[0].exact_rows(0) is None  # only when a policy asks


def test_selection_gains_the_exact_rows_of_the_blocks_it_leaves_out():
    torch.manual_seed(12)
    t, _, _ = coded_table()
    mask = torch.ones(2, 2, 8, dtype=torch.bool)
    mask[1, :, :3] = False  # sequence 1 skips block 1's first tokens
    valid = torch.ones(2, 24, dtype=torch.bool)
    valid[1, :2] = False  # sequence 1 is left-padded by 2
    sel = with_exact_rows(t, Selection([1], mask, seqs=torch.tensor([[True], [True]])), valid)
    assert sel.blocks == [0, 1, 2]
    assert sel.seqs.tolist() == [[False, True, False], [False, True, False]]  # blocks 0, 2: nothing moves
    for j, blk in enumerate(sel.blocks):
        idx, _ = t.exact_rows(blk)
        for b in range(2):
            want = torch.zeros(8, dtype=torch.bool).index_fill_(0, idx[b], True)  # its exact rows...
            if blk == 1:
                want |= mask[b, 0]  # ...and, where chosen, what the selection chose
            want &= valid[b, blk * 8:blk * 8 + 8]
            assert torch.equal(sel.mask[b, :, j * 8:j * 8 + 8], want[None].expand(2, -1))
    whole = Selection([0, 1, 2])
    assert with_exact_rows(t, whole, valid) is whole  # no mask over every block: nothing to add
    part = with_exact_rows(t, Selection([0, 2]), valid)  # no mask (one sequence's pick): blocks 0, 2 whole
    assert part.blocks == [0, 1, 2] and part.seqs.tolist() == [[True, False, True]] * 2
    idx, _ = t.exact_rows(1)
    for b in range(2):
        want = torch.zeros(8, dtype=torch.bool).index_fill_(0, idx[b], True)  # block 1: its exact rows only
        assert torch.equal(part.mask[b, 0, 8:16], want)
        assert torch.equal(part.mask[b, 0, :8], valid[b, :8]) and bool(part.mask[b, 0, 16:].all())


def test_sparpr_over_exact_cold_rows_equals_dense_at_any_keep(tiny_llama_dir, tmp_path):
    """With every row of a DKV block exact (residuals = bs), SparPR over DKV cold blocks attends
    every token exactly, selected block or not: dense's tokens even at keep 0.1, while the disk
    moves only the selected blocks."""
    sp = {"keep_ratio": 0.1, "min_keep_tokens": 0, "min_keep": 0.1, "quest_only": True, "recent_blocks": 1}
    with engine(tiny_llama_dir, tmp_path, kv_policy="dense", gpu=0) as eng:
        ref = eng.generate(PROMPTS, 6).tokens
    with engine(tiny_llama_dir, tmp_path, kv_policy="sparpr", gpu=0, policy_args=sp) as eng:
        assert eng.generate(PROMPTS, 6).tokens != ref  # the raw blocks it leaves out are gone
    with engine(tiny_llama_dir, tmp_path, kv_policy="sparpr", gpu=0, policy_args=sp, cold_codec="dkv",
                codec_args={"rank": 1, "residuals": 8}) as eng:
        st = eng.prefill(PROMPTS, 6)
        before = eng.devices.counters.snapshot().get("disk->cpu", 0)
        assert eng.decode(st).tokens == ref
        moved = eng.devices.counters.snapshot().get("disk->cpu", 0) - before
        t = eng.tables[(0, 0)]
        steps = eng.kv_policy.step_stats.report()["totals"]
        # whole encoded blocks, fewer than every cold block (all but the exact recent one) per step
        assert moved % t.store.codec.nbytes == 0 and 0 < moved < steps["calls"] * (t.length // t.bs - 1) * t.store.codec.nbytes


def test_coded_rows_on_compute_come_back_as_a_view_when_their_slots_are_consecutive():
    torch.manual_seed(13)
    t, _, _ = coded_table()
    arena = t.store._rows[Tier.COMPUTE]
    rows = t.rows([0, 1, 2])  # slots 0..2: one view, no copy
    assert rows.shape == (3, t.store.codec.nbytes) and rows.data_ptr() == arena.data_ptr()
    picked = t.rows([0, 2])  # not consecutive: a copy with the same bytes
    assert picked.data_ptr() != arena.data_ptr()
    assert torch.equal(picked[0], rows[0]) and torch.equal(picked[1], rows[2])
