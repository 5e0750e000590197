"""Values checked once, whichever way they came (flag or --config YAML), before any work.

YAML values get the same types as their flags (read off the argparse actions, so the two cannot
drift apart); then every merged value is checked against its range. The rule for a value out of
range is one everywhere: it is an error, never silently clamped.
"""
from __future__ import annotations

import argparse
import math
import re

from ..errors import ConfigError

MAX_BLOCK_SIZE = 1 << 16  # tokens per KV block; a larger block only wastes its unused tail
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.option_strings}


def typed_config_values(values: dict, section: str, where: str, parser: argparse.ArgumentParser) -> dict:
    """A --config section's values converted as their flags convert them; ConfigError naming
    the file, the key and the value otherwise. Keys without a flag (policy_args) pass as they are."""
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: section {section}: must be a mapping of keys to values")
    acts, out = _actions(parser), {}
    for key, v in values.items():
        a = acts.get(key)
        if key == "policy_args":
            if not isinstance(v, dict):
                raise ConfigError(f"{where}: {section}.policy_args must be a mapping (got {v!r})")
            out[key] = v
        elif a is None or v is None:
            out[key] = v
        else:
            out[key] = _convert(a, v, f"{where}: {section}.{key}")
    return out


def _convert(a: argparse.Action, v, name: str):
    if isinstance(a, argparse._StoreTrueAction):
        if not isinstance(v, bool):
            raise ConfigError(f"{name} must be true or false (got {v!r})")
        return v
    if a.nargs in ("+", "*"):
        if not isinstance(v, list) or not v:
            raise ConfigError(f"{name} must be a list (got {v!r})")
        return [_scalar(a, x, name) for x in v]
    return _scalar(a, v, name)


def _scalar(a: argparse.Action, v, name: str):
    kind = a.type
    if kind is int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{name} must be an integer (got {v!r})")
    elif kind is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{name} must be a number (got {v!r})")
        v = float(v)
    elif kind is None:  # a string flag; YAML may read `stop: 2` as a number
        if isinstance(v, (bool, list, dict)):
            raise ConfigError(f"{name} must be a string (got {v!r})")
        v = str(v)
    elif getattr(kind, "__name__", "") == "str2bool":
        if not isinstance(v, bool):
            try:
                v = kind(str(v))
            except argparse.ArgumentTypeError:
                raise ConfigError(f"{name} must be true or false (got {v!r})") from None
    if a.choices is not None and v not in a.choices:
        raise ConfigError(f"{name} must be one of {', '.join(map(str, a.choices))} (got {v!r})")
    return v


# flag -> (test, what it must be); checked on the merged values (defaults < YAML < flags). A KV
# policy's knobs are checked by the policies that have them (kv/policies/ check_given).
_RANGES = {
    "prompt_len": (lambda v: v >= 1, ">= 1"),
    "gen_len": (lambda v: v >= 1, ">= 1"),
    "gpu_batch_size": (lambda v: v >= 1, ">= 1"),
    "num_gpu_batches": (lambda v: v >= 1, ">= 1"),
    "block_size": (lambda v: 1 <= v <= MAX_BLOCK_SIZE, f"in [1, {MAX_BLOCK_SIZE}]"),
    "max_seq_len": (lambda v: v is None or v >= 1, ">= 1"),
    "io_threads": (lambda v: v >= 1, ">= 1"),
    "seed": (lambda v: v >= 0, ">= 0"),
    "verbose": (lambda v: v >= 0, ">= 0"),
    "temperature": (lambda v: math.isfinite(v) and v > 0, "a finite number > 0"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "attn_sparsity": (lambda v: 0 < v <= 1, "in (0, 1]"),
}


def check_ranges(merged: dict) -> None:
    """ConfigError for the first merged value out of its range (NaN is out of every range)."""
    for key, (ok, what) in _RANGES.items():
        v = merged.get(key)
        if v is None and key != "max_seq_len":
            continue
        if isinstance(v, float) and math.isnan(v) or not ok(v):
            raise ConfigError(f"--{key.replace('_', '-')} must be {what} (got {v})")
    if not _DEVICE.match(str(merged.get("device"))):
        raise ConfigError(f"--device must be auto, cpu, cuda or cuda:N (got {merged.get('device')!r})")
    stop = merged.get("stop")
    if stop is not None and stop != "eos" and not re.fullmatch(r"\d+", str(stop)):
        raise ConfigError(f"--stop takes a token id or 'eos' (got {stop!r})")
