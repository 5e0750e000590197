"""Model shapes: one frozen spec for every architecture the engine runs.

The OPT size table follows FlexGen's (hidden = 4 x ffn, vocab 50272, 2048 positions);
Llama-family specs come from a HF `config.json` (or a GGUF file via weights/).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelSpec:
    arch: str  # "opt" | "llama"
    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    max_pos: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    word_embed_dim: int = 0  # OPT-350m projects 512-d embeddings in and out
    pre_norm: bool = True  # OPT-350m is post-LN
    bos_id: int = 2
    eos_id: int | None = 2  # None: the model names no end token (--stop eos is refused)
    pad_id: int = 1
    # Llama family: biases of the q/k/v projections (Qwen2, attention_bias), of o, of the MLP
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None  # Mistral/Qwen2: runs only while the context fits the window

    def __post_init__(self):
        if self.arch not in ("opt", "llama"):
            raise ValueError(f"unsupported architecture {self.arch!r} (supported: opt, llama)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def embed_dim(self) -> int:
        return self.word_embed_dim or self.hidden

    def with_max_pos(self, max_pos: int) -> "ModelSpec":
        return dataclasses.replace(self, max_pos=max_pos)

    def context_limit(self) -> tuple[int, str]:
        """(most tokens a sequence may hold, what sets it): the position table, or a sliding
        window (within it, windowed attention is full attention; past it the engine would differ)."""
        if self.sliding_window is not None and self.sliding_window < self.max_pos:
            return self.sliding_window, f"{self.sliding_window}-token sliding attention window"
        return self.max_pos, f"{self.max_pos}-position table"

    # Sizes in bytes, FlexGen's accounting (used by the summary lines and the log).
    def num_params(self) -> int:
        h, f, kv = self.hidden, self.ffn, self.kv_dim
        if self.arch == "opt":
            layer = h * (h + kv * 2) + h * h + 2 * h * f + (3 * h + 2 * kv + f) + 4 * h
            emb = self.vocab * self.embed_dim + (self.max_pos + 2) * h + 2 * h
            return self.num_layers * layer + emb
        layer = h * (h + 2 * kv) + h * h + 3 * h * f + 2 * h
        layer += (h + 2 * kv) * self.qkv_bias + h * self.o_bias + (2 * f + h) * self.mlp_bias
        emb = self.vocab * h * (1 if self.tie_embeddings else 2) + h
        return self.num_layers * layer + emb

    def model_bytes(self, dtype: torch.dtype = torch.float16) -> int:
        return self.num_params() * dtype_bytes(dtype)

    def cache_bytes(self, batch: int, seq_len: int, dtype: torch.dtype = torch.float16) -> int:
        return 2 * batch * seq_len * self.num_layers * self.kv_dim * dtype_bytes(dtype)

    def hidden_bytes(self, batch: int, seq_len: int, dtype: torch.dtype = torch.float16) -> int:
        return batch * seq_len * self.hidden * dtype_bytes(dtype)


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# FlexGen's OPT table: name -> (layers, heads, hidden)
_OPT_TABLE = {
    "opt-125m": (12, 12, 768),
    "opt-350m": (24, 16, 1024),
    "opt-1.3b": (24, 32, 2048),
    "opt-2.7b": (32, 32, 2560),
    "opt-6.7b": (32, 32, 4096),
    "opt-13b": (40, 40, 5120),
    "opt-30b": (48, 56, 7168),
    "opt-66b": (64, 72, 9216),
    "opt-175b": (96, 96, 12288),
}

OPT_NAMES = tuple(_OPT_TABLE)


def opt_spec(name: str) -> ModelSpec:
    """FlexGen-table OPT spec; accepts 'opt-6.7b' or 'facebook/opt-6.7b'."""
    key = name.split("/")[-1].lower()
    if key not in _OPT_TABLE:
        raise KeyError(key)
    layers, heads, hidden = _OPT_TABLE[key]
    is_350m = key == "opt-350m"
    return ModelSpec(
        arch="opt", name=key, num_layers=layers, hidden=hidden, num_heads=heads,
        num_kv_heads=heads, head_dim=hidden // heads, ffn=4 * hidden, vocab=50272,
        max_pos=2048, word_embed_dim=512 if is_350m else 0, pre_norm=not is_350m,
    )

