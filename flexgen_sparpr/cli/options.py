"""Configuration flows one way: defaults, then the --config YAML file, then explicit flags."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..engine.config import ConfigError, EngineConfig, Policy
from ..kv.dkv.codec import PICKS
from ..runtime.costs import CostModel
from ..runtime.hardware import GiB, Hardware, hardware_from_dict, load_hardware
from ..storage.device_memory import cap_bytes
from .flags import DEFAULTS

_POLICY_FLAGS = ("gpu_batch_size", "num_gpu_batches", "overlap", "sep_layer", "pin_weight",
                 "cpu_cache_compute", "attn_sparsity", "compress_weight", "compress_cache")
_ENGINE_FLAGS = ("device", "dtype", "gpu_mem", "block_size", "offload_dir", "direct_io", "io_threads", "kv_policy",
                 "cold_codec", "speculative_prefetch")


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
    policy: str | None = None          # "auto": cli/run.py replaces the placement (runtime/placement.py)
    hardware: Hardware | None = None   # --hardware FILE or the config's hardware: section


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


def _hardware(merged: dict, data: dict, config: str | None) -> Hardware | None:
    """--hardware FILE, else the --config file's hardware: section (the section itself) or its
    `hardware: PATH` key (relative to the config file's folder)."""
    hw = merged.get("hardware")
    if isinstance(hw, Hardware) or (hw is None and not data.get("hardware")):
        return hw
    if hw is None:
        return hardware_from_dict(data["hardware"], where=f"--config {config}")
    path = Path(hw).expanduser()
    if config and not path.is_absolute():
        path = Path(config).expanduser().parent / path
    return load_hardware(path)


def _sparpr_args(merged: dict, policy: Policy, hw: Hardware | None = None) -> dict:
    """SparPR's knobs; its cost model comes from the hardware file when there is one, else its
    probe measures the disk tier's folder when the cache uses disk."""
    for flag in ("min_keep", "gamma"):
        if not 0 < merged[flag] <= 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be in (0, 1] (got {merged[flag]})")
    args = {"min_keep": merged["min_keep"], "gamma": merged["gamma"], "quest_only": merged["quest_only"],
            "dynamic_budget": not merged["no_dynamic_budget"], "recompute": not merged["no_recompute"],
            "fallback": not merged["no_fallback"], "summary_tokens": merged["summary_tokens"],
            "checkpoints": merged["checkpoints"]}
    st = merged["summary_tokens"]
    if st < 0 or (0 < st < merged["block_size"] and merged["block_size"] % st):
        raise ConfigError(f"--summary-tokens must be 0 or divide --block-size {merged['block_size']} (got {st})")
    if hw is not None:
        args["costs"] = CostModel.from_hardware(hw)
    elif policy.cache_disk_percent > 0:
        args["probe_dir"] = merged["offload_dir"]
    return args


def _dkv_args(merged: dict, given: dict, from_config: set, policy_args: dict) -> dict:
    """DKV's knobs: the policy's (--kv-policy dkv) or the cold codec's; sets the KV block size
    to --dkv-block unless --block-size was asked for. Returns the codec args."""
    dkv_policy, cold = merged["kv_policy"] == "dkv", merged["cold_codec"] == "dkv"
    if not (dkv_policy or cold):
        return {}
    for flag, least in (("dkv_block", 1), ("dkv_rank", 1), ("dkv_residuals", 0), ("dkv_topk", 0), ("dkv_recent", 0)):
        if merged[flag] < least:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= {least} (got {merged[flag]})")
    if merged["dkv_residual_pick"] not in PICKS:
        raise ConfigError(f"--dkv-residual-pick must be one of {', '.join(PICKS)} (got {merged['dkv_residual_pick']!r})")
    asked = lambda k: k in given or k in from_config  # noqa: E731
    if asked("block_size") and asked("dkv_block") and merged["block_size"] != merged["dkv_block"]:
        raise ConfigError("--block-size and --dkv-block disagree; DKV compresses whole KV blocks (give one)")
    if not asked("block_size"):
        merged["block_size"] = merged["dkv_block"]
    codec = {"rank": merged["dkv_rank"], "residuals": merged["dkv_residuals"],
             "residual_pick": merged["dkv_residual_pick"]}
    if dkv_policy:
        policy_args.update(codec, topk=merged["dkv_topk"], recent_blocks=merged["dkv_recent"],
                           sparse_prefill=merged["dkv_sparse_prefill"], route=merged["dkv_route"])
    return codec | {"recent": merged["dkv_recent"]} if cold and not dkv_policy else {}


def resolve(args: argparse.Namespace) -> tuple[RunOptions, Policy, EngineConfig]:
    """Merge defaults < YAML < flags into the three frozen objects; bad values raise ConfigError."""
    given = {k: v for k, v in vars(args).items() if v is not None}
    merged = dict(DEFAULTS)
    data, from_config = {}, set()
    if given.get("config"):
        data = load_yaml(given["config"])
        for section in ("run", "policy", "engine"):
            values = data.get(section) or {}
            unknown = set(values) - set(DEFAULTS) - {"keep_ratio", "policy_args"}
            if unknown:
                raise ConfigError(f"--config: unknown {section} keys: {', '.join(sorted(unknown))}")
            merged.update(values)
            from_config |= set(values)
    merged.update(given)
    merged["hardware"] = _hardware(merged, data, None if "hardware" in given else given.get("config"))
    if merged["policy"] not in (None, "auto"):
        raise ConfigError(f"--policy takes only 'auto' (got {merged['policy']!r})")
    if merged["policy"] == "auto" and ("percent" in given or "percent" in from_config):
        raise ConfigError("--policy auto chooses the placement itself: drop --percent (or the config's percent)")
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
    codec_args = _dkv_args(merged, given, from_config, policy_args)
    if merged["kv_policy"] not in ("dense", "dkv"):
        policy_args.setdefault("keep_ratio", merged["keep_ratio"])
    if merged["kv_policy"] == "sparpr":
        policy_args = _sparpr_args(merged, policy, merged["hardware"]) | policy_args
    engine = EngineConfig(policy_args=policy_args, codec_args=codec_args,
                          **{k: merged[k] for k in _ENGINE_FLAGS})
    hw = merged["hardware"]
    if engine.gpu_mem is None and hw is not None and hw.gpu_mem and engine.torch_device().type == "cuda":
        # a hardware file describing a card of that size: a bigger GPU runs like it
        engine = dataclasses.replace(engine, gpu_mem=hw.gpu_mem / GiB)
    run_fields = {f.name for f in dataclasses.fields(RunOptions)}
    run = RunOptions(**{k: merged[k] for k in run_fields if k != "percent"}, percent=tuple(pct))
    return run, policy, engine


def resident_kv_share(engine: EngineConfig, dtype_bytes: int) -> float:
    """What the KV policy keeps on the compute device per cached token, wherever the cache
    lives, as a share of the raw K+V (2 kv_dim values of dtype_bytes a token): SparPR's mean key
    per `summary_tokens` (1 / (2 summary_tokens), in the cache's dtype), Quest's float32 min and
    max key per block (2 x 4 / (2 bs dtype_bytes)), and with --cold-codec dkv the exact rows of
    each cold block SparPR attends unselected (residuals / block)."""
    bs, args = engine.block_size, engine.policy_args
    if engine.kv_policy == "sparpr":
        st = args.get("summary_tokens", 4)
        share = (1 if not st or st >= bs else bs // st) / (2 * bs)
        if engine.cold_codec == "dkv":
            share += engine.codec_args.get("residuals", 16) / bs
        return share
    if engine.kv_policy == "quest":
        return 4 / (bs * dtype_bytes)
    return 0.0


def workload_for(spec, prompt_len: int, gen_len: int, policy: Policy, engine: EngineConfig, dtype: str):
    """The placement search's Workload for a run: with what the KV policy keeps on the device
    (resident_kv_share) and the share of the cache a decode step reads (its keep ratio)."""
    from ..runtime.placement import DTYPE_BYTES, Workload
    keep = engine.policy_args.get("keep_ratio", 1.0) if engine.kv_policy != "dense" else 1.0
    return Workload(spec, prompt_len, gen_len, policy.batch_size, dtype, policy.overlap, policy.compress_weight,
                    policy.compress_cache, resident_share=resident_kv_share(engine, DTYPE_BYTES[dtype]),
                    kv_read_share=keep)


def apply_auto_policy(opts: RunOptions, policy: Policy, engine: EngineConfig, spec) -> tuple:
    """--policy auto: the placement and batch split chosen by runtime/placement.py for the model
    `spec` on the hardware file (else this machine, from the cached start-up probe). The total
    batch stays gpu_batch_size x num_gpu_batches. Returns (policy, engine, plan, hardware)."""
    from ..runtime.placement import NoPlacementFits, choose
    from ..runtime.profile import hardware_from_probe

    hw, device = opts.hardware, engine.torch_device()
    if hw is None:
        hw = hardware_from_probe(device, engine.torch_dtype(device), engine.offload_dir)
    if engine.gpu_mem is not None and device.type == "cuda":  # plan for the capped card
        hw = dataclasses.replace(hw, compute_memory=min(hw.compute_memory, cap_bytes(device, engine.gpu_mem)))
    dtype = engine.dtype if engine.dtype != "auto" else ("float16" if hw.is_cuda else "float32")
    wl = workload_for(spec, opts.prompt_len, opts.gen_len, policy, engine, dtype)
    try:
        plan = choose(wl, hw)
    except NoPlacementFits as e:
        raise ConfigError(f"--policy auto: {e}") from None
    pct = plan.percent
    policy = dataclasses.replace(
        policy, gpu_batch_size=plan.gpu_batch_size, num_gpu_batches=plan.num_gpu_batches,
        w_gpu_percent=pct[0], w_cpu_percent=pct[1], cache_gpu_percent=pct[2], cache_cpu_percent=pct[3],
        act_gpu_percent=pct[4], act_cpu_percent=pct[5])
    if engine.kv_policy == "sparpr" and "costs" not in engine.policy_args:
        args = {k: v for k, v in engine.policy_args.items() if k != "probe_dir"}
        engine = dataclasses.replace(engine, policy_args=args | {"costs": CostModel.from_hardware(hw)})
    return policy, engine, plan, hw
