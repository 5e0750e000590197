"""The Llama family's variants against HF transformers: Qwen2 (q/k/v biases), Llama with
attention_bias and mlp_bias, Mistral and Qwen2 with a sliding window (run while the context fits
the window, where it changes nothing; refused past it). Greedy tokens equal, logits within 1e-4,
with the weights and the KV cache split over the compute, CPU and disk tiers."""
from __future__ import annotations

import pytest
import torch

from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.errors import ConfigError
from flexgen_sparpr.weights.resolve import resolve_source
from tests.hf_reference import hf_generate

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]  # left padding of 8
N_NEW = 6
SPLIT = Policy(gpu_batch_size=2, w_gpu_percent=40, w_cpu_percent=30, cache_gpu_percent=30, cache_cpu_percent=30)
SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
             intermediate_size=128, vocab_size=300, max_position_embeddings=256)


def _make(kind: str, path, **extra):
    import transformers as tf
    cls = {"qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM), "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
           "llama": (tf.LlamaConfig, tf.LlamaForCausalLM)}[kind]
    torch.manual_seed(0)
    model = cls[1](cls[0](**SMALL, **extra)).eval()
    with torch.no_grad():  # biases are zero at init: make them matter (0.5 moves logits by ~1)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return model


FAMILIES = {
    "qwen2-qkv-bias": ("qwen2", {}),
    "llama-attention-bias": ("llama", {"attention_bias": True}),
    "llama-mlp-bias": ("llama", {"mlp_bias": True}),
    "mistral-window-fits": ("mistral", {"sliding_window": 32}),
    "qwen2-window-fits": ("qwen2", {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 0}),
}


@pytest.mark.parametrize("case", list(FAMILIES))
def test_family_matches_hf(case, tmp_path):
    kind, extra = FAMILIES[case]
    model = _make(kind, tmp_path / "m", **extra)
    src = resolve_source(str(tmp_path / "m"), "")
    if "bias" in case:
        assert any(n.endswith("bias") for n in src._index)  # the checkpoint really has biases
    ref_tokens, ref_logits = hf_generate(model, PROMPTS, N_NEW, src.spec.pad_id)
    with Engine(src, SPLIT, EngineConfig(block_size=4, offload_dir=str(tmp_path / "off"))) as eng:
        r = eng.generate(PROMPTS, N_NEW, keep_logits=True)
    assert r.tokens == ref_tokens
    torch.testing.assert_close(torch.stack(r.logits), ref_logits, rtol=0, atol=1e-4)


def test_biases_are_not_ignored(tmp_path):
    """The same Qwen2 checkpoint without its biases gives other logits: the test above can fail."""
    model = _make("qwen2", tmp_path / "m")
    src = resolve_source(str(tmp_path / "m"), "")
    ref_tokens, ref_logits = hf_generate(model, PROMPTS, N_NEW, src.spec.pad_id)
    import dataclasses
    src.spec = dataclasses.replace(src.spec, qkv_bias=False)
    with Engine(src, SPLIT, EngineConfig(block_size=4, offload_dir=str(tmp_path / "off"))) as eng:
        r = eng.generate(PROMPTS, N_NEW, keep_logits=True)
    assert (torch.stack(r.logits) - ref_logits).abs().max() > 0.05


def test_past_the_window_is_refused_not_approximated(tmp_path):
    _make("mistral", tmp_path / "m", sliding_window=8)
    src = resolve_source(str(tmp_path / "m"), "")
    assert src.spec.context_limit() == (8, "8-token sliding attention window")
    with Engine(src, SPLIT, EngineConfig(block_size=4, offload_dir=str(tmp_path / "off"))) as eng:
        with pytest.raises(ConfigError, match="11\\+6 tokens exceed m's 8-token sliding attention window"):
            eng.generate(PROMPTS, N_NEW)


def test_qwen2_window_only_binds_when_used(tmp_path):
    """Qwen2 stores a sliding_window it ignores unless use_sliding_window is set (as HF does)."""
    _make("qwen2", tmp_path / "m", sliding_window=8, use_sliding_window=False)
    assert resolve_source(str(tmp_path / "m"), "").spec.sliding_window is None
