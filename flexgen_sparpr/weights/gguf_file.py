"""Read a llama-architecture GGUF file into a HF-style config and state dict.

Tensors are dequantized to float32 and renamed to HF ``LlamaForCausalLM``
names; q/k rows are put back in HF's rotate_half RoPE layout.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

SUPPORTED_ARCHS = ("llama",)

# GGUF per-block tensor stem -> HF module path inside model.layers.{i}.
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")


def unpermute_rope_rows(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved -> rotate_half RoPE).

    llama.cpp's converter views each head's rows as [2, head_dim//2] (HF:
    first half / second half) and swaps them to [head_dim//2, 2] so that RoPE
    pairs sit next to each other. Going back is the opposite view and swap.
    """
    out_dim, in_dim = weight.shape
    half = out_dim // n_head // 2
    w = weight.reshape(n_head, half, 2, in_dim)  # w: [n_head, hd/2, 2, in]
    w = w.transpose(1, 2)  # w: [n_head, 2, hd/2, in]
    return w.reshape(out_dim, in_dim).contiguous()  # w: [out, in]


def _field(reader, key: str, default=None):
    """Return a metadata value (scalars unwrapped), or ``default`` if absent."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _require(reader, key: str):
    value = _field(reader, key)
    if value is None:
        raise ValueError(f"GGUF file is missing required metadata key {key!r}.")
    return value


def _count(reader, key: str, default=None) -> int:
    """A size the model is built from: a positive integer, else a ValueError naming the key."""
    value = _require(reader, key) if default is None else _field(reader, key, default)
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n <= 0 or n != value:
        raise ValueError(f"GGUF metadata {key} is {value!r}; it must be a positive integer.")
    return n


def _hf_config(reader, has_output: bool) -> dict:
    """Build a HF LlamaConfig-style dict from GGUF metadata."""
    arch = _require(reader, "general.architecture")
    a = f"{arch}."
    if _field(reader, a + "rope.scaling.type") not in (None, "none"):
        # Scaled RoPE would need extra config keys we do not map yet.
        raise ValueError(f"GGUF rope scaling is not supported (file has {arch}.rope.scaling.type).")
    hidden = _count(reader, a + "embedding_length")
    n_head = _count(reader, a + "attention.head_count")
    n_kv = _count(reader, a + "attention.head_count_kv", n_head)
    head_dim = _count(reader, a + "attention.key_length", hidden // n_head)
    theta = float(_field(reader, a + "rope.freq_base", 10000.0))
    vocab = _field(reader, a + "vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": _count(reader, a + "feed_forward_length"),
        "num_hidden_layers": _count(reader, a + "block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        # float32 metadata: round so 1e-5 is not written as 9.99999974e-06.
        "rms_norm_eps": float(f"{_require(reader, a + 'attention.layer_norm_rms_epsilon'):.6g}"),
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "max_position_embeddings": int(_field(reader, a + "context_length", 2048)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": not has_output,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id", eos),
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def _hf_name(gguf_name: str) -> str:
    """Map a GGUF tensor name to its HF LlamaForCausalLM name."""
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.weight"
    stem = gguf_name.removesuffix(".weight")
    if gguf_name.endswith(".weight") and stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.weight"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known HF Llama equivalent.")


def _dequantize(tensor) -> torch.Tensor:
    """Dequantize one GGUF tensor to a float32 torch tensor in [out, in] order."""
    from gguf.quants import dequantize

    arr = dequantize(tensor.data, tensor.tensor_type)
    # GGUF lists dims fastest-first; torch wants them slowest-first.
    shape = tuple(int(d) for d in reversed(tensor.shape))
    # Copy: F32 tensors are read-only views of the mmap'd file.
    arr = np.array(arr, dtype=np.float32, order="C").reshape(shape)
    return torch.from_numpy(arr)


class DamagedGGUF(ValueError):
    """A GGUF file cut short or holding junk; the message names the file and says "damaged"."""


def _reader(path, shown=None):
    """GGUFReader over the file; DamagedGGUF when its header or tensor table cannot be read."""
    from gguf import GGUFReader
    try:
        return GGUFReader(str(path))
    except Exception as e:  # the reader fails wherever a cut or junk starts (IndexError, ValueError, ...)
        raise DamagedGGUF(f"{shown or path}: damaged GGUF file, cannot be read ({type(e).__name__}: "
                          f"{str(e)[:200]})") from None


def read_gguf(path, shown=None) -> tuple[dict, dict[str, torch.Tensor]]:
    """Return ``(hf_config_dict, state_dict)`` for a llama GGUF file.

    The state dict is float32, uses HF LlamaForCausalLM names, and has q/k
    rows un-permuted. ``lm_head.weight`` appears only if the file has
    ``output.weight`` (otherwise embeddings are tied). shown: the file's name in messages
    (default: path); DamagedGGUF when it is cut short or holds junk.
    """
    reader = _reader(path, shown)
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only {', '.join(SUPPORTED_ARCHS)}).")
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    config = _hf_config(reader, has_output)

    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        try:
            w = _dequantize(tensor)
        except Exception as e:  # data cut short or junk: numpy fails wherever it starts
            raise DamagedGGUF(f"{shown or path}: damaged GGUF file, tensor {tensor.name} cannot be read "
                              f"({type(e).__name__}: {e})") from None
        if name.endswith("q_proj.weight"):
            w = unpermute_rope_rows(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute_rope_rows(w, config["num_key_value_heads"])
        state[name] = w
    _check_complete(config, state)
    return config, state


def _check_complete(config: dict, state: dict[str, torch.Tensor]) -> None:
    """Fail early if the file lacks a tensor a LlamaForCausalLM needs."""
    need = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(config["num_hidden_layers"]):
        need += [f"model.layers.{i}.{v}.weight" for v in _BLOCK_NAMES.values()]
    missing = [n for n in need if n not in state]
    if missing:
        raise ValueError(f"GGUF file lacks {len(missing)} expected tensors, e.g. {missing[0]!r}.")


def gguf_tokenizer(path, out_dir) -> Path:
    """Build a HF tokenizer from a GGUF file and save it to ``out_dir``.

    Uses transformers' own GGUF tokenizer conversion; the saved files load
    later with plain ``AutoTokenizer.from_pretrained(out_dir)`` (no gguf
    parsing). The chat template from the GGUF metadata is kept.
    """
    from transformers import AutoTokenizer

    path = Path(path)
    out_dir = Path(out_dir)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    if not tok.chat_template:
        raise ValueError(f"GGUF tokenizer in {path.name} has no chat template.")
    ctx = _context_length(path)
    if ctx:
        tok.model_max_length = ctx
    tok.save_pretrained(str(out_dir))
    _drop_load_kwargs(out_dir / "tokenizer_config.json")
    return out_dir


def _context_length(path: Path) -> int | None:
    reader = _reader(path)
    arch = _field(reader, "general.architecture")
    ctx = _field(reader, f"{arch}.context_length")
    return int(ctx) if ctx else None


def _drop_load_kwargs(config_path: Path) -> None:
    """Remove load-time flags transformers echoes into tokenizer_config.json.

    ``local_files_only``/``is_local`` describe how *this* load happened, not
    the tokenizer; leaving them in would leak into every later load.
    """
    if not config_path.exists():
        return
    data = json.loads(config_path.read_text())
    for key in ("local_files_only", "is_local", "gguf_file"):
        data.pop(key, None)
    config_path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
