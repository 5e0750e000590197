"""The fused block selection (kv/policies/selection.py) against the one it replaced
(tests/kv/reference_selection.py): the same tokens attended by every sequence and KV head, the
same blocks moved, and through the engine the same generated tokens, for every policy that
selects blocks by score (SparPR in each summary and head-score form, its batch-shared pick, Quest)."""
from __future__ import annotations

import math

import pytest
import torch

from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.kv.block_table import BlockTable
from flexgen_sparpr.kv.policies.base import selection_from_tokens
from flexgen_sparpr.kv.policies.quest import Quest
from flexgen_sparpr.kv.policies.scoring import budgeted_pick, top_pick
from flexgen_sparpr.kv.policies.sparpr import SparPR
from flexgen_sparpr.storage.tiers import Devices, Tier
from flexgen_sparpr.weights.resolve import resolve_source

from tests.kv import reference_selection as ref
from tests.kv.sparpr_tables import fixed

CPU = Devices(torch.device("cpu"))
SPARPR_FORMS = {
    "lowrank-softmax": dict(summary="lowrank", head_score="softmax"),
    "lowrank-sum": dict(summary="lowrank", head_score="sum"),
    "mean-softmax": dict(summary="mean", head_score="softmax", summary_tokens=2),
    "mean-sum": dict(summary="mean", head_score="sum", summary_tokens=0),
    "batch-shared": dict(per_sequence=False),
}


def make(name: str, keep: float):
    if name == "quest":
        return Quest(keep_ratio=keep, min_keep_tokens=0, dense_layers=0)
    return SparPR(keep_ratio=keep, min_keep_tokens=0, costs=fixed(), **SPARPR_FORMS[name])


def prefilled(pol, batch: int, pads: list[int], n: int, seed: int, hkv=2, g=2, d=8, bs=4) -> BlockTable:
    """A resident table holding an n-token prefill (left pads per row), seen by the policy."""
    gen = torch.Generator().manual_seed(seed)
    t = BlockTable(name="f", batch=batch, num_kv_heads=hkv, head_dim=d, block_size=bs, max_len=n + 16,
                   dtype=torch.float32, homes=[Tier.COMPUTE] * (-(-(n + 16) // bs)), devices=CPU)
    pol.attach(t, 0)
    k, v = torch.randn(batch, hkv, n, d, generator=gen), torch.randn(batch, hkv, n, d, generator=gen)
    for job in t.append(k, v):
        job()
    valid = torch.arange(n)[None, :] >= torch.tensor(pads)[:, None]  # valid: [B, S]
    pol.on_prefill(t, 0, torch.randn(batch, hkv * g, n, d, generator=gen), k, valid)
    return t


def attended(t: BlockTable, sel, pads: list[int]) -> list[list[set[int]]]:
    """[B][Hkv] the cached positions each sequence and KV head attends under sel."""
    _, b, hkv, _, _ = t.block_shape
    pos = sel.rows if sel.rows is not None else t.positions(sel.blocks).expand(b, -1)  # pos: [B, T]
    mask = sel.mask if sel.mask is not None else torch.ones(b, hkv, pos.shape[1], dtype=torch.bool)
    return [[set(pos[i][mask[i, h] & (pos[i] >= pads[i])].tolist()) for h in range(hkv)] for i in range(b)]


def reference_keep(pol, t: BlockTable, q: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, L] the reference's tokens."""
    hkv = t.block_shape[2]
    if isinstance(pol, Quest):
        return ref.quest_keep(pol, t, 0, q)
    return ref.sparpr_keep(pol, t, 0, q, pol.keep_target(t, q)[0])[:, None].expand(-1, hkv, -1)


@pytest.mark.parametrize("name", [*SPARPR_FORMS, "quest"])
@pytest.mark.parametrize("batch,pads", [(1, [0]), (3, [0, 5, 9])])
@pytest.mark.parametrize("keep", [0.5, 0.2])
def test_fused_selection_attends_what_the_reference_attends(name, batch, pads, keep):
    pol = make(name, keep)
    t = prefilled(pol, batch, pads, n=50, seed=len(name) + batch)
    gen = torch.Generator().manual_seed(99)
    _, _, hkv, _, d = t.block_shape
    for step in range(6):  # across a block boundary: the open block fills, seals, opens again
        q = torch.randn(batch, hkv * 2, 1, d, generator=gen)
        sel = pol.select(t, 0, q)
        keep_ref = reference_keep(pol, t, q)  # keep_ref: [B, Hkv, L]
        want = [[set(keep_ref[i, h].nonzero().flatten().tolist()) for h in range(hkv)] for i in range(batch)]
        assert attended(t, sel, pads) == want, (name, step)
        used = {p // t.bs for row in want for s in row for p in s}
        assert sel.blocks == sorted(used | {t.num_blocks - 1}), (name, step)  # nothing idle moves
        kv = torch.randn(batch, hkv, 1, d, generator=gen)
        for job in t.append(kv, kv):
            job()


class Reference:
    """A policy's select replaced by the reference selection (for the engine run)."""

    def __init__(self, pol):
        self.pol = pol

    def __call__(self, table, layer, q):
        keep = reference_keep(self.pol, table, q)
        return selection_from_tokens(table, keep)


@pytest.mark.parametrize("name", ["lowrank-softmax", "mean-softmax", "batch-shared", "quest"])
@pytest.mark.parametrize("prompts", [[list(range(3, 43)), list(range(50, 79))],  # the second is left-padded
                                     [list(range(3, 43))]],  # one sequence, no padding: the top-k pick
                         ids=["padded-batch", "one-sequence"])
def test_fused_selection_generates_the_reference_tokens(name, prompts, tiny_llama_dir, tmp_path, monkeypatch):
    """The engine with the fused selection and with the reference one: the same greedy tokens."""

    def tokens(reference: bool) -> list[list[int]]:
        eng = Engine(resolve_source(str(tiny_llama_dir), ""), Policy(gpu_batch_size=len(prompts)),
                     EngineConfig(device="cpu", block_size=4, offload_dir=str(tmp_path)))
        pol = make(name, 0.3)
        try:
            eng.set_kv_policy(pol)
            if reference:
                monkeypatch.setattr(pol, "select", Reference(pol))
            return eng.generate(prompts, 12).tokens
        finally:
            eng.close()

    assert tokens(False) == tokens(True)


@pytest.mark.parametrize("dims", [(3, 40), (2, 3, 40)])
def test_top_pick_equals_the_budgeted_pick_when_every_block_holds_bs_tokens(dims):
    """No left padding: the one top-k takes the blocks the sort-and-running-sum pick takes (own
    blocks kept and left out of the room, -inf never taken, a room of 0 or past every block)."""
    gen = torch.Generator().manual_seed(3)
    bs = 16
    for trial in range(20):
        score = torch.randn(*dims, generator=gen)
        score[..., 5] = -math.inf  # a block that may never be picked
        own = torch.zeros(dims, dtype=torch.bool)
        own[..., 0] = own[..., -1] = True
        counts = torch.full(dims, bs)
        for blocks in (0, 1, 7, 38, 60):
            room = torch.full(dims[:-1], blocks * bs + trial % bs)  # a partial block's room never fits
            want = budgeted_pick(score, counts, room, own)
            assert torch.equal(top_pick(score, blocks, own), want)
