"""A selection from a resident cache attended where it lies (engine/cell.py `reads_rows`: the
compiled CPU kernel reads the picked rows of the arena, no gather) against the gather it replaces:
the same greedy tokens for every policy that selects blocks, one sequence and a left-padded batch."""
from __future__ import annotations

import pytest
import torch

from flexgen_sparpr.engine.cell import KVReader
from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.kv.policies import resolve
from flexgen_sparpr.weights.resolve import resolve_source

from tests.models.test_cpu_kernel import needs_kernel


@pytest.fixture(scope="module")
def head64_llama_dir(tmp_path_factory):
    """A tiny llama with the kernel's head size (64) and 2 query heads per KV head."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                      intermediate_size=256, vocab_size=300, max_position_embeddings=512, head_dim=64,
                      rope_theta=10000.0, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("head64-llama")
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    return path


@needs_kernel
@pytest.mark.parametrize("name, knobs", [("sparpr", {"keep_ratio": 0.3, "min_keep_tokens": 0}), ("quest", {"keep_ratio": 0.3, "min_keep_tokens": 0, "dense_layers": 0}),
                                         ("streaming-llm", {"keep_ratio": 0.3, "min_keep_tokens": 0})])
@pytest.mark.parametrize("prompts", [[list(range(3, 90))], [list(range(3, 90)), list(range(50, 110))]],
                         ids=["one-sequence", "padded-batch"])
def test_rows_read_in_place_generate_the_gathered_tokens(name, knobs, prompts, head64_llama_dir, tmp_path,
                                                          monkeypatch):
    def tokens(in_place: bool) -> tuple[list[list[int]], int]:
        taken = []
        real = KVReader.reads_rows
        monkeypatch.setattr(KVReader, "reads_rows",
                            lambda self, *a: in_place and (taken.append(1) or True) and real(self, *a))
        eng = Engine(resolve_source(str(head64_llama_dir), ""), Policy(gpu_batch_size=len(prompts)),
                     EngineConfig(device="cpu", block_size=8, offload_dir=str(tmp_path)))
        try:
            eng.set_kv_policy(resolve(name, knobs))
            return eng.generate(prompts, 12).tokens, len(taken)
        finally:
            eng.close()
            monkeypatch.setattr(KVReader, "reads_rows", real)  # its own patch only (conftest's stay)

    (rows, n_rows), (gathered, n_gathered) = tokens(True), tokens(False)
    assert n_gathered == 0 and (n_rows > 0 or name == "streaming-llm")
    assert rows == gathered
