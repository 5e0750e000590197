"""RowSampler: the rows of one batch choose apart (a server's requests): greedy rows take the
argmax, a sampled row's draws depend on its own seed alone, and asked log-probabilities are the
model's (log_softmax of the logits) for the chosen token and the top N."""
from __future__ import annotations

import torch

from flexgen_sparpr.engine.sampling import RowSampler, Sampler


def test_rows_choose_apart_and_a_seeded_row_ignores_its_neighbours():
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(4, 50, generator=g) for _ in range(6)]  # 6 steps of [B, V]
    mixed = RowSampler([Sampler(), Sampler(True, 0.8, 0.9, 7), Sampler(True, 1.0, 1.0, 3), Sampler()])
    alone = RowSampler([Sampler(True, 0.8, 0.9, 7)])
    other = RowSampler([Sampler(True, 0.8, 0.9, 8)])
    got = torch.stack([mixed(x) for x in logits])  # [steps, B]
    assert torch.equal(got[:, 0], torch.stack([x[0].argmax() for x in logits]))
    assert torch.equal(got[:, 3], torch.stack([x[3].argmax() for x in logits]))
    assert torch.equal(got[:, 1], torch.stack([alone(x[1:2])[0] for x in logits]))  # same seed, same draws
    assert not torch.equal(got[:, 1], torch.stack([other(x[1:2])[0] for x in logits]))


def test_logprobs_are_the_models_for_the_chosen_and_the_top_n():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 0.0]])  # [B=2, V=4]
    s = RowSampler([Sampler(), Sampler()], [2, None])
    assert s(logits).tolist() == [1, 0]
    lp = torch.log_softmax(logits[0], -1)
    (chosen, top), = s.logprobs[0]
    assert abs(chosen - lp[1].item()) < 1e-6 and [i for i, _ in top] == [1, 2]
    assert abs(top[1][1] - lp[2].item()) < 1e-6 and s.logprobs[1] == []
