"""Checks of a resolved run before any weight loads: the stop token, the model's position table
(every architecture), the offload folder (folders of dead runs are removed first), and the
placement's predicted bytes per tier against what this machine has free (runtime/capacity.py)."""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from ..errors import CapacityError, ConfigError
from ..kv import policies
from ..runtime.capacity import SKIP_ENV, check_placement, existing_ancestor, live_capacity
from ..storage.leftovers import sweep_dead_runs


def stop_token(stop: str | None, spec, name: str = "--stop") -> int | None:
    """--stop (or the API's `name`) as a token id of the model's vocabulary, or None."""
    if stop is None or stop == "none":
        return None
    if stop == "eos":
        if spec.eos_id is None:
            raise ConfigError(f"{name} eos: {spec.name} names no end token; give a token id")
        return spec.eos_id
    tok = int(stop)  # config/validate.py let only digits through
    if not 0 <= tok < spec.vocab:
        raise ConfigError(f"{name} {tok} is outside {spec.name}'s vocabulary [0, {spec.vocab})")
    return tok


def check_context(spec, n_tokens: int, dummy: bool, gen: str = "--gen-len") -> None:
    """prompt + generated tokens within the model's position table or attention window; `gen`
    names the length generated (the API's max_new_tokens)."""
    limit, what = spec.context_limit()
    if n_tokens > limit:
        hint = ("raise --max-seq-len (dummy weights have any table size)" if dummy and "window" not in what
                else f"shorten the prompt or {gen}")
        raise CapacityError(f"{n_tokens} tokens (prompt + {gen}) exceed {spec.name}'s {what}: {hint}")


def check_offload_dir(path: str) -> Path:
    """The offload folder, usable: a folder (or one that can be made) that this process can write."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise ConfigError(f"--offload-dir {path} is not a folder")
    base = existing_ancestor(p)
    if not base.is_dir() or not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(f"--offload-dir {path}: {base} is not a writable folder")
    if os.statvfs(base).f_blocks == 0:  # /proc, /sys: a kernel's view, no disk behind it
        raise ConfigError(f"--offload-dir {path}: {base} is on a virtual file system with no disk behind it; "
                          "give a folder on a disk")
    try:  # the only sure test (root passes every mode check; a file system may refuse anyway)
        os.rmdir(tempfile.mkdtemp(dir=base, prefix=".flexgen-sparpr-probe-"))
    except OSError as e:
        raise ConfigError(f"--offload-dir {path}: cannot make a folder in {base} ({e.strerror})") from None
    return p


def sweep(path: str) -> None:
    """Remove the folders dead runs left in the offload folder, and say so in one line."""
    gone = sweep_dead_runs(Path(path).expanduser())
    if gone:
        pids = ", ".join(str(pid) for _, pid, _ in gone)
        mb = sum(size for *_, size in gone) / 1e6
        print(f"note: removed {len(gone)} offload folder(s) left in {path} by runs that died (pid {pids}; "
              f"{mb:.0f} MB)", file=sys.stderr, flush=True)


def check_capacity(opts, policy, engine, spec, prompt_len: int, capacity=None) -> dict | None:
    """The placement's predicted bytes per tier (None when skipped by SKIP_ENV), or CapacityError
    when a tier cannot hold its share. capacity: what `--policy auto` planned within (measured
    moments before; runtime/capacity.py Capacity), else what is free now."""
    if os.environ.get(SKIP_ENV):
        return None
    from .options import run_dtype, workload_for
    device = engine.torch_device()
    wl = workload_for(spec, prompt_len, opts.gen_len, policy, engine, run_dtype(engine, device))
    pct = tuple(int(p) if float(p).is_integer() else p for p in (
        policy.w_gpu_percent, policy.w_cpu_percent, policy.cache_gpu_percent, policy.cache_cpu_percent,
        policy.act_gpu_percent, policy.act_cpu_percent))
    cap = capacity if capacity is not None else live_capacity(device, engine.offload_dir)
    return check_placement(wl, pct, policy.gpu_batch_size, cap)


def before_loading(opts, policy, engine, spec, prompt_len: int, dummy: bool, capacity=None) -> dict | None:
    """Every check that needs the model and the prompts but no weights; returns the predicted
    bytes per tier."""
    check_context(spec, prompt_len + opts.gen_len, dummy)
    return ready_to_load(opts, policy, engine, spec, prompt_len, capacity)


def ready_to_load(opts, policy, engine, spec, prompt_len: int, capacity=None) -> dict | None:
    """The checks of the model and the placement that need no prompt (the Python API makes them
    before loading, and checks each call's lengths against the context itself)."""
    for p in (engine.make_kv_policy(), engine.make_cold_codec()):
        if p is not None:
            policies.check_width(p, 2 * spec.kv_dim)
    if policy.w_disk_percent > 0 or policy.cache_disk_percent > 0:
        check_offload_dir(engine.offload_dir)
    sweep(engine.offload_dir)
    return check_capacity(opts, policy, engine, spec, prompt_len, capacity)
