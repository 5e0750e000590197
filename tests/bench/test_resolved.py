"""api/resolved.py: the configuration every results file records, as the engine resolved it."""
from __future__ import annotations

from flexgen_sparpr.api.llm import LLM
from flexgen_sparpr.api.resolved import resolved


def test_resolved_names_the_defaults_and_the_policy_knobs(smollm2_dir):
    with LLM("smollm2-135m", quiet=True, kv_policy="sparpr", keep_ratio=0.1, gpu_batch_size=2) as llm:
        got = resolved(llm, {"quest@0.5": llm.engine.kv_policy})
    assert got["block_size"] == 16 and got["compute_dtype"] == "float32" and got["device"] == "cpu"
    assert got["weight_format"].startswith("auto: ") and got["kv_dtype"] == "float16"
    assert got["placement"]["gpu_batch_size"] == 2 and sum(got["placement"]["kv"]) == 100
    sparpr = got["kv_policy"]
    assert sparpr["name"] == "sparpr" and sparpr["keep_ratio"] == 0.1 and sparpr["summary"] == "lowrank"
    assert {"min_keep", "gamma", "recent_blocks", "summary_rank"} <= set(sparpr)
    assert got["compared"]["quest@0.5"]["name"] == "sparpr"  # each compared label with its own knobs
