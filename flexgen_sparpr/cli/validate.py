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


def typed_flag_values(values: dict, parser: argparse.ArgumentParser) -> dict:
    """Values given from Python (the API's keyword arguments) converted as their flags convert
    them (a tuple as a list); ConfigError naming the flag otherwise. Keys without a flag, and
    objects a flag's text stands for (a Hardware for --hardware), pass as they are."""
    acts, out = _actions(parser), {}
    for key, v in values.items():
        a = acts.get(key)
        if isinstance(v, tuple):
            v = list(v)
        if a is None or v is None or (a.type is None and not isinstance(v, (str, bool, int, float, list, dict))
                                      and not hasattr(v, "__fspath__")):
            out[key] = v
        else:
            out[key] = _convert(a, v, a.option_strings[0])
    return out


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


def check_range(key: str, v) -> None:
    """ConfigError when flag `key`'s value is out of its range (NaN is out of every range)."""
    ok, what = _RANGES[key]
    if isinstance(v, float) and math.isnan(v) or not ok(v):
        raise ConfigError(f"--{key.replace('_', '-')} must be {what} (got {v})")


def check_ranges(merged: dict) -> None:
    """ConfigError for the first merged value out of its range (NaN is out of every range)."""
    for key in _RANGES:
        v = merged.get(key)
        if v is None and key != "max_seq_len":
            continue
        check_range(key, v)
    if not _DEVICE.match(str(merged.get("device"))):
        raise ConfigError(f"--device must be auto, cpu, cuda or cuda:N (got {merged.get('device')!r})")
    check_stop(merged.get("stop"))


def check_stop(stop) -> None:
    if stop is not None and stop != "eos" and not re.fullmatch(r"\d+", str(stop)):
        raise ConfigError(f"--stop takes a token id or 'eos' (got {stop!r})")
