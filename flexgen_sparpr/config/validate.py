"""Values checked once, whichever way they came (flag, --config YAML or API argument), before any work.

YAML and API values get the types of their options (read off the option table, config/flags.py,
which the command line's parser is built from, so the faces cannot drift apart); then every
merged value is checked against its range. The rule for a value out of range is one everywhere:
it is an error, never silently clamped.
"""
from __future__ import annotations

import math
import os
import re

from ..errors import ConfigError
from .flags import Option, options, parse_bool

MAX_BLOCK_SIZE = 1 << 16  # tokens per KV block; a larger block only wastes its unused tail
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def typed_config_values(values: dict, section: str, where: str) -> dict:
    """A --config section's values converted as their flags convert them; ConfigError naming
    the file, the key and the value otherwise. A null value leaves the default; keys without an
    option (policy_args) pass as they are."""
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: section {section}: must be a mapping of keys to values")
    table, out = options(), {}
    for key, v in values.items():
        o = table.get(key)
        if key == "policy_args":
            if not isinstance(v, dict):
                raise ConfigError(f"{where}: {section}.policy_args must be a mapping (got {v!r})")
            out[key] = v
        elif o is not None and v is None:
            continue  # `key:` with no value (null) leaves the default, as a flag not given does
        elif o is None:
            out[key] = v
        else:
            out[key] = _convert(o, v, f"{where}: {section}.{key}")
    return out


def typed_flag_values(values: dict, names: dict | None = None) -> dict:
    """Values given from Python (the API's keyword arguments) converted as their flags convert
    them (a tuple as a list); ConfigError naming the flag (or names[key], an argument's own name)
    otherwise. Keys without an option, and a Hardware for --hardware, pass as they are."""
    from ..runtime.hardware import Hardware
    table, out = options(), {}
    for key, v in values.items():
        o = table.get(key)
        if isinstance(v, tuple):
            v = list(v)
        if o is None or v is None or (key == "hardware" and isinstance(v, Hardware)):
            out[key] = v
        else:
            out[key] = _convert(o, v, (names or {}).get(key, o.flag))
    return out


def _convert(o: Option, v, name: str):
    if o.kind == "switch":
        if not isinstance(v, bool):
            raise ConfigError(f"{name} must be true or false (got {v!r})")
        return v
    if o.kind == "ints":
        if not isinstance(v, list) or not v:
            raise ConfigError(f"{name} must be a list (got {v!r})")
        return [_scalar(o, x, name) for x in v]
    return _scalar(o, v, name)


def _scalar(o: Option, v, name: str):
    if o.kind in ("int", "ints"):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{name} must be an integer (got {v!r})")
    elif o.kind == "float":
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{name} must be a number (got {v!r})")
        v = float(v)
    elif o.kind == "str":  # YAML may read `stop: 2` as a number, Python give a path
        if isinstance(v, bool) or not isinstance(v, (str, int, float)) and not hasattr(v, "__fspath__"):
            raise ConfigError(f"{name} must be a string (got {v!r})")
        v = os.fspath(v) if hasattr(v, "__fspath__") else str(v)
        if "\0" in v:
            raise ConfigError(f"{name} holds a NUL character (got {v!r})")
    elif o.kind == "bool" and not isinstance(v, bool):
        try:
            v = parse_bool(str(v))
        except ValueError:
            raise ConfigError(f"{name} must be true or false (got {v!r})") from None
    if o.choices is not None and v not in o.choices:
        raise ConfigError(f"{name} must be one of {', '.join(map(str, o.choices))} (got {v!r})")
    return v


MAX_INT = (1 << 63) - 1  # an integer flag becomes a 64-bit integer (torch, numpy)
MAX_SIZE = (1 << 31) - 1  # lengths and batch sizes index tensors
MAX_IO_THREADS = 256
# below it logits / temperature overflow float32 in sampling; a temperature that low means greedy
# decoding, which is what leaving out --do-sample gives
MIN_TEMPERATURE = 1e-4

