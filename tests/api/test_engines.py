"""api/engines.py, the engine one floor below LLM that the benchmarks use: an engine set field by
field decodes a prefill's snapshot as often as asked, each time as the first decode did, and under
another KV policy that observed the prefill; its settings and placement are the engine's own."""
from __future__ import annotations

import torch

from flexgen_sparpr.api.engines import engine_config, greedy, open_engine, placement
from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.kv.policies import make_policy
from flexgen_sparpr.weights.resolve import resolve_source

torch.manual_seed(0)
PROMPTS = torch.randint(4, 300, (2, 24)).tolist()


def test_settings_and_placement_are_the_engines():
    assert engine_config() == EngineConfig() and placement() == Policy()
    assert engine_config(block_size=8, kv_policy="dkv") == EngineConfig(block_size=8, kv_policy="dkv")
    assert placement(gpu_batch_size=3) == Policy(gpu_batch_size=3)
    assert greedy()(torch.tensor([[0.0, 2.0, 1.0]])).tolist() == [1]


def test_one_prefill_decodes_again_and_under_an_observer(tiny_llama_dir):
    src = resolve_source(str(tiny_llama_dir), "")
    with open_engine(src, {"gpu_batch_size": 2}, block_size=8) as eng:
        want = eng.generate(PROMPTS, 6).tokens
    sparpr = make_policy("sparpr", keep_ratio=1.0)
    with open_engine(src, {"gpu_batch_size": 2}, block_size=8) as eng:
        snap = eng.snapshot(eng.prefill(PROMPTS, 6, greedy(), observers=(sparpr,)))
        assert eng.decode(eng.restore(snap)).tokens == want
        assert eng.decode(eng.restore(snap)).tokens == want  # the snapshot is untouched by a decode
        eng.set_kv_policy(sparpr, attach=False)
        assert eng.decode(eng.restore(snap)).tokens == want  # keep 1 reads every block
