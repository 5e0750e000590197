"""--kv-dtype: raw KV blocks on the CPU and disk tiers stored compactly (float16 by default),
computed in the compute dtype. The tolerance is stated here: teacher-forced logits against HF
(float32 everywhere) within 2e-3 of the logit scale on tiny random models, greedy tokens equal to
the exact run on the real model, and exactly half the offloaded bytes."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flexgen_sparpr.config.prompts import load_tokenizer, text_ids
from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.errors import ConfigError
from flexgen_sparpr.storage.tiers import Devices
from flexgen_sparpr.weights.resolve import resolve_source
from tests.engine.test_vs_hf import C_DISK, C_SPLIT, LONG, MIXED, forced_logits, hf_greedy, run_engine

PLACEMENTS = {"cache-30-30-40": C_SPLIT, "cache-all-disk": C_DISK,
              "cache-all-cpu": dict(cache_gpu_percent=0, cache_cpu_percent=100)}


@pytest.fixture
def tiers(request, monkeypatch):
    """The placement's policy kwargs; the CPU tier kept apart from compute (as on a CUDA machine:
    on a CPU-only one it is the compute memory, where KV stays in the compute dtype)."""
    monkeypatch.setattr(Devices, "effective", lambda self, tier: tier)
    return PLACEMENTS[request.param]


def test_auto_stores_offloaded_kv_in_half_precision():
    cfg = EngineConfig()
    assert cfg.torch_kv_dtype(torch.float32) == torch.float16
    assert cfg.torch_kv_dtype(torch.bfloat16) == torch.bfloat16
    assert EngineConfig(kv_dtype="float32").torch_kv_dtype(torch.float32) == torch.float32
    with pytest.raises(ConfigError, match="--kv-dtype"):
        EngineConfig(kv_dtype="int8")


@pytest.mark.parametrize("tiers", list(PLACEMENTS), indirect=True)
def test_float16_kv_logits_within_tolerance_of_hf(tiny_model_dir, tmp_path, tiers):
    src = resolve_source(str(tiny_model_dir), "")
    ref_tokens, ref_logits = hf_greedy(tiny_model_dir, LONG)
    err = {}
    for kvd in ("float32", "float16"):
        eng = Engine(src, Policy(gpu_batch_size=2, **tiers),
                     EngineConfig(block_size=4, dtype="float32", kv_dtype=kvd, offload_dir=str(tmp_path / kvd)))
        try:
            got = forced_logits(eng, LONG, ref_tokens)  # fed HF's tokens: comparable step by step
        finally:
            eng.close()
        err[kvd] = float((got - ref_logits).abs().max() / ref_logits.abs().max())
    assert err["float32"] < 1e-5, err  # exact storage: HF's float32 numbers
    assert err["float32"] < err["float16"] < 2e-3, err  # the blocks really went through float16


@pytest.mark.parametrize("tiers", ["cache-all-disk", "cache-all-cpu"], indirect=True)
def test_float16_kv_moves_half_the_bytes(tiny_opt_dir, tmp_path, tiers):
    src = resolve_source(str(tiny_opt_dir), "")
    links = {}
    for kvd in ("float32", "float16"):
        *_, links[kvd] = run_engine(src, Policy(gpu_batch_size=2, **tiers), tmp_path / kvd, MIXED,
                                    block_size=4, dtype="float32", kv_dtype=kvd)
    moved = [k for k, v in links["float32"].items() if v and k != "disk->compute"]
    assert moved
    for link in moved:
        assert links["float16"][link] * 2 == links["float32"][link], (link, links)


@pytest.mark.slow
def test_real_model_greedy_tokens_equal_with_float16_kv(smollm2_dir, tmp_path):
    """SmolLM2, KV on disk, a ~1.5k-token passage with a passkey: the default float16 storage picks
    the same greedy tokens as float32."""
    src = resolve_source(str(smollm2_dir), "")
    text = (Path(__file__).parents[1] / "data" / "plrabn12.txt").read_text()[20000:26000]
    cut = len(text) // 2
    text = text[:cut] + " The passkey is 58213. Remember it. " + text[cut:] + "\nWhat is the passkey? The passkey is"
    ids = [text_ids(load_tokenizer(src.tokenizer_dir), text, chat=False, vocab=src.spec.vocab)]
    toks = {}
    for kvd in ("float32", "float16"):
        toks[kvd], *_ = run_engine(src, Policy(gpu_batch_size=1, **C_DISK), tmp_path / kvd, ids, n=16,
                                   block_size=16, dtype="float32", kv_dtype=kvd)
    assert toks["float16"] == toks["float32"]
