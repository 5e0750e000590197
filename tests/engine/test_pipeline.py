"""Pipeline parallelism (engine/pipeline.py): 2 and 3 stages over gloo give the single-process
run's tokens (logits within float32 tolerance) and HF's, for OPT and Llama, dense and SparPR,
with every KV block on disk; seeded sampling too. One launch per world size runs the matrix."""
from __future__ import annotations

import pytest
import torch

from flexgen_sparpr.engine.config import ConfigError
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.engine.pipeline import Stage, schedule
from tests.dist_harness import N_NEW, SPARPR, engine_args, job, run_pipeline, save_tiny, single_process
from tests.hf_reference import hf_generate

JOBS = {
    "opt-dense-mb2": job("opt", 2, 2, 2),
    "opt-sparpr-mb2": job("opt", 2, 2, 2, kv=SPARPR, seed=2),
    "llama-dense-mb4": job("llama", 1, 4, 4, seed=3),
    "llama-sparpr-mb1": job("llama", 2, 2, 1, kv=SPARPR, seed=4),  # one micro-batch of two GPU batches
    "opt-sampled-mb2": job("opt", 2, 2, 2, sample=dict(do_sample=True, temperature=0.8, top_p=0.9, seed=7), seed=5),
}
# HF is the reference of greedy dense runs (a sparse policy reads part of the cache)
DENSE_GREEDY = [name for name, j in JOBS.items() if j["sample"] is None and j["kv"][0] == "dense"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return {kind: save_tiny(kind, tmp_path_factory.mktemp(f"tiny4-{kind}")) for kind in ("opt", "llama")}


@pytest.fixture(scope="module")
def reference(model_dirs, tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run
    try:
        off = tmp_path_factory.mktemp("ref-offload")
        return {name: single_process(j, model_dirs, off) for name, j in JOBS.items()}
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=[2, 3], ids=["2-stages", "3-stages"])
def pipeline(request, model_dirs, tmp_path_factory):
    world = request.param
    return world, run_pipeline(world, JOBS, model_dirs, tmp_path_factory.mktemp(f"pipe{world}"))


@pytest.mark.parametrize("name", list(JOBS))
def test_pipeline_equals_single_process(pipeline, reference, name):
    world, ranks = pipeline
    tokens, logits = reference[name]
    for r, res in enumerate(ranks):
        got_tokens, got_logits, left, stats = res[name]
        assert got_tokens == tokens, f"rank {r}"  # every rank holds the step's ids
        assert left == [], f"rank {r} left offload files: {left}"
        assert stats["steps"] == N_NEW
        if r < world - 1:
            assert got_logits is None  # only the last stage has the head
            assert stats["bytes_sent"] > 0
        else:
            torch.testing.assert_close(got_logits, logits)  # float32 tolerance
            assert stats["bytes_sent"] == 0
    # what crossed each boundary: the hidden states of every micro-batch of every step
    j = JOBS[name]
    rows, hid = len(j["prompts"]), 64
    plen = max(map(len, j["prompts"]))
    expect = rows * (plen + N_NEW - 1) * hid * 4
    assert [res[name][3]["bytes_sent"] for res in ranks[:-1]] == [expect] * (world - 1)
    assert [res[name][3]["bytes_received"] for res in ranks[1:]] == [expect] * (world - 1)


@pytest.mark.parametrize("name", DENSE_GREEDY)
def test_pipeline_equals_hf(pipeline, model_dirs, name):
    from transformers import AutoModelForCausalLM
    _, ranks = pipeline
    j = JOBS[name]
    model = AutoModelForCausalLM.from_pretrained(model_dirs[j["model"]], dtype=torch.float32).eval()
    src, _, _ = engine_args(j, model_dirs, model_dirs[j["model"]])
    ref_tokens, _ = hf_generate(model, j["prompts"], N_NEW, src.spec.pad_id)
    assert ranks[-1][name][0] == ref_tokens


# --- the schedule, in one process -----------------------------------------------------------
def test_schedule_orders_micro_batches():
    assert schedule(2, 2, 1) == [(0, 0), (0, 1), (1, 0), (1, 1)]  # FlexGen's order
    assert schedule(2, 2, 2) == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert schedule(2, 4, 2) == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]
    with pytest.raises(ValueError):
        schedule(2, 4, 3)


@pytest.mark.parametrize("micro_batches", [2, 4])
def test_micro_batch_order_changes_nothing(model_dirs, tmp_path, micro_batches):
    """The same run in micro-batch order, one process: the same tokens and logits."""
    j = job("opt", 1, 4, micro_batches, kv=SPARPR, seed=6)
    tokens, logits = single_process(j, model_dirs, tmp_path)
    with Engine(*engine_args(j, model_dirs, tmp_path), micro_batches=micro_batches) as eng:
        r = eng.generate(j["prompts"], N_NEW, keep_logits=True)
    assert r.tokens == tokens
    torch.testing.assert_close(torch.stack(r.logits), logits)


def test_micro_batches_must_divide_the_gpu_batches(model_dirs, tmp_path):
    with pytest.raises(ConfigError, match="do not divide"):
        Engine(*engine_args(job("opt", 1, 4, 1), model_dirs, tmp_path), micro_batches=3)


def test_stage_checks():
    with pytest.raises(ValueError):
        Stage(2, 2, 0, 1)
    s = Stage(1, 3, 2, 1)
    assert (s.is_first, s.is_last, s.layers) == (False, False, range(2, 3))
