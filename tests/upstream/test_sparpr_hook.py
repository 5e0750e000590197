"""apply_sparpr: SparPR's block selection in upstream FlexGen's decode attention. keep_ratio 1.0
changes nothing (bit for bit); below 1 it changes which positions are attended."""
from __future__ import annotations

import pytest
import torch

from flexgen_sparpr.kv.policies.base import token_budget
from flexgen_sparpr.upstream.sparpr_hook import (SparPRConfig, apply_sparpr, remove_sparpr, sparpr_keep,
                                                 sparpr_stats)
from tests.upstream.recording import run_recording


@pytest.fixture(autouse=True)
def unhooked():
    yield
    remove_sparpr()


def test_keep_ratio_one_is_bit_identical(dense_recorded):
    dense, dense_outs = dense_recorded
    hooked, hooked_outs = run_recording({"keep_ratio": 1.0, "block_size": 16})
    st = sparpr_stats()
    assert st.calls == len(hooked_outs) == 12 * 2  # every layer of both decode steps went through it
    assert st.tokens_read == st.tokens_valid > 0
    assert hooked["tokens"] == dense["tokens"]
    assert len(dense_outs) == len(hooked_outs)
    assert all(torch.equal(a, b) for a, b in zip(dense_outs, hooked_outs))


def test_keep_ratio_below_one_reads_less_and_changes_outputs(dense_recorded):
    dense_outs = dense_recorded[1]
    _, sparse_outs = run_recording({"keep_ratio": 0.3, "block_size": 4})
    st = sparpr_stats()
    assert st.calls == len(sparse_outs) and st.effective_keep() < 0.5
    for context, read, valid in st.per_call:  # per sequence: at most the budget (2 sequences)
        assert read <= 2 * token_budget(0.3, context, 4 * 2 + context % 4)
    assert not all(torch.equal(a, b) for a, b in zip(dense_outs, sparse_outs))


def _tiny_case():
    """B=2, H=2, D=4, 10 cached tokens (5 blocks of 2) + the new one; sequence 1 has 2 pads.
    Block 2 of sequence 0 and block 3 of sequence 1 point along the query."""
    b, h, d, s = 2, 2, 4, 11
    torch.manual_seed(0)
    q = torch.zeros(b, h, 1, d)
    q[..., 0] = 1.0
    k = 0.01 * torch.randn(b, h, s, d)
    k[0, :, 4:6, 0] = 5.0  # sequence 0, block 2
    k[1, :, 6:8, 0] = 5.0  # sequence 1, block 3
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[1, :2] = False
    # upstream's layout: q [B*H, 1, D], k [B*H, D, S]
    return q.reshape(b * h, 1, d), k.permute(0, 1, 3, 2).reshape(b * h, d, s), mask, h


def test_selection_keeps_sink_recent_open_and_best_blocks():
    q, k, mask, h = _tiny_case()
    keep = sparpr_keep(q, k, mask, h, SparPRConfig(keep_ratio=0.7, min_keep=0.1, block_size=2, recent_blocks=1))
    # budgets: ceil(0.7 * 10) = 7 and ceil(0.7 * 8) = 6 tokens; sink + recent take 4, one block fits
    want0 = [0, 1, 4, 5, 8, 9, 10]  # sink block 0, best block 2, recent block 4, the new token
    want1 = [2, 3, 6, 7, 8, 9, 10]  # sink is block 1 (after the pads), best block 3
    assert keep[0].nonzero().flatten().tolist() == want0
    assert keep[1].nonzero().flatten().tolist() == want1
    full = sparpr_keep(q, k, mask, h, SparPRConfig(keep_ratio=1.0, block_size=2))
    assert torch.equal(full, mask)


def test_hooked_attention_masks_unselected_positions():
    import flexgen.pytorch_backend as backend
    q, k, mask, h = _tiny_case()
    v = torch.randn(q.shape[0], k.shape[2], q.shape[2])  # v: [B*H, S, D]
    dev = backend.TorchDevice("cpu")
    args = (q, k, v, mask, 2, 11, 1, h, 4)
    dense = dev._attention_value(*args)
    cfg = apply_sparpr(keep_ratio=0.6, block_size=2)
    sparse = dev._attention_value(*args)
    keep = sparpr_keep(q, k, mask, h, cfg)
    remove_sparpr()
    assert not torch.equal(dense, sparse)
    assert torch.equal(sparse, dev._attention_value(q, k, v, keep, 2, 11, 1, h, 4))
    apply_sparpr(keep_ratio=1.0, block_size=2)
    assert torch.equal(dense, dev._attention_value(*args))


def test_apply_and_remove():
    import flexgen.pytorch_backend as backend
    original = backend.TorchDevice._attention_value
    apply_sparpr(keep_ratio=0.5)
    apply_sparpr(keep_ratio=0.25)  # re-applying changes the knobs, wraps once
    assert backend.TorchDevice._attention_value is not original
    remove_sparpr()
    assert backend.TorchDevice._attention_value is original
    for bad in (dict(keep_ratio=0), dict(keep_ratio=1.5), dict(min_keep=0), dict(block_size=0),
                dict(recent_blocks=-1)):
        with pytest.raises(ValueError):
            apply_sparpr(**bad)
