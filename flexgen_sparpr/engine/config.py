"""Run configuration: FlexGen's Policy (same fields, same meaning) and the engine's own knobs.

Both are frozen; they are filled once (YAML file, then CLI overrides) in config/options.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import ConfigError
from ..kv import policies
from ..kv.policy import KVPolicy
from ..models.packed import FORMATS as WEIGHT_FORMATS
from ..storage.tiers import resolve_device


# --kv-dtype: how the CPU and disk tiers store KV blocks (raw in a float dtype, or group-quantized)
KV_DTYPES = ("auto", "float16", "bfloat16", "float32", "q8", "q4")


@dataclass(frozen=True)
class Policy:
    """FlexGen's placement/schedule policy. Percents: share of bytes on GPU (compute) and CPU;
    disk holds the remainder."""

    gpu_batch_size: int = 4
    num_gpu_batches: int = 1
    w_gpu_percent: float = 100
    w_cpu_percent: float = 0
    cache_gpu_percent: float = 100
    cache_cpu_percent: float = 0
    act_gpu_percent: float = 100
    act_cpu_percent: float = 0
    overlap: bool = True
    sep_layer: bool = True
    pin_weight: bool = True
    cpu_cache_compute: bool = False
    attn_sparsity: float = 1.0
    compress_weight: bool = False
    compress_cache: bool = False

    def __post_init__(self):
        if self.gpu_batch_size < 1 or self.num_gpu_batches < 1:
            raise ConfigError("--gpu-batch-size and --num-gpu-batches must be >= 1")
        for kind in ("w", "cache", "act"):
            g, c = getattr(self, f"{kind}_gpu_percent"), getattr(self, f"{kind}_cpu_percent")
            if not (0 <= g <= 100 and 0 <= c <= 100 and g + c <= 100):
                raise ConfigError(f"--percent for {kind}: GPU and CPU shares must be in [0, 100] "
                                  f"and sum to at most 100 (got {g}, {c})")
        if not 0 < self.attn_sparsity <= 1:
            raise ConfigError("--attn-sparsity must be in (0, 1]")
        acts = (self.act_gpu_percent, self.act_cpu_percent, self.act_disk_percent)
        if sorted(acts) != [0, 0, 100]:
            raise ConfigError("--percent: activations must live whole on one tier (... 100 0 or 0 100); "
                              "a split activation tier is not supported (FlexGen refuses it too)")
        if self.act_disk_percent == 100:
            raise ConfigError("--percent: activations on disk are not supported: use 100 0 (GPU) or 0 100 (CPU)")
        if self.compress_cache and self.attn_sparsity < 1:
            raise ConfigError("--compress-cache with --attn-sparsity < 1 is not supported (as in FlexGen)")

    @property
    def w_disk_percent(self) -> float:
        return 100 - self.w_gpu_percent - self.w_cpu_percent

    @property
    def cache_disk_percent(self) -> float:
        return 100 - self.cache_gpu_percent - self.cache_cpu_percent

    @property
    def act_disk_percent(self) -> float:
        return 100 - self.act_gpu_percent - self.act_cpu_percent

    @property
    def weight_percents(self) -> tuple[float, float, float]:
        return (self.w_gpu_percent, self.w_cpu_percent, self.w_disk_percent)

    @property
    def cache_percents(self) -> tuple[float, float, float]:
        return (self.cache_gpu_percent, self.cache_cpu_percent, self.cache_disk_percent)

    @property
    def batch_size(self) -> int:
        return self.gpu_batch_size * self.num_gpu_batches


@dataclass(frozen=True)
class EngineConfig:
    """The engine's knobs beyond FlexGen's Policy."""

    device: str = "auto"  # "auto" -> cuda if present else cpu
    dtype: str = "auto"  # "auto" -> float16 on CUDA, float32 on CPU
    # how raw KV blocks homed on the CPU and disk tiers are stored ("auto": float16, or bfloat16
    # under a bfloat16 compute dtype); compute-tier blocks are in the compute dtype
    kv_dtype: str = "auto"
    # how projection weights are stored and multiplied (engine/weight_format.py; auto: the probe's
    # fastest format that holds the checkpoint's values exactly)
    weight_format: str = "auto"
    gpu_mem: float | None = None  # GiB: cap the CUDA device, as a card this size (storage/device_memory.py)
    block_size: int = 16  # measured: results/fidelity/defaults-block (docs/sparpr.md "Default block")
    offload_dir: str = "~/flexgen_offload_dir"
    direct_io: bool = False  # bypass the page cache on the disk tier (benchmarks)
    io_threads: int = 2
    # the KV policy: a policy (kv/policies/), or a registered name with its knobs (field names);
    # a policy given is used as is (engines sharing one share its per-step statistics)
    kv_policy: str | KVPolicy = policies.DEFAULT
    policy_args: dict = field(default_factory=dict)
    # how CPU/disk-tier KV blocks are stored: raw, or the codec of a policy that has one (dkv:
    # anchor + low rank), given as a policy or a name with its knobs (codec_args)
    cold_codec: str | KVPolicy = "raw"
    codec_args: dict = field(default_factory=dict)
    # one GPU batch: a query-aware policy's next layer is selected from this layer's input and
    # gathered while this layer computes; the exact selection then reads only what the guess missed
    speculative_prefetch: bool = False

    def __post_init__(self):
        if self.block_size < 1:
            raise ConfigError("--block-size must be >= 1")
        if self.dtype not in ("auto", "float16", "bfloat16", "float32"):
            raise ConfigError(f"--dtype must be float16, bfloat16 or float32 (got {self.dtype})")
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"--kv-dtype must be {', '.join(KV_DTYPES[:-1])} or {KV_DTYPES[-1]} (got {self.kv_dtype})")
        if self.weight_format not in WEIGHT_FORMATS:
            raise ConfigError(f"--weight-format must be one of {', '.join(WEIGHT_FORMATS)} (got {self.weight_format})")
        if self.gpu_mem is not None and not self.gpu_mem > 0:
            raise ConfigError(f"--gpu-mem must be > 0 GiB (got {self.gpu_mem})")
        if isinstance(self.kv_policy, str) and self.kv_policy not in policies.POLICIES:
            raise ConfigError(f"unknown --kv-policy {self.kv_policy!r} (known: {', '.join(sorted(policies.POLICIES))})")
        codecs = ["raw", *policies.codec_names()]
        if isinstance(self.cold_codec, str) and self.cold_codec not in codecs or \
                isinstance(self.cold_codec, KVPolicy) and not self.cold_codec.has_codec:
            raise ConfigError(f"--cold-codec must be {' or '.join(codecs)} (got {self.cold_codec})")

    def make_kv_policy(self) -> KVPolicy:
        """The KV policy (made here when given by name; its dataclass checks the knobs)."""
        return policies.resolve(self.kv_policy, self.policy_args)

    def make_cold_codec(self) -> KVPolicy | None:
        """The policy whose codec stores the CPU and disk blocks, or None (raw)."""
        if isinstance(self.cold_codec, str) and self.cold_codec == "raw":
            return None
        return policies.resolve(self.cold_codec, self.codec_args)

    def torch_device(self) -> torch.device:
        """The compute device, normalized (`cuda:<index>`, `cpu`): storage/tiers.py says why."""
        try:
            return resolve_device(self.device)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.float16 if device.type == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    def torch_kv_dtype(self, compute: torch.dtype) -> torch.dtype:
        """How offloaded raw KV blocks are stored under compute dtype `compute` (q8 / q4: they are
        not raw; the compute dtype is what their codec decodes to)."""
        if self.kv_dtype == "auto":
            return torch.bfloat16 if compute == torch.bfloat16 else torch.float16
        if self.kv_bits:
            return compute
        return getattr(torch, self.kv_dtype)

    @property
    def kv_bits(self) -> int | None:
        """--kv-dtype q8 / q4: the bits of the group codec storing the CPU and disk blocks; None: raw."""
        return {"q8": 8, "q4": 4}.get(self.kv_dtype)


def check_engine(policy: Policy, spec, link, micro_batches: int, kv_policy: KVPolicy, cold_codec,
                 is_cuda: bool, kv_bits: int | None = None) -> None:
    """What an engine's configuration may not combine (one ConfigError line each)."""
    if policy.num_gpu_batches % micro_batches:
        raise ConfigError(f"{micro_batches} micro-batches do not divide --num-gpu-batches {policy.num_gpu_batches}")
    if link is not None and link.stage.layers.stop > spec.num_layers:
        raise ConfigError(f"stage {link.stage.index} runs layers up to {link.stage.layers.stop - 1}; "
                          f"{spec.name} has {spec.num_layers}")
    if policy.cpu_cache_compute and not kv_policy.is_full_attention and is_cuda:
        raise ConfigError("--cpu-cache-compute attends CPU blocks in place and cannot apply a "
                          f"--kv-policy selection ({kv_policy.name}); use one or the other")
    if policy.compress_cache + kv_policy.has_codec + (cold_codec is not None) + (kv_bits is not None) > 1:
        raise ConfigError("one KV codec at a time: --compress-cache, --kv-dtype q8/q4, a --kv-policy with its "
                          f"own codec ({', '.join(policies.codec_names())}) and --cold-codec each choose how "
                          "blocks are stored")

