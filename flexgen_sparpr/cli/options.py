"""Configuration flows one way: defaults, then the --config YAML file, then explicit flags."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..engine.config import ConfigError, EngineConfig, Policy
from .flags import DEFAULTS

_POLICY_FLAGS = ("gpu_batch_size", "num_gpu_batches", "overlap", "sep_layer", "pin_weight",
                 "cpu_cache_compute", "attn_sparsity", "compress_weight", "compress_cache")
_ENGINE_FLAGS = ("device", "dtype", "block_size", "offload_dir", "direct_io", "io_threads", "kv_policy")


@dataclass(frozen=True)
class RunOptions:
    """What to run, as opposed to how (Policy) and with which engine knobs (EngineConfig)."""

    model: str
    path: str
    prompt_len: int
    gen_len: int
    cut_gen_len: int | None
    debug_mode: str | None
    max_seq_len: int | None
    prompt: str | None
    prompt_file: str | None
    prompt_ids_file: str | None
    chat: bool
    output_json: str | None
    log_file: str
    no_log: bool
    verbose: int
    seed: int
    do_sample: bool
    temperature: float
    top_p: float
    stop: str | None
    warmup: bool
    percent: tuple[int, ...]


def load_yaml(path: str) -> dict:
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"--config file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {p}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict) or set(data) - {"policy", "engine", "run", "hardware", "notes"}:
        raise ConfigError(f"--config {p}: expected top-level sections policy/engine/run")
    return data


def _sparpr_args(merged: dict, policy: Policy) -> dict:
    """SparPR's knobs; its probe measures the disk tier's folder when the cache uses disk."""
    for flag in ("min_keep", "gamma"):
        if not 0 < merged[flag] <= 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be in (0, 1] (got {merged[flag]})")
    args = {"min_keep": merged["min_keep"], "gamma": merged["gamma"], "quest_only": merged["quest_only"],
            "dynamic_budget": not merged["no_dynamic_budget"], "recompute": not merged["no_recompute"],
            "fallback": not merged["no_fallback"]}
    if policy.cache_disk_percent > 0:
        args["probe_dir"] = merged["offload_dir"]
    return args


def resolve(args: argparse.Namespace) -> tuple[RunOptions, Policy, EngineConfig]:
    """Merge defaults < YAML < flags into the three frozen objects; bad values raise ConfigError."""
    given = {k: v for k, v in vars(args).items() if v is not None}
    merged = dict(DEFAULTS)
    if given.get("config"):
        data = load_yaml(given["config"])
        for section in ("run", "policy", "engine"):
            values = data.get(section) or {}
            unknown = set(values) - set(DEFAULTS) - {"keep_ratio", "policy_args"}
            if unknown:
                raise ConfigError(f"--config: unknown {section} keys: {', '.join(sorted(unknown))}")
            merged.update(values)
    merged.update(given)
    pct = merged["percent"]
    if len(pct) != 6:
        raise ConfigError(f"--percent takes six numbers, got {len(pct)}")
    if merged["gen_len"] < 1 or merged["prompt_len"] < 1:
        raise ConfigError("--gen-len and --prompt-len must be >= 1")
    if merged["debug_mode"] == "fewer_batch" and merged["cut_gen_len"] is None:
        merged["cut_gen_len"] = 5
    if merged["cut_gen_len"] is not None and not 3 <= merged["cut_gen_len"] <= merged["gen_len"]:
        raise ConfigError("--cut-gen-len must be between 3 and --gen-len (2 warm-up steps are measured whole)")
    if not 0 < merged["keep_ratio"] <= 1:
        raise ConfigError("--keep-ratio must be in (0, 1]")
    if merged["attn_sparsity"] < 1:
        # FlexGen's sparse attention runs as the flexgen-topk KV policy (the same semantics,
        # upstream's bugs fixed, on any tier), so the kernel is not applied a second time
        if merged["kv_policy"] not in ("dense", "flexgen-topk"):
            raise ConfigError(f"--attn-sparsity is FlexGen's top-k policy; it cannot be combined with "
                              f"--kv-policy {merged['kv_policy']}")
        merged["kv_policy"], merged["keep_ratio"] = "flexgen-topk", merged["attn_sparsity"]
        if not 0 < merged["keep_ratio"] <= 1:
            raise ConfigError("--attn-sparsity must be in (0, 1]")
        merged["attn_sparsity"] = 1.0
    policy = Policy(w_gpu_percent=pct[0], w_cpu_percent=pct[1], cache_gpu_percent=pct[2],
                    cache_cpu_percent=pct[3], act_gpu_percent=pct[4], act_cpu_percent=pct[5],
                    **{k: merged[k] for k in _POLICY_FLAGS})
    policy_args = dict(merged.get("policy_args") or {})
    if merged["kv_policy"] != "dense":
        policy_args.setdefault("keep_ratio", merged["keep_ratio"])
    if merged["kv_policy"] == "sparpr":
        policy_args = _sparpr_args(merged, policy) | policy_args
    engine = EngineConfig(policy_args=policy_args, **{k: merged[k] for k in _ENGINE_FLAGS})
    run_fields = {f.name for f in dataclasses.fields(RunOptions)}
    run = RunOptions(**{k: merged[k] for k in run_fields if k != "percent"}, percent=tuple(pct))
    return run, policy, engine
