"""SparPR's low-rank codes scored by the CPU int4 kernel (kv/policies/sparpr_int4.py) against the
float path it stands in for: the same logits to bfloat16's precision as the codes grow a block at
a time and after a rewind, the same block scores, the same selection where scores are not near-ties,
and through the engine the same greedy tokens."""
from __future__ import annotations

import pytest
import torch

from flexgen_sparpr.kv.policies import sparpr_int4
from flexgen_sparpr.kv.policies.sparpr_int4 import PackedCodes, kernel_tile
from flexgen_sparpr.kv.policies.sparpr_lowrank import encode, fit_basis, lowrank_block_scores

pytestmark = pytest.mark.skipif(kernel_tile() is None, reason="this torch has no CPU int4 kernel that packs in tiles")


def codes_of(b, hkv, t, d, r, seed):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, hkv, t, d, generator=gen)  # keys: [B, Hkv, T, D]
    basis = fit_basis(keys, torch.ones(b, t, dtype=torch.bool), r)
    return keys, basis, encode(keys, basis).mT.contiguous()  # codes: [B, Hkv, r / 2, T], tokens innermost


def float_logits(qs, codes):
    """qs: [B, Hkv, G, r]; codes: [B, Hkv, r / 2, T] -> [B, Hkv, G, T] = qs . (c - 8), in float32."""
    dirs = torch.stack([codes & 15, codes >> 4], dim=3).flatten(2, 3).float() - 8  # dirs: [B, Hkv, r, T]
    return torch.matmul(qs, dirs)


def test_packed_logits_follow_the_codes_as_blocks_seal_and_after_a_rewind():
    b, hkv, g, r, bs = 2, 3, 3, 32, 16
    _, _, codes = codes_of(b, hkv, 400, 64, r, 0)
    packed = PackedCodes.empty(b * hkv, 400, r, torch.device("cpu"))
    qs = torch.randn(b, hkv, g, r, generator=torch.Generator().manual_seed(1))
    store = torch.zeros_like(codes)  # what the summaries hold so far
    for sealed in (bs, 3 * bs, 4 * bs, 9 * bs, 25 * bs):  # across tile boundaries and inside tiles
        store[..., :sealed] = codes[..., :sealed]
        packed.sync(store[..., :sealed], sealed, rewinds=0)
        want = float_logits(qs, store[..., :sealed])
        got = packed.logits(qs, sealed).float()  # the kernel's bfloat16, widened to compare
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    # a rewind: the same token count now holds other codes; the next sync packs them again
    other = codes.flip(-1).contiguous()
    packed.sync(other[..., :25 * bs], 25 * bs, rewinds=1)
    want = float_logits(qs, other[..., :25 * bs])
    torch.testing.assert_close(packed.logits(qs, 25 * bs).float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


@pytest.mark.parametrize("head_score", ["softmax", "sum"])
def test_block_scores_match_the_float_path(head_score):
    b, hkv, g, d, bs, nb = 2, 3, 3, 64, 16, 24
    keys, basis, codes = codes_of(b, hkv, nb * bs, d, d // 2, 2)
    q = torch.randn(b, hkv * g, 1, d, generator=torch.Generator().manual_seed(3))
    packed = PackedCodes.empty(b * hkv, nb * bs, d // 2, torch.device("cpu"))
    packed.sync(codes, nb * bs, 0)
    want = lowrank_block_scores(q, codes, basis, bs, head_score)
    got = lowrank_block_scores(q, codes, basis, bs, head_score, packed=packed)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    # the top quarter of the blocks is the same wherever the float scores are not a near-tie
    k = nb // 4
    gap = want.sort(dim=-1, descending=True).values
    clear = (gap[:, k - 1] - gap[:, k]) > 0.05 * gap[:, 0].abs()
    for s in range(b):
        if clear[s]:
            assert set(got[s].topk(k).indices.tolist()) == set(want[s].topk(k).indices.tolist())


def test_the_path_is_taken_where_it_applies():
    cpu = torch.device("cpu")
    assert sparpr_int4.applies(cpu, 32, torch.float32)
    assert sparpr_int4.applies(cpu, 64, torch.bfloat16)
    assert not sparpr_int4.applies(cpu, 16, torch.float32)  # r is not a whole group
    assert not sparpr_int4.applies(cpu, 32, torch.float16)
    assert not sparpr_int4.applies(torch.device("meta"), 32, torch.float32)


@pytest.mark.slow
def test_smollm2_greedy_tokens_are_those_of_the_float_path(monkeypatch, smollm2_dir):
    """SmolLM2 (r = 32: the kernel path) at keep 0.1 on a 600-token prompt: the same greedy tokens
    as with the codes scored in float."""
    from flexgen_sparpr.api.llm import LLM

    from flexgen_sparpr.kv.policies import sparpr as sparpr_policy
    monkeypatch.setattr(sparpr_policy, "kernel_scores", lambda *a: False)  # the torch paths, not the compiled one
    prompt = [list(range(1000, 1600))]
    runs = {}
    orig = sparpr_policy.synced_codes
    for name, int4 in (("int4", True), ("float", False)):
        if not int4:
            monkeypatch.setattr(sparpr_int4, "applies", lambda *a: False)
        with LLM("smollm2-135m", kv_policy="sparpr", keep_ratio=0.1, quiet=True) as llm:
            used = []
            monkeypatch.setattr(sparpr_policy, "synced_codes",
                                lambda cache, t, c: used.append(orig(cache, t, c)) or used[-1])
            runs[name] = llm.generate(prompt, max_new_tokens=12, stop=None)[0].token_ids
            assert any(p is not None for p in used) == int4
    assert len(runs["int4"]) == 12 and runs["int4"] == runs["float"]