# flag -> (test, what it must be); checked on the merged values (defaults < YAML < flags). A KV
# policy's knobs are checked by the policies that have them (kv/policies/ check_given).
_RANGES = {
    "prompt_len": (lambda v: 1 <= v <= MAX_SIZE, f"in [1, {MAX_SIZE}]"),
    "gen_len": (lambda v: 1 <= v <= MAX_SIZE, f"in [1, {MAX_SIZE}]"),
    "cut_gen_len": (lambda v: v is None or 1 <= v <= MAX_SIZE, f"in [1, {MAX_SIZE}]"),
    "gpu_batch_size": (lambda v: 1 <= v <= MAX_SIZE, f"in [1, {MAX_SIZE}]"),
    "num_gpu_batches": (lambda v: 1 <= v <= MAX_SIZE, f"in [1, {MAX_SIZE}]"),
    "block_size": (lambda v: 1 <= v <= MAX_BLOCK_SIZE, f"in [1, {MAX_BLOCK_SIZE}]"),
    "max_seq_len": (lambda v: v is None or 1 <= v <= MAX_SIZE, f"in [1, {MAX_SIZE}]"),
    "io_threads": (lambda v: 1 <= v <= MAX_IO_THREADS, f"in [1, {MAX_IO_THREADS}]"),
    "seed": (lambda v: 0 <= v <= MAX_INT, "in [0, 2^63 - 1]"),
    "verbose": (lambda v: v >= 0, ">= 0"),
    "temperature": (lambda v: math.isfinite(v) and v >= MIN_TEMPERATURE,
                    f"a finite number >= {MIN_TEMPERATURE:g} (lower is greedy decoding: leave out --do-sample)"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "attn_sparsity": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "gpu_mem": (lambda v: v is None or 0 < v <= 1 << 20, "> 0 (GiB)"),
}


def flag_name(key: str) -> str:
    return "--" + key.replace("_", "-")


def check_range(key: str, v, name: str | None = None) -> None:
    """ConfigError when flag `key`'s value is out of its range (NaN is out of every range);
    the message names `name` (default: the flag)."""
    ok, what = _RANGES[key]
    try:
        good = not (isinstance(v, float) and math.isnan(v)) and ok(v)
    except TypeError:  # None, or another value of no order, from Python
        good = False
    if not good:
        raise ConfigError(f"{name or flag_name(key)} must be {what} (got {v!r})")


def check_numbers(merged: dict) -> None:
    """Every number given, whatever its flag: a float is finite, an integer fits 64 bits (what
    each becomes in torch and numpy); ConfigError naming the flag and the value otherwise."""
    for key, v in merged.items():
        for x in v if isinstance(v, list) else [v]:
            if isinstance(x, float) and not math.isfinite(x):
                raise ConfigError(f"{flag_name(key)} must be a finite number (got {x})")
            if isinstance(x, int) and not isinstance(x, bool) and not -MAX_INT - 1 <= x <= MAX_INT:
                raise ConfigError(f"{flag_name(key)} {x} is too {'large' if x > 0 else 'small'} (an integer flag "
                                  "fits 64 bits)")


def check_ranges(merged: dict) -> None:
    """ConfigError for the first merged value out of its range (NaN is out of every range)."""
    check_numbers({k: v for k, v in merged.items() if k not in ("policy_args", "hardware")})
    for key in _RANGES:
        v = merged.get(key)
        if v is None and key not in ("max_seq_len", "cut_gen_len", "gpu_mem"):
            continue
        check_range(key, v)
    if not _DEVICE.match(str(merged.get("device"))):
        raise ConfigError(f"--device must be auto, cpu, cuda or cuda:N (got {merged.get('device')!r})")
    check_stop(merged.get("stop"))


_NAMES = ("model", "offload_dir", "log_file", "config", "hardware", "prompt_file", "prompt_ids_file",
          "output_json")


def check_names(given: dict) -> None:
    """A model name or a file or folder path given empty (or blank) is refused, not read as the
    current folder. (--path may be empty: a HF checkpoint given as --model needs none.)"""
    for key in _NAMES:
        if isinstance(given.get(key), str) and not given[key].strip():
            raise ConfigError(f"{flag_name(key)} is empty: give a {'name or path' if key == 'model' else 'path'}")


def check_stop(stop, name: str = "--stop") -> None:
    if stop is not None and stop not in ("eos", "none") and not re.fullmatch(r"\d{1,18}", str(stop)):
        raise ConfigError(f"{name} takes a token id, 'eos' or 'none' (got {stop!r})")


def one_of_flags(merged: dict, asked, *keys: str) -> None:
    """At most one of these flags: ConfigError naming the two given together."""
    given = [k for k in keys if asked(k) and merged.get(k) is not None]
    if len(given) > 1:
        raise ConfigError(f"{flag_name(given[0])} and {flag_name(given[1])} both give the prompt: give one")
