"""scripts/device_tokens.py's runs: one greedy generation with its logits on a device, dtype and
placement, and where two runs' tokens first part. float16's departures are judged against the
CPU's top-1 margin there (FP16_TIE)."""
from __future__ import annotations

# float16 resolves a logit of magnitude ~20 to 2**-6 = 0.016 (half an ulp 0.008); two of its
# roundings plus the layers' own: a CPU margin under this is a tie float16 cannot break
FP16_TIE = 0.05


# --percent's six numbers by name, with their defaults (everything on the compute tier)
PERCENT = {"w_gpu_percent": 100, "w_cpu_percent": 0, "cache_gpu_percent": 100, "cache_cpu_percent": 0,
           "act_gpu_percent": 100, "act_cpu_percent": 0}


def run(src, prompts, n, device, dtype, placement, kv_dtype="auto"):
    """Greedy tokens [B][n], logits [B, n, V] (on the CPU) of `prompts` on a fresh LLM, and the
    configuration it resolved; placement: the percents it changes by name ({"cache_gpu_percent": 0, ...});
    kv_dtype: --kv-dtype (how blocks on the CPU and disk tiers are stored; "float32" keeps them exact)."""
    import torch

    from ..api.llm import LLM
    from ..api.resolved import resolved
    percent = [placement.get(k, v) for k, v in PERCENT.items()]
    with LLM(src, gpu_batch_size=len(prompts), percent=percent, device=device, dtype=dtype, block_size=64,
             offload_dir="unused", quiet=True, kv_dtype=kv_dtype) as llm:
        r = llm.engine.generate(prompts, n, keep_logits=True)
        config = resolved(llm)
    return r.tokens, torch.stack(r.logits, 1), config  # logits: [B, n, V] on the CPU


def first_departure(a, b):
    """(row, step) of the earliest position where the token lists differ, or None."""
    found = [(i, s) for i, (ra, rb) in enumerate(zip(a, b)) for s, (x, y) in enumerate(zip(ra, rb)) if x != y]
    return min(found, key=lambda p: p[1]) if found else None
