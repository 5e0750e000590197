"""bench/membound.py: the bytes a decode step must read and the memory bandwidth it is set
against (the llama.cpp benchmark's step / floor column)."""
from __future__ import annotations

import pytest

from flexgen_sparpr.api.llm import LLM
from flexgen_sparpr.bench.membound import read_bandwidth, sparpr_code_bytes, step_bytes, weight_bytes


def _spec_bytes(s, per_weight: int) -> int:
    """Every weight a step multiplies, from the model's shapes alone: per layer q|k|v, o, gate, up,
    down and two norms; the final norm and the (tied) LM head."""
    qkv = s.hidden * (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    layer = qkv + s.num_heads * s.head_dim * s.hidden + 3 * s.hidden * s.ffn
    return (s.num_layers * layer + s.vocab * s.hidden) * per_weight + (2 * s.num_layers + 1) * s.hidden * 4


def test_step_bytes_of_float32_weights_match_the_model_shapes(smollm2_dir):
    with LLM("smollm2-135m", weight_format="raw", quiet=True) as llm:
        s = llm.spec
        assert weight_bytes(llm) == _spec_bytes(s, 4)  # the embedding lookup's table is not read whole
        got = step_bytes(llm, context=1000, batch=2, keep=0.25, code_bytes=16)
    per_token = s.num_layers * 2 * s.num_kv_heads * s.head_dim * 4
    assert got["kv"] == int(0.25 * 1000 * 2 * per_token)
    assert got["codes"] == 1000 * 2 * s.num_layers * s.num_kv_heads * 16


def test_int4_weights_read_about_an_eighth(smollm2_dir):
    with LLM("smollm2-135m", weight_format="int4", quiet=True) as llm:
        packed, raw = weight_bytes(llm), _spec_bytes(llm.spec, 4)
    assert raw / 8 < packed < raw / 4  # 4-bit codes plus a scale and minimum per 32 (the head in 8 bits)


def test_sparpr_code_bytes_follow_the_summary():
    assert sparpr_code_bytes({"summary": "auto", "summary_rank": 0.5, "summaries_on": "compute"}, 64) == 16
    assert sparpr_code_bytes({"summary": "lowrank", "summary_rank": 0.25, "summaries_on": "cpu"}, 64) == 8
    assert sparpr_code_bytes({"summary": "auto", "summary_rank": 0.5, "summaries_on": "cpu"}, 64) == 0  # mean keys
    assert sparpr_code_bytes({"summary": "mean", "summary_rank": 0.5}, 64) == 0
    assert sparpr_code_bytes(None, 64) == 0


def test_read_bandwidth_is_a_rate():
    bw = read_bandwidth(1, nbytes=64 << 20)
    assert 1e8 < bw < 1e13  # bytes/s: between 0.1 GB/s and 10 TB/s on any machine
