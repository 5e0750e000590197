"""A live `flexgen-sparpr serve` on 127.0.0.1 (a free port), and a tiny random Llama that speaks
through SmolLM2's tokenizer and chat template (so chat works and answers come fast): the tests need
the prepared SmolLM2 for its tokenizer (tests/conftest.py's smollm2_dir: skipped without it,
failed under `make test`)."""
from __future__ import annotations

import shutil

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_chat_dir(smollm2_dir, tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                      intermediate_size=128, vocab_size=49152, max_position_embeddings=512, rope_theta=10000.0,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, initializer_range=0.3)
    d = tmp_path_factory.mktemp("tiny-chat")
    LlamaForCausalLM(cfg).eval().save_pretrained(d)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2_dir / name, d / name)
    return d
