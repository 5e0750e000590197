"""SparPR's measured step fallback (kv/policies/sparpr_steps.py): which decode steps read densely,
from the step seconds the engine reports; and, in the engine, that such a step reads and attends
the cache exactly as the dense policy does."""
from __future__ import annotations

import pytest
import torch

from flexgen_sparpr.engine import cell
from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.kv.policies import make_policy
from flexgen_sparpr.kv.policies.sparpr_steps import MAX_RECHECK, RECHECK, SAMPLES, SETTLE, StepModes
from flexgen_sparpr.models import cpu_kernel
from flexgen_sparpr.weights.resolve import resolve_source
from tests.engine.test_resident_split import HALF, llama64_dir  # noqa: F401 (a fixture)
from tests.engine.test_vs_hf import LONG, forced_logits, hf_greedy

pytestmark = pytest.mark.step_fallback  # the real StepModes (tests/conftest.py pins it elsewhere)
TRIAL = SETTLE + SAMPLES


def run(modes: StepModes, start: int, n: int, sparse_s: float, dense_s: float, floor_s: float | None = None) -> list[bool]:
    """n steps from context length `start`, each timed as its mode costs (a sparse one with the dense
    floor floor_s); the modes they ran."""
    out = []
    for length in range(start, start + n):
        dense = modes.dense(length)
        assert modes.dense(length) == dense  # every layer of a step gets the same answer
        modes.record(length, dense_s if dense else sparse_s, None if dense else floor_s)
        out.append(dense)
    return out


def test_a_run_times_both_modes_then_keeps_the_faster():
    modes = StepModes(gamma=0.9)
    got = run(modes, 100, 2 * TRIAL + RECHECK, sparse_s=0.05, dense_s=0.03)
    assert got[:TRIAL] == [False] * TRIAL and got[TRIAL:2 * TRIAL] == [True] * TRIAL
    assert got[2 * TRIAL:] == [True] * RECHECK  # sparse slower: dense from then on
    modes = StepModes(gamma=0.9)
    got = run(modes, 100, 2 * TRIAL + RECHECK, sparse_s=0.02, dense_s=0.05)
    assert got[2 * TRIAL:] == [False] * RECHECK  # sparse faster: sparse
    assert modes.report()["chosen"] == "sparse" and modes.dense_steps == TRIAL


def test_no_dense_step_is_timed_where_its_reads_alone_cost_more_than_a_sparse_step():
    """The disk bytes of a dense step over the measured bandwidth bound it from below: a sparse step
    under gamma x that bound needs no dense step timed, now or at the rechecks."""
    modes = StepModes(gamma=0.9)
    assert not any(run(modes, 0, TRIAL + 3 * RECHECK, sparse_s=0.02, dense_s=0.01, floor_s=0.05))
    assert modes.report()["chosen"] == "sparse" and modes.dense_steps == 0
    modes = StepModes(gamma=0.9)  # a floor under the sparse step: dense is timed, and here wins
    got = run(modes, 0, 2 * TRIAL + 1, sparse_s=0.02, dense_s=0.01, floor_s=0.015)
    assert got[TRIAL:] == [True] * (TRIAL + 1)


def test_gamma_prefers_dense_by_its_margin():
    """The paper's rule, on measured steps: dense while sparse costs more than gamma x dense."""
    for gamma, chosen in ((0.9, "sparse"), (0.8, "dense")):
        modes = StepModes(gamma=gamma)
        run(modes, 0, 2 * TRIAL + 1, sparse_s=0.085, dense_s=0.1)  # sparse at 0.85x dense
        assert modes.report()["chosen"] == chosen


def test_the_other_mode_is_timed_again_and_the_choice_can_change():
    modes = StepModes(gamma=1.0)
    run(modes, 0, 2 * TRIAL, sparse_s=0.02, dense_s=0.05)  # sparse chosen
    assert run(modes, 2 * TRIAL, RECHECK, sparse_s=0.08, dense_s=0.05) == [False] * RECHECK  # then it got slower
    again = run(modes, 2 * TRIAL + RECHECK, TRIAL + 1, sparse_s=0.08, dense_s=0.05)
    assert again[:TRIAL] == [True] * TRIAL  # dense timed again
    assert again[TRIAL] is True and modes.switches == 1  # and chosen


def test_a_choice_that_holds_is_checked_less_often():
    modes = StepModes(gamma=1.0)
    got = run(modes, 0, 2 * TRIAL + RECHECK + TRIAL + 2 * RECHECK + TRIAL, sparse_s=0.02, dense_s=0.05)
    dense_at = [i for i, d in enumerate(got) if d]
    second = 2 * TRIAL + RECHECK
    third = second + TRIAL + 2 * RECHECK  # the recheck doubled
    assert dense_at == [*range(TRIAL, 2 * TRIAL), *range(second, second + TRIAL), *range(third, third + TRIAL)]
    assert RECHECK < MAX_RECHECK


