"""What the benchmarks (bench/) take from the API beside LLM's own calls, as api/llm.py's
docstring lists it: an LLM on weights already resolved, a KV policy's fields without a flag
(policy_args), and llm.engine's calls: a prefill's snapshot decodes as often as asked, each time
as the first decode did, and under another KV policy that observed the prefill; api/measure.py's
PeakMemory and disk_bandwidth."""
from __future__ import annotations

import pytest
import torch

from flexgen_sparpr.api.llm import LLM
from flexgen_sparpr.bench.forced import greedy
from flexgen_sparpr.errors import ConfigError
from flexgen_sparpr.kv.policies import make_policy
from flexgen_sparpr.weights.resolve import resolve_source

torch.manual_seed(0)
PROMPTS = torch.randint(4, 300, (2, 24)).tolist()


def test_an_llm_on_resolved_weights_is_the_llm_of_their_folder(tiny_llama_dir, tmp_path):
    src = resolve_source(str(tiny_llama_dir), "")
    kw = dict(gpu_batch_size=2, block_size=8, offload_dir=str(tmp_path), quiet=True)
    with LLM(str(tiny_llama_dir), **kw) as a, LLM(src, **kw) as b:
        assert repr(b.engine_config) == repr(a.engine_config) and b.policy == a.policy and b.spec == a.spec
        assert b.generate_ids(PROMPTS, b.params(6, stop=None)) == a.generate_ids(PROMPTS, a.params(6, stop=None))
    for bad in ({"path": "x"}, {"max_seq_len": 64}):
        with pytest.raises(ConfigError, match="no path or max_seq_len with weights already resolved"):
            LLM(src, **bad)


def test_policy_args_set_a_policys_fields_without_a_flag(tiny_llama_dir, tmp_path):
    src = resolve_source(str(tiny_llama_dir), "")
    with LLM(src, kv_policy="sparpr", policy_args={"probe_dir": str(tmp_path), "keep_ratio": 0.25, "min_keep_tokens": 0}, quiet=True) as llm:
        pol = llm.engine.kv_policy
        assert (pol.name, pol.probe_dir, pol.keep_ratio) == ("sparpr", str(tmp_path), 0.25)


def test_one_prefill_decodes_again_and_under_an_observer(tiny_llama_dir, tmp_path):
    src = resolve_source(str(tiny_llama_dir), "")
    kw = dict(gpu_batch_size=2, block_size=8, offload_dir=str(tmp_path), quiet=True)
    with LLM(src, **kw) as llm:
        want = llm.engine.generate(PROMPTS, 6).tokens
    sparpr = make_policy("sparpr", keep_ratio=1.0)
    with LLM(src, **kw) as llm:
        eng = llm.engine
        snap = eng.snapshot(eng.prefill(PROMPTS, 6, greedy(), observers=(sparpr,)))
        assert eng.decode(eng.restore(snap)).tokens == want
        assert eng.decode(eng.restore(snap)).tokens == want  # the snapshot is untouched by a decode
        eng.set_kv_policy(sparpr, attach=False)
        assert eng.decode(eng.restore(snap)).tokens == want  # keep 1 reads every block


def test_greedy_forces_nothing():
    assert greedy()(torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]])).tolist() == [1, 0]


def test_the_measurements_are_the_engines_and_the_storages():
    from flexgen_sparpr.api.measure import PeakMemory, disk_bandwidth
    from flexgen_sparpr.engine.memory import PeakMemory as engine_peak
    from flexgen_sparpr.storage.disk_store import disk_bandwidth as storage_bandwidth
    assert PeakMemory is engine_peak and disk_bandwidth is storage_bandwidth
