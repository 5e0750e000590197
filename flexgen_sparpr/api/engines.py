"""The engine one floor below `LLM`, for benchmarks (flexgen_sparpr/bench/) that set what LLM
resolves from flags field by field: a KV block per cache family, observer policies in a prefill,
their own samplers (teacher forcing), several decodes of one prefill. The benchmarks reach the
engine only through this module and `LLM` (an import-linter contract in pyproject.toml).

    eng = open_engine(source, {"gpu_batch_size": 2}, block_size=256, kv_policy="dkv")
    snap = eng.snapshot(eng.prefill(prompts, max_new, observers=(other_policy,)))
    eng.set_kv_policy(other_policy, attach=False)
    res = eng.decode(eng.restore(snap), stop=eos)   # res.tokens, res.step_times, res.step_parts

An engine's public calls: prefill(prompts, max_new, sampler, observers) -> state; decode(state,
stop) -> result; generate(prompts, max_new, keep_logits); snapshot(state) / restore(snapshot) ->
a fresh state whose cache is the prefill's; set_kv_policy(policy, attach); kv_policy, tables,
devices.counters (bytes moved per link), disk, weight_format, cfg (its EngineConfig), close().
Also here: PeakMemory (a block's peak RSS and GPU memory) and disk_bandwidth (a folder's speed).
"""
from __future__ import annotations

from ..engine.config import EngineConfig, Policy
from ..engine.executor import Engine
from ..engine.memory import PeakMemory  # noqa: F401  (peak RSS / GPU memory of a block: the API's)
from ..engine.sampling import Sampler
from ..storage.disk_store import disk_bandwidth  # noqa: F401  (a folder's measured disk read/write speed)


def engine_config(**settings) -> EngineConfig:
    """The engine's settings (device, dtype, block_size, kv_policy, policy_args, cold_codec,
    offload_dir, direct_io, weight_format, ...; the defaults of a bare EngineConfig), unresolved
    beyond what EngineConfig resolves itself (torch_dtype, torch_kv_dtype on a device)."""
    return EngineConfig(**settings)


def placement(**fields) -> Policy:
    """FlexGen's placement (gpu_batch_size, num_gpu_batches, the weight/cache/activation
    percents per tier; by default everything on the compute tier)."""
    return Policy(**fields)


def open_engine(source, placement_fields: dict | None = None, **settings) -> Engine:
    """An engine on a resolved model source (weights/resolve.py's resolve_source), its placement
    given as placement()'s fields and its settings as engine_config()'s. Close it (or use `with`)."""
    return Engine(source, placement(**(placement_fields or {})), engine_config(**settings))


def greedy() -> Sampler:
    """The engine's greedy sampler (argmax of each step's logits)."""
    return Sampler()