def test_a_length_that_does_not_follow_starts_a_new_run():
    modes = StepModes(gamma=0.9)
    run(modes, 500, 2 * TRIAL + 3, sparse_s=0.05, dense_s=0.03)  # dense chosen
    assert run(modes, 10, TRIAL, sparse_s=0.05, dense_s=0.03) == [False] * TRIAL  # a new prompt: timed afresh
    assert modes.report()["last_timed_s"]["dense"] == []


def test_untimed_steps_and_unknown_lengths_are_not_recorded():
    modes = StepModes(gamma=0.9)
    modes.record(7, 1.0)  # never decided: ignored
    run(modes, 0, SETTLE, sparse_s=9.0, dense_s=9.0)  # the settling step: not timed
    assert modes.report()["last_timed_s"] == {"sparse": [], "dense": []}


class _Always:
    """StepModes' interface, every step one mode."""

    def __init__(self, dense: bool):
        self.is_dense, self.asked = dense, []

    def dense(self, length):
        self.asked.append(length)
        return self.is_dense

    def record(self, length, seconds, dense_floor_s=None):
        pass

    def report(self):
        return {}


def steps_against_dense(model_dir, tmp_path, percents: dict, runs: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """Teacher-forced logits of the dense policy, of SparPR with every step given to dense and with
    every step sparse (keep 0.1), the cache placed by `percents` (Policy's); and the dense-step
    SparPR's statistics (after asserting it was asked). runs[-1]: the run going on ("dense",
    "sparpr", "sparse")."""
    src = resolve_source(str(model_dir), "")
    ref_tokens, _ = hf_greedy(model_dir, LONG)

    def logits(tag, policy=None):
        runs.append(tag)
        eng = Engine(src, Policy(gpu_batch_size=2, **percents),
                     EngineConfig(block_size=4, dtype="float32", kv_dtype="float32", offload_dir=str(tmp_path / tag)))
        try:
            if policy is not None:
                eng.set_kv_policy(policy)
            return forced_logits(eng, LONG, ref_tokens)
        finally:
            eng.close()
    out = [logits("dense")]
    for tag, dense in (("sparpr", True), ("sparse", False)):
        pol = make_policy("sparpr", keep_ratio=0.1, min_keep_tokens=0)
        pol.step_modes = _Always(dense)
        out.append(logits(tag, pol))
        if dense:
            assert pol.step_modes.asked
            stats = pol.stats()
    return (*out, stats)


@pytest.mark.skipif(cpu_kernel.kernel() is None, reason="the dense read of a split cache goes through the compiled "
                    "CPU kernel, which is not built on this machine")
def test_a_dense_step_of_sparpr_reads_and_attends_as_the_dense_policy(llama64_dir, tmp_path, monkeypatch):  # noqa: F811
    """Half the KV on disk: SparPR's steps given to dense read the resident blocks in place and the disk
    ones where they land (the dense policy's path), with the dense policy's logits exactly."""
    runs, splits = [], []
    real = cell.with_resident_blocks
    monkeypatch.setattr(cell, "with_resident_blocks", lambda t, resident, *a: runs[-1] == "sparpr" and
                        splits.append(len(resident)) or real(t, resident, *a))
    dense, got, sparse, stats = steps_against_dense(llama64_dir, tmp_path, HALF, runs)
    assert splits and min(splits) > 0  # read as dense reads
    torch.testing.assert_close(got, dense, rtol=0, atol=0)
    assert stats["totals"]["effective_keep"] == 1.0
    assert not torch.equal(sparse, dense)  # the sparse steps read less (the test can fail)


@pytest.mark.skipif(cpu_kernel.kernel() is None, reason="a resident cache is read in place by the compiled CPU "
                    "kernel, which is not built on this machine")
def test_a_dense_step_of_a_resident_cache_reads_it_in_place_as_dense(llama64_dir, tmp_path, monkeypatch):  # noqa: F811
    """Nothing offloaded: SparPR's steps given to dense copy nothing (no gather, prefetched or not)
    and give the dense policy's logits exactly; its sparse steps differ (the test can fail)."""
    runs, gathers = [], []
    real = cell.gather_selection
    monkeypatch.setattr(cell, "gather_selection", lambda *a, **k: gathers.append(runs[-1]) or real(*a, **k))
    dense, got, sparse, stats = steps_against_dense(llama64_dir, tmp_path, {}, runs)
    assert "sparpr" not in gathers
    torch.testing.assert_close(got, dense, rtol=0, atol=0)
    assert stats["totals"]["effective_keep"] == 1.0
    assert not torch.equal(sparse, dense)
