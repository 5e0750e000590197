"""SparPR's budget on hand-made disk tables: the floor and ceiling under any costs, the dynamic budget,
where checkpoints pay, the dense fallback (gamma), and the mandatory blocks under left padding."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexgen_sparpr.kv.block_table import BlockTable
from flexgen_sparpr.kv.policies.base import token_budget
from flexgen_sparpr.kv.policies.sparpr import SparPR
from flexgen_sparpr.kv.policies.sparpr_plan import CKPT_MARGIN
from flexgen_sparpr.runtime.costs import kv_rebuild_flops
from flexgen_sparpr.storage.disk_store import DiskStore
from flexgen_sparpr.storage.tiers import Tier

from tests.kv.sparpr_tables import CPU, fill, fixed


def disk_table(store: DiskStore, name: str, batch=2, hkv=2, d=4, bs=4, blocks=12) -> BlockTable:
    return BlockTable(name=name, batch=batch, num_kv_heads=hkv, head_dim=d, block_size=bs, max_len=bs * blocks,
                      dtype=torch.float32, homes=[Tier.DISK] * blocks, devices=CPU, disk=store)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with DiskStore(tmp_path_factory.mktemp("sparpr-disk")) as s:
        yield s


@pytest.fixture(scope="module")
def filled(store):
    t = disk_table(store, "filled")
    fill(t, 42, seed=5)  # 10 sealed blocks and 2 tokens in the open one
    return t


speeds = st.floats(1e-3, 1e15)


@settings(max_examples=100, deadline=None)
@given(disk=speeds, flops=speeds, latency=st.floats(0, 1), keep=st.floats(0.05, 1), floor=st.floats(0.01, 1))
def test_budget_respects_floor_and_ceiling_under_any_costs(filled, disk, flops, latency, keep, floor):
    t = filled
    floor = min(floor, keep)  # a floor above the ceiling is refused (next test)
    pol = SparPR(keep_ratio=keep, min_keep_tokens=0, min_keep=floor, costs=fixed(disk, flops, latency), fallback=False)
    target, _ = pol.target_keep(t, pol.block_costs(t, hidden=8))
    assert floor <= target <= keep
    sel = pol.select(t, 0, torch.randn(2, 2, 1, 4))  # hidden 8: a checkpoint is half a KV block
    reads = sel.mask[:, 0].sum(dim=1).tolist()  # every KV head of a sequence reads the same tokens
    for n_read in reads:
        low = token_budget(min(floor, keep), t.length, pol.floor(t))
        assert n_read <= token_budget(keep, t.length, pol.floor(t))
        assert n_read > low - t.bs  # whole blocks only: the slack is under one block


def test_a_floor_above_the_ceiling_is_refused_not_clamped():
    with pytest.raises(ValueError, match="min_keep 0.5 is above --keep-ratio 0.2"):
        SparPR(keep_ratio=0.2, min_keep_tokens=0, min_keep=0.5)
    assert SparPR(keep_ratio=0.2, min_keep_tokens=0, min_keep=0.2).min_keep == 0.2


def test_dynamic_budget_shrinks_as_copying_gets_dearer(filled):
    """A checkpoint is half a KV block here, so rho = copy / recompute tends to 2 as the disk
    slows: the target tends to keep_ratio ** 2, never below min_keep."""
    t, q = filled, torch.randn(2, 2, 1, 4)
    got = []
    for disk in (1e12, 1e3, 1e-3):
        pol = SparPR(keep_ratio=0.5, min_keep_tokens=0, min_keep=0.1, costs=fixed(disk_Bps=disk, flops=1e9), fallback=False)
        target, rho = pol.target_keep(t, pol.block_costs(t, hidden=8))
        assert target == pytest.approx(max(0.1, 0.5 ** max(1, rho)))
        pol.select(t, 0, q)
        got.append((rho, pol.stats()["steps"][0]["effective_keep"]))
    assert got[0][0] < 1 < got[1][0] < got[2][0] == pytest.approx(2)
    assert got[0][1] > got[2][1] and got[2][1] <= 0.25 + t.bs / t.length
    pol = SparPR(keep_ratio=0.2, min_keep_tokens=0, min_keep=0.1, costs=fixed(disk_Bps=1e-3), fallback=False)
    assert pol.target_keep(t, pol.block_costs(t, hidden=8))[0] == 0.1  # 0.2 ** 2 is below the floor


def test_checkpoints_kept_only_where_a_rebuild_can_pay(filled):
    """auto: checkpoints for a table only while rebuilding a block costs < CKPT_MARGIN x copying
    it; always: regardless; no recompute: never."""
    t = filled
    copy = t.store.codec.nbytes / 1e9  # seconds to copy one block at 1 GB/s
    ckpt = t.block_shape[1] * t.bs * 8 * 4 / 1e9  # its checkpoint's copy (hidden 8, float32)
    flops = kv_rebuild_flops(t.block_shape[1], t.bs, 8, t.block_shape[2] * t.block_shape[4])
    for rebuild_x, keep in ((0.75, True), (CKPT_MARGIN * 0.99, True), (CKPT_MARGIN * 1.01, False), (10, False)):
        flop_s = rebuild_x * copy - ckpt  # rebuild = checkpoint copy + matmuls = rebuild_x * copy
        pol = SparPR(keep_ratio=0.5, min_keep_tokens=0, costs=fixed(disk_Bps=1e9, flops=flops / flop_s))
        assert pol.wants_checkpoints(t, hidden=8) == keep, rebuild_x
        assert pol.stats()["checkpoint_tables"] == {"kept": int(keep), "asked": 1}
        always = SparPR(keep_ratio=0.5, min_keep_tokens=0, costs=pol.costs, checkpoints="always")
        assert always.wants_checkpoints(t, hidden=8)
        assert always.stats()["checkpoint_tables"] == {"kept": 1, "asked": 1}
        assert not SparPR(keep_ratio=0.5, min_keep_tokens=0, costs=pol.costs, recompute=False).wants_checkpoints(t, hidden=8)
    with pytest.raises(ValueError, match="checkpoints"):
        SparPR(checkpoints="never")


def test_fallback_exactly_when_sparse_costs_more_than_gamma_dense(store):
    t = disk_table(store, "fallback")
    fill(t, 42, seed=6)
    q = torch.randn(2, 4, 1, 4)
    base = dict(keep_ratio=0.4, min_keep_tokens=0, costs=fixed(disk_Bps=t.store.codec.nbytes), dynamic_budget=False)  # 1 s a block
    sparse = SparPR(**base, fallback=False).select(t, 0, q)
    sealed = t.length // t.bs
    # no checkpoints: every block copied, for the sequences whose mask keeps one of its tokens
    off, cost = 0, 0.0
    for b in sparse.blocks:
        readers = int(sparse.mask[:, :, off:off + t.block_len(b)].any(dim=2).any(dim=1).sum())
        off += t.block_len(b)
        cost += t.store.read_bytes(b, readers) / t.store.codec.nbytes if b < sealed else 0.0
    ratio = cost / sealed
    assert 0 < ratio < 1
    for gamma, falls in ((ratio * (1 - 1e-9), True), (ratio * (1 + 1e-9), False), (1.0, False)):
        pol = SparPR(**base, gamma=gamma)
        sel = pol.select(t, 0, q)
        assert (sel.blocks == list(range(t.num_blocks)) and sel.mask is None) == falls, gamma
        assert pol.stats()["totals"]["fallbacks"] == int(falls)
        assert sel.recompute == ()


def test_mandatory_blocks_under_left_padding(store):
    t = disk_table(store, "pads", batch=2)
    fill(t, 30, seed=9)
    pol = SparPR(keep_ratio=0.1, min_keep_tokens=0, costs=fixed(), fallback=False)
    pol.on_prefill(t, 0, None, torch.randn(2, 2, 30, 4), torch.arange(30)[None, :] >= torch.tensor([[0], [9]]))
    sel = pol.select(t, 0, torch.randn(2, 4, 1, 4))
    assert pol.mandatory(t, 0) == (3, 6)  # sink of row 1: positions 9..11; window: block 6 + 2 open
    assert {0, 2, 6, 7} <= set(sel.blocks)
