"""SparPR's study knobs (docs/fidelity.md, "What bounds keep 0.1"): scores on the exact keys
(`summary` "exact") and each KV head its own blocks (`per_head`), and the fidelity scripts'
"policy:knob=value" configurations that run them."""
from __future__ import annotations

import math

import pytest
import torch

from flexgen_sparpr.bench.sweep import Config, configs, new_policy
from flexgen_sparpr.kv.knobs import KnobError
from flexgen_sparpr.kv.policies.sparpr import SparPR
from tests.kv.test_sparpr_lowrank import costs, table

BS, BLOCKS = 16, 16


def planted(seed: int = 0):
    """One sequence, 3 KV heads of 3 query heads each, BLOCKS sealed blocks of small random keys;
    KV head 0's keys in block 3 and KV head 1's in block 7 point along their query heads' query
    (head 2 has no such block). Returns (table, policy maker, q [1, 9, 1, D], keys [1, 3, T, D])."""
    gen = torch.Generator().manual_seed(seed)
    t = table(torch.float32, batch=1, hkv=3, d=64, bs=BS, tokens=BS * BLOCKS)
    n = BS * BLOCKS
    k = 0.1 * torch.randn(1, 3, n, 64, generator=gen)
    q = torch.randn(1, 9, 1, 64, generator=gen)
    for head, block in ((0, 3), (1, 7)):
        k[0, head, block * BS:(block + 1) * BS] += 0.6 * q[0, 3 * head:3 * head + 3, 0].mean(dim=0)
    for job in t.append(k, torch.randn(1, 3, n, 64, generator=gen)):
        job()
    return t, q, k


def made(t, k, **knobs) -> SparPR:
    pol = SparPR(keep_ratio=0.2, min_keep_tokens=0, min_keep=0.2, costs=costs(), **knobs)
    pol.attach(t, 0)
    pol.on_prefill(t, 0, torch.zeros(1, 9, k.shape[2], 64), k, torch.ones(1, k.shape[2], dtype=torch.bool))
    return pol


def test_exact_scores_are_each_blocks_attention_mass():
    """summary "exact": a block's score is the share of every query head's softmax over the
    sealed keys that its tokens get, summed over the heads (per_head: over each KV head's)."""
    t, q, k = planted()
    view_of = lambda pol: pol.step_view(t)  # noqa: E731
    shared, own = made(t, k, summary="exact"), made(t, k, summary="exact", per_head=True)
    p = torch.softmax(torch.einsum("kgd,ktd->kgt", q[0, :, 0].view(3, 3, 64), k[0]) / 8, dim=-1)  # [Hkv, G, T]
    want = p.sum(dim=1).view(3, BLOCKS, BS).sum(dim=-1)  # want: [Hkv, nb]
    got_own = own.block_scores(t, 0, q, view_of(own))
    got_shared = shared.block_scores(t, 0, q, view_of(shared))
    assert got_own.shape == (1, 3, BLOCKS) and got_shared.shape == (1, BLOCKS)
    torch.testing.assert_close(got_own[0], want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_shared[0], want.sum(dim=0), rtol=1e-5, atol=1e-6)
    assert math.isclose(float(got_shared.sum()), 9.0, rel_tol=1e-5)  # every query head adds one unit


@pytest.mark.parametrize("summary", ["lowrank", "exact"])
def test_per_head_lets_each_kv_head_keep_the_block_it_needs(summary):
    """A budget of one block beyond the sink and the newest: shared, the heads get one block between
    them; per_head, KV head 0 reads block 3 and KV head 1 block 7, each masked off the other's,
    and the step moves both."""
    t, q, k = planted()
    sel = made(t, k, summary=summary, per_head=True).select(t, 0, q)
    assert {3, 7} <= set(sel.blocks)
    at = {b: i * BS for i, b in enumerate(sel.blocks)}
    mask = sel.mask[0]  # mask: [Hkv, T] over the gathered blocks
    assert mask[0, at[3]:at[3] + BS].all() and not mask[0, at[7]:at[7] + BS].any()
    assert mask[1, at[7]:at[7] + BS].all() and not mask[1, at[3]:at[3] + BS].any()
    shared = made(t, k, summary=summary).select(t, 0, q)
    assert len(set(shared.blocks) & {3, 7}) == 1


@pytest.mark.parametrize("bad", [dict(head_score="sum"), dict(per_sequence=False), dict(summary="mean")])
def test_per_head_refuses_what_cannot_pick_per_head(bad):
    with pytest.raises(KnobError, match="per_head"):
        SparPR(per_head=True, costs=costs(), **bad)


def test_a_configuration_name_sets_policy_knobs():
    cfg = Config("sparpr:summary=exact:per_head=true", 0.1)
    assert cfg.parts == ("sparpr", None) and cfg.budgeted and cfg.label == "sparpr:summary=exact:per_head=true@0.1"
    assert cfg.knobs == {"summary": "exact", "per_head": True}
    pol = new_policy(cfg)
    assert (pol.summary, pol.per_head, pol.keep_ratio, pol.min_keep) == ("exact", True, 0.1, 0.1)
    assert [c.label for c in configs(["sparpr:recent_blocks=2"], [0.1])] == ["dense", "sparpr:recent_blocks=2@0.1"]
    assert new_policy(Config("sparpr:recent_blocks=2", 0.1)).recent_blocks == 2
    with pytest.raises(ValueError, match="not knob=value"):
        configs(["sparpr:no_such_knob=1"], [0.1])
