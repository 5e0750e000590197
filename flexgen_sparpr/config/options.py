"""Configuration flows one way: defaults, then the --config YAML file, then explicit flags."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..engine.config import EngineConfig, Policy
from ..engine.sampling import STOP_DEFAULT
from ..errors import ConfigError
from ..utils.paths import config_file
from ..kv import policies
from ..kv.knobs import knobs
from ..runtime.hardware import GiB, Hardware, hardware_from_dict, load_hardware
from ..storage.device_memory import cap_bytes
from .flags import DEFAULTS
from .validate import check_names, check_ranges, flag_name, one_of_flags, typed_config_values

_POLICY_FLAGS = ("gpu_batch_size", "num_gpu_batches", "overlap", "sep_layer", "pin_weight",
                 "cpu_cache_compute", "attn_sparsity", "compress_weight", "compress_cache")
_ENGINE_FLAGS = ("device", "dtype", "kv_dtype", "weight_format", "gpu_mem", "block_size", "offload_dir", "direct_io", "io_threads",
                 "speculative_prefetch")


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
    stream: bool = False               # print tokens as they are decoded (cli/stream.py)
    quiet: bool = False                # no progress bars


def load_yaml(path: str) -> dict:
    p = config_file(path)
    if not p.is_file():
        raise ConfigError(f"--config file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {p}: not valid YAML ({str(e).splitlines()[0]})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--config {p}: cannot read it as text ({e})") from None
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


def _kv_policies(merged: dict, asked, policy: Policy, explicit: set) -> tuple:
    """The KV policy and the cold codec's policy (None: raw) from their knobs' flags and YAML keys
    (each policy reads its own; kv/policies/), and the KV block size: --block-size, else the one a
    policy asks for (DKV's --dkv-block), else the default. explicit: the keys given as flags (or
    API arguments), as opposed to the --config file's."""
    given = {d: merged[d] for d in policies.flags() if d in merged}
    policies.check_given(given)  # a bad value is refused even where the chosen policy ignores it
    names = [merged["kv_policy"]] + ([merged["cold_codec"]] if merged["cold_codec"] != "raw" else [])
    policies.policy_class(names[0])
    # a knob asked for on the command line (or as an API argument) must be read; a --config file
    # may hold several policies' knobs (the one chosen reads its own)
    policies.check_read([d for d in given if d in explicit], names)
    for name in names:
        bk = policies.block_size_knob(name)
        if bk is None:
            continue
        if asked("block_size") and asked(bk.dest) and merged["block_size"] != merged[bk.dest]:
            raise ConfigError(f"--block-size and {bk.flag} disagree; {name} compresses whole KV blocks (give one)")
        if not asked("block_size"):
            merged["block_size"] = given.get(bk.dest, bk.default)
    kvp = policies.build(names[0], given, merged.get("policy_args") or {}, merged["block_size"])
    cold = policies.build(names[1], given, block_size=merged["block_size"]) if len(names) > 1 else None
    disk_dir = merged["offload_dir"] if policy.cache_disk_percent > 0 else None
    return kvp.for_machine(merged["hardware"], disk_dir), cold


