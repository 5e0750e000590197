"""The configuration a benchmark ran at, as the engine resolved it: what every results file records
beside its numbers (issue 34's list: block size, summary kind, keep, floor, compute dtype, weight
format and KV dtype as the start-up probe chose them, placement), read from an open `LLM`."""
from __future__ import annotations

import dataclasses

from ..kv.knobs import knobs


def policy_knobs(policy) -> dict:
    """A KV policy's name and every knob's value (SparPR: keep, floor, summary kind, ...)."""
    return {"name": policy.name, **{k.name: getattr(policy, k.name) for k in knobs(type(policy))}}


def decode_attention_kernel(device) -> str:
    """Which kernel a decode step's attention runs on (models/cpu_kernel.py: the compiled one on a
    CPU with AVX-512 or AVX2 where it is built; else torch's)."""
    if device.type != "cpu":
        return "torch"
    from ..models import cpu_kernel
    built = cpu_kernel.built_for()
    return f"compiled ({built})" if built else f"torch ({cpu_kernel.why_not()})"


def resolved(llm, policies: dict | None = None) -> dict:
    """The LLM's engine settings as resolved (device, dtypes, block size, weight format, placement,
    cold codec, schedule) and its KV policy's knobs; policies: {label: policy} of the others a
    compare() decoded, each with its knobs."""
    eng = llm.engine
    cfg, pol = eng.cfg, eng.policy
    out = {"device": str(eng.devices.compute), "compute_dtype": str(eng.dtype).removeprefix("torch."),
           "kv_dtype": cfg.kv_dtype if cfg.kv_bits else str(cfg.torch_kv_dtype(eng.dtype)).removeprefix("torch."),
           "block_size": cfg.block_size,
           "weight_format": eng.weight_format.describe(),
           "decode_attention": decode_attention_kernel(eng.devices.compute),
           "placement": {"gpu_batch_size": pol.gpu_batch_size, "num_gpu_batches": pol.num_gpu_batches,
                         "weights": list(pol.weight_percents), "kv": list(pol.cache_percents),
                         "activations": [pol.act_gpu_percent, pol.act_cpu_percent]},
           "schedule": {f.name: getattr(pol, f.name) for f in dataclasses.fields(pol)
                        if f.name in ("overlap", "sep_layer", "cpu_cache_compute", "attn_sparsity",
                                      "compress_weight", "compress_cache")},
           "direct_io": cfg.direct_io, "speculative_prefetch": cfg.speculative_prefetch,
           "cold_codec": cfg.cold_codec if isinstance(cfg.cold_codec, str) else cfg.cold_codec.name,
           "kv_policy": policy_knobs(eng.kv_policy)}
    if policies:
        out["compared"] = {label: policy_knobs(p) for label, p in policies.items()}
    return out
