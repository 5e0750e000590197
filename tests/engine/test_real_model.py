"""The real SmolLM2 through every weight source the engine reads (slow: needs `make prepare`)."""
import pytest
import torch

from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.weights.resolve import resolve_source

pytestmark = pytest.mark.slow


def _generate(src, tmp_path):
    prompt = list(range(1000, 1100))
    with Engine(src, Policy(gpu_batch_size=1), EngineConfig(offload_dir=str(tmp_path))) as eng:
        return eng.generate([prompt], 6, keep_logits=True)


def test_gguf_file_equals_prepared_dir(smollm2_dir, tmp_path):
    gguf = next(smollm2_dir.glob("*.gguf"))
    a = _generate(resolve_source(str(gguf), ""), tmp_path)
    b = _generate(resolve_source("smollm2-135m", ""), tmp_path)
    assert a.tokens == b.tokens
    assert max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits)) < 1e-4


def test_dummy_smollm2_has_the_real_shapes(smollm2_dir):
    real, dummy = resolve_source("smollm2-135m", ""), resolve_source("smollm2-135m", "_DUMMY_")
    assert dummy.spec == real.spec.__class__(**{**real.spec.__dict__, "name": dummy.spec.name})
    name = "model.layers.3.self_attn.k_proj.weight"
    assert dummy.get(name).shape == real.get(name).shape
    assert not torch.equal(dummy.get(name), real.get(name))