def resolve(args) -> tuple[RunOptions, Policy, EngineConfig]:
    """Merge defaults < YAML < flags into the three frozen objects; bad values raise ConfigError.
    args: the parsed flags (the command line's namespace), or a dict of flag values (their dest names: `{"kv_policy": "sparpr",
    "keep_ratio": 0.5}`) for callers without a command line."""
    given = {k: v for k, v in (args if isinstance(args, dict) else vars(args)).items() if v is not None}
    unknown = set(given) - set(DEFAULTS) - set(policies.flags()) - {"policy_args"}
    if isinstance(args, dict) and unknown:
        raise ConfigError(f"unknown options: {', '.join(sorted(unknown))}")
    merged = dict(DEFAULTS)
    data, from_config = {}, set()
    if given.get("config"):
        data = load_yaml(given["config"])
        for section in ("run", "policy", "engine"):
            values = typed_config_values(data.get(section) or {}, section, f"--config {given['config']}")
            unknown = set(values) - set(DEFAULTS) - set(policies.flags()) - {"policy_args"}
            knob_fields = {k.name for f in policies.flags().values() for k in f.policies.values()}
            raw = sorted(map(str, set(values.get("policy_args") or {}) - knob_fields))
            if raw:  # a YAML value is a number or a text: only the knobs' fields take one
                raise ConfigError(f"--config {given['config']}: {section}.policy_args.{raw[0]} is not a KV policy "
                                  "knob's field")
            if unknown:
                raise ConfigError(f"--config: unknown {section} keys: {', '.join(sorted(map(str, unknown)))}")
            merged.update(values)
            from_config |= set(values)
    merged.update(given)
    check_names(merged)
    asked = lambda k: k in given or k in from_config  # noqa: E731
    merged["hardware"] = _hardware(merged, data, None if "hardware" in given else given.get("config"))
    check_ranges(merged)
    if merged["policy"] not in (None, "auto"):
        raise ConfigError(f"--policy takes only 'auto' (got {merged['policy']!r})")
    if merged["policy"] == "auto" and asked("percent"):
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
    one_of_flags(merged, asked, "prompt", "prompt_file", "prompt_ids_file")
    if merged["warmup"] is None:  # FlexGen's benchmark (its own prompt) warms up first; a user's prompts do not
        merged["warmup"] = not any(merged[k] for k in ("prompt", "prompt_file", "prompt_ids_file"))
    if merged["stop"] is None and any(merged[k] for k in ("prompt", "prompt_file", "prompt_ids_file")):
        merged["stop"] = STOP_DEFAULT  # a user's prompt ends at the end token; FlexGen's benchmark runs --gen-len
    for key in ("temperature", "top_p"):  # sampling knobs do nothing in greedy decoding
        if key in given and not merged["do_sample"]:
            raise ConfigError(f"{flag_name(key)} {merged[key]} does nothing without --do-sample (greedy decoding): "
                              "add --do-sample, or drop it")
    implied = policies.implied_by("attn_sparsity")
    if merged["attn_sparsity"] < 1 and implied is not None:
        # FlexGen's sparse attention runs as the KV policy that owns the flag (the same semantics,
        # upstream's bugs fixed, on any tier), so the kernel is not applied a second time
        cls, knob_field = implied
        if merged["kv_policy"] not in (policies.DEFAULT, cls.name):
            raise ConfigError(f"--attn-sparsity is FlexGen's top-k policy; it cannot be combined with "
                              f"--kv-policy {merged['kv_policy']}")
        if not 0 < merged["attn_sparsity"] <= 1:
            raise ConfigError("--attn-sparsity must be in (0, 1]")
        dest = next(k.dest for k in knobs(cls) if k.name == knob_field)
        if asked(dest):
            raise ConfigError(f"--attn-sparsity {merged['attn_sparsity']} and {flag_name(dest)} "
                              f"{merged[dest]} both set {cls.name}'s kept fraction: give one")
        merged["kv_policy"], merged[dest], merged["attn_sparsity"] = cls.name, merged["attn_sparsity"], 1.0
    policy = Policy(w_gpu_percent=pct[0], w_cpu_percent=pct[1], cache_gpu_percent=pct[2],
                    cache_cpu_percent=pct[3], act_gpu_percent=pct[4], act_cpu_percent=pct[5],
                    **{k: merged[k] for k in _POLICY_FLAGS})
    kvp, cold = _kv_policies(merged, asked, policy, set(given))
    engine = EngineConfig(kv_policy=kvp, cold_codec="raw" if cold is None else cold,
                          **{k: merged[k] for k in _ENGINE_FLAGS})
    hw = merged["hardware"]
    if engine.gpu_mem is None and hw is not None and hw.gpu_mem and engine.torch_device().type == "cuda":
        # a hardware file describing a card of that size: a bigger GPU runs like it
        engine = dataclasses.replace(engine, gpu_mem=hw.gpu_mem / GiB)
    run_fields = {f.name for f in dataclasses.fields(RunOptions)}
    run = RunOptions(**{k: merged[k] for k in run_fields if k != "percent"}, percent=tuple(pct))
    return run, policy, engine


