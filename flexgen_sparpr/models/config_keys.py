"""The values of a HF `config.json`, read one key at a time and checked as they are read: its
type, its range, before any weight is read. A bad one is an UnsupportedConfig naming the file, the
key and the value (a string `rms_norm_eps`, an empty `eos_token_id` list, NaN where a number goes)."""
from __future__ import annotations

import math

from ..errors import ConfigError

_MISSING = object()
MAX_SIZE = (1 << 31) - 1  # a width, count or length indexes tensors


class UnsupportedConfig(ConfigError):
    """A config.json value the engine cannot compute exactly."""


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class ConfigKeys:
    """A config.json dict and where it came from (`where`: its file, for the messages)."""

    def __init__(self, cfg: dict, where: str):
        self.cfg, self.where = cfg, where

    def refuse(self, key: str, value, why: str):
        raise UnsupportedConfig(f"{self.where}: {key}={value!r} is not supported ({why})")

    def get(self, key: str, default=_MISSING):
        v = self.cfg.get(key, default)
        if v is _MISSING:
            raise UnsupportedConfig(f"{self.where}: lacks {key!r}")
        return v

    def size(self, key: str, default=_MISSING) -> int:
        """A positive integer (layers, widths, heads, vocabulary, positions); null means the default."""
        v = self.get(key, default)
        if v is None and default is not _MISSING and default is not None:
            v = default
        if v is None and key in self.cfg:
            self.refuse(key, v, "expected a positive integer")
        if v is None:
            raise UnsupportedConfig(f"{self.where}: lacks {key!r}")
        if not _is_int(v) or not 1 <= v <= MAX_SIZE:
            self.refuse(key, v, "expected a positive integer")
        return v

    def number(self, key: str, default, cfg: dict | None = None) -> float:
        """A finite number > 0 (a norm's epsilon, RoPE's theta); null means the default."""
        v = (self.cfg if cfg is None else cfg).get(key, default)
        v = default if v is None else v
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            self.refuse(key, v, "expected a finite number > 0")
        return float(v)

    def flag(self, key: str, default: bool) -> bool:
        """true or false; null means the default."""
        v = self.cfg.get(key, default)
        v = default if v is None else v
        if not isinstance(v, bool):
            self.refuse(key, v, "expected true or false")
        return v

    def text(self, key: str, default: str) -> str:
        v = self.cfg.get(key, default)
        v = default if v is None else v
        if not isinstance(v, str):
            self.refuse(key, v, "expected a string")
        return v

    def token_id(self, key: str, default: int | None, vocab: int, many: bool = False) -> int | None:
        """A token id in [0, vocab), null (None), or with `many` a non-empty list of them (the first
        is used)."""
        v = self.cfg.get(key, default)
        first = v
        if many and isinstance(v, list):
            if not v or not all(_is_int(t) for t in v):
                self.refuse(key, v, "expected a token id or a non-empty list of token ids")
            first = v[0]
            bad = next((t for t in v if not 0 <= t < vocab), None)
            if bad is not None:
                self.refuse(key, v, f"token {bad} is outside the vocabulary [0, {vocab})")
        if first is None:
            return None
        if not _is_int(first):
            self.refuse(key, v, "expected a token id" + (" or a list of them" if many else ""))
        if not 0 <= first < vocab:
            self.refuse(key, v, f"outside the vocabulary [0, {vocab})")
        return first

    def heads(self, hidden: int, heads: int, kv_heads: int, head_dim: int) -> None:
        """The attention's widths agree: q is hidden wide, split into heads of head_dim; the KV
        heads divide the query heads."""
        if heads * head_dim != hidden:
            key = "head_dim" if "head_dim" in self.cfg else "num_attention_heads"
            self.refuse(key, self.cfg.get(key),
                        f"num_attention_heads {heads} x head_dim {head_dim} must equal hidden_size {hidden}")
        if heads % kv_heads:
            self.refuse("num_key_value_heads", kv_heads, f"it must divide num_attention_heads {heads}")
