"""The compiled pick (kv/policies/fused_pick.py, models/select_kernel.cpp) against the tensor path it
stands in for (`pick` + `selection_from_pick`): the same pick, the same blocks, readers and tokens
attended by every sequence and head, and through the engine the same generated tokens."""
from __future__ import annotations

import math

import pytest
import torch

from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.kv.policies import fused_pick, selection
from flexgen_sparpr.kv.policies.selection import selection_from_pick
from flexgen_sparpr.weights.resolve import resolve_source

from tests.kv.test_selection_fused import attended, make, prefilled
from tests.models.test_cpu_kernel import needs_kernel


@needs_kernel
@pytest.mark.parametrize("name", ["lowrank-softmax", "lowrank-sum", "mean-softmax", "quest"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("keep", [0.5, 0.2, 0.1])
def test_the_compiled_pick_is_the_tensor_pick(name, batch, keep):
    pol = make(name, keep)
    t = prefilled(pol, batch, [0] * batch, n=61, seed=batch + len(name))
    gen = torch.Generator().manual_seed(7)
    _, _, hkv, _, d = t.block_shape
    served = 0
    for step in range(6):  # across a block boundary: the open block fills, seals, opens again
        q = torch.randn(batch, hkv * 2, 1, d, generator=gen)
        view = pol.step_view(t)
        score = pol.block_scores(t, 0, q, view)
        room = pol.room(t, view, pol.keep_target(t, q)[0])
        fused = fused_pick.fused_selection(t, score, view, room)
        if score.dim() == 3:  # Quest scores each KV head: the tensor path serves
            assert fused is None
        else:
            served += 1
            pick, sel = fused
            want_pick = pol.pick(t, score, view, room)
            want = selection_from_pick(t, want_pick, view)
            assert torch.equal(pick, want_pick)
            assert (sel.blocks, sel.nseq) == (want.blocks, want.nseq)
            col = want_pick.any(dim=0)  # col: [nb] the blocks some sequence reads
            spans = int((col[1:] & ~col[:-1]).sum() + col[:1].sum())
            assert sel.counted == (spans, int((view.counts * want_pick).sum() + view.open_tokens))  # the statistics'
            assert attended(t, sel, [0] * batch) == attended(t, want, [0] * batch)
            if batch > 1:
                assert torch.equal(sel.seqs, want.seqs) and torch.equal(sel.rows, want.rows)
                assert torch.equal(sel.mask, want.mask)
            else:
                assert sel.mask is None and torch.equal(sel.rows[0], t.positions(sel.blocks))
        kv = torch.randn(batch, hkv, 1, d, generator=gen)
        for job in t.append(kv, kv):
            job()
    assert served == (0 if name == "quest" else 6)


@needs_kernel
def test_ties_and_never_picked_blocks_fall_as_torch_topk_lets_them():
    # equal scores (a softmax that underflowed to 0 far from the query), -inf blocks, own blocks
    kernel = fused_pick.compiled_kernel()
    for trial in range(30):
        gen = torch.Generator().manual_seed(trial)
        score = torch.randint(0, 3, (4, 37), generator=gen).float()
        score[:, 4] = -math.inf
        own = torch.zeros(4, 37, dtype=torch.bool)
        own[:, 0] = own[:, -2:] = True
        for k in (0, 3, 20, 40):
            pick = kernel.pick_rows(score, own, k, 16, 37 * 16 + 5)[0]
            want = selection.top_pick(score, k, own)
            assert torch.equal(pick, want), (trial, k)


@needs_kernel
@pytest.mark.parametrize("name", ["lowrank-softmax", "mean-softmax"])
@pytest.mark.parametrize("prompts", [[list(range(3, 43)), list(range(50, 90))], [list(range(3, 43))]],
                         ids=["batch", "one-sequence"])
def test_the_compiled_pick_generates_the_tensor_paths_tokens(name, prompts, tiny_llama_dir, tmp_path, monkeypatch):
    served = []

    def counted(*a):
        out = fused_pick.fused_selection(*a)
        served.append(out is not None)
        return out

    def tokens(tensor_path: bool) -> tuple[list[list[int]], list]:
        """The generated tokens, and the statistics' spans and tokens read at each step."""
        monkeypatch.setattr(selection, "fused_selection", (lambda *a: None) if tensor_path else counted)
        eng = Engine(resolve_source(str(tiny_llama_dir), ""), Policy(gpu_batch_size=len(prompts)),
                     EngineConfig(device="cpu", block_size=4, offload_dir=str(tmp_path)))
        try:
            pol = make(name, 0.3)
            eng.set_kv_policy(pol)
            out = eng.generate(prompts, 12).tokens
            return out, [(s["spans"], s["tokens_read"]) for s in pol.stats()["steps"]]
        finally:
            eng.close()

    assert tokens(False) == tokens(True)
    assert served and all(served)  # the compiled pick served every selecting step