def workload_for(spec, prompt_len: int, gen_len: int, policy: Policy, engine: EngineConfig, dtype: str):
    """The Workload of a run, what `--policy auto` plans and the check before loading
    (config/preflight.py) tests: with the KV block size (the cache is allocated in whole blocks),
    what the KV policy keeps on the device (its resident_share) and in host memory (host_share),
    the share of the cache a decode step reads (its read_share) and what each offloaded table
    keeps of it (arena_share)."""
    from ..runtime.placement import DTYPE_BYTES, Workload
    kvp, cold = engine.make_kv_policy(), engine.make_cold_codec()
    return Workload(spec, prompt_len, gen_len, policy.batch_size, dtype, policy.overlap, policy.compress_weight,
                    policy.compress_cache,
                    resident_share=kvp.resident_share(engine.block_size, DTYPE_BYTES[dtype], cold),
                    host_share=kvp.host_share(engine.block_size, DTYPE_BYTES[dtype]),
                    kv_read_share=kvp.read_share(), kv_arena_share=kvp.arena_share(cold),
                    block_size=engine.block_size)


def run_dtype(engine: EngineConfig, device) -> str:
    """The dtype name a run computes in on `device` ("float16", "float32", ...)."""
    return str(engine.torch_dtype(device)).removeprefix("torch.")


def apply_auto_policy(opts: RunOptions, policy: Policy, engine: EngineConfig, spec, prompt_len: int | None = None,
                      ) -> tuple:
    """--policy auto: the placement and batch split chosen by runtime/placement.py for the model
    `spec` on the hardware file (else this machine, from the cached start-up probe), within what
    this machine has free now as the check before loading measures it (runtime/capacity.py
    `live_capacity`: the plan passes that check). The total batch stays gpu_batch_size x
    num_gpu_batches. prompt_len: the prompts' padded length (default opts.prompt_len). Returns
    (policy, engine, plan, hardware, capacity): capacity is the measurement planned within, for
    the check (config/preflight.py) to test the plan against."""
    from ..runtime.capacity import live_capacity, planning_hardware
    from ..runtime.placement import NoPlacementFits, choose, tier_capacity
    from ..runtime.profile import hardware_from_probe

    hw, device = opts.hardware, engine.torch_device()
    if hw is None:
        hw = hardware_from_probe(device, engine.torch_dtype(device), engine.offload_dir)
    if engine.gpu_mem is not None and device.type == "cuda":  # plan for the capped card
        hw = dataclasses.replace(hw, compute_memory=min(hw.compute_memory, cap_bytes(device, engine.gpu_mem)))
    cap = live_capacity(device, engine.offload_dir)
    hw = planning_hardware(hw, cap)
    # a file for another kind of machine plans in that machine's dtype
    dtype = run_dtype(engine, device) if hw.is_cuda == cap.is_cuda else (
        engine.dtype if engine.dtype != "auto" else ("float16" if hw.is_cuda else "float32"))
    wl = workload_for(spec, opts.prompt_len if prompt_len is None else prompt_len, opts.gen_len, policy, engine,
                      dtype)
    try:
        plan = choose(wl, hw)
    except NoPlacementFits as e:
        usable = tier_capacity(hw)
        raise ConfigError(f"--policy auto: {e} ({(usable['compute'] + usable['cpu']) / GiB:.1f} GiB of memory and "
                          f"{usable['disk'] / GiB:.1f} GiB of disk usable): lower the batch or the lengths, try "
                          "--compress-weight, or free disk space") from None
    pct = plan.percent
    policy = dataclasses.replace(
        policy, gpu_batch_size=plan.gpu_batch_size, num_gpu_batches=plan.num_gpu_batches,
        w_gpu_percent=pct[0], w_cpu_percent=pct[1], cache_gpu_percent=pct[2], cache_cpu_percent=pct[3],
        act_gpu_percent=pct[4], act_cpu_percent=pct[5])
    engine = dataclasses.replace(engine, kv_policy=engine.make_kv_policy().for_machine(hw))
    return policy, engine, plan, hw, cap
