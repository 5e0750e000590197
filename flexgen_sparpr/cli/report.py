"""FlexGen's summary lines and `fo-...` benchmark log (kept byte-compatible for log parsers),
plus the engine's --output-json."""
from __future__ import annotations

import re


GB = 1 << 30


def size_label(spec) -> str:
    """The model's size as upstream's log names spell it ("6.7b", "125m"): from a known name's
    suffix, else from the parameter count; never from a path (a folder or .gguf file name)."""
    m = re.search(r"-(\d+(?:\.\d+)?[mb])$", spec.name.lower())
    if m:
        return m.group(1)
    n = spec.num_params()
    return f"{n / 1e9:.3g}b" if n >= 1e9 else f"{n / 1e6:.3g}m"


def flexgen_log_name(run, policy, spec, prompt_len: int | None = None) -> str:
    """Upstream's automatic log name: fo-<size>-gbs<g>-ngbs<n>-prompt<p>-gen<g>-percent-<...>,
    with the placement the run used (--policy auto's choice, not the default --percent) and the
    prompt length it ran (a user's prompt's own, not --prompt-len's)."""
    size = size_label(spec)
    pct = (policy.w_gpu_percent, policy.w_cpu_percent, policy.cache_gpu_percent, policy.cache_cpu_percent,
           policy.act_gpu_percent, policy.act_cpu_percent)
    percent = "".join(f"{p:g}-" for p in pct)
    name = (f"fo-{size}-gbs{policy.gpu_batch_size}-ngbs{policy.num_gpu_batches}-prompt{prompt_len or run.prompt_len}-"
            f"gen{run.gen_len}-percent-{percent}")
    name += "cpu-cache" if policy.cpu_cache_compute else "gpu-cache"
    if policy.compress_weight:
        name += "-compw"
    if policy.compress_cache:
        name += "-compc"
    return name + ".log"


def project_decode_latency(step_times: list[float], gen_len: int) -> float:
    """Decode latency for gen_len tokens from a shorter run: the first two decode steps as
    measured (warm-up), the rest at the mean of the later ones."""
    decode = step_times[1:]
    warm = decode[:2]
    rest = decode[2:] or decode[-1:]
    return sum(warm) + sum(rest) / len(rest) * max(0, gen_len - 1 - len(warm))


def summary(model_bytes, cache_bytes, hidden_bytes, gpu_peak, projected, prefill_lat, prefill_tput,
            decode_lat, decode_tput, total_lat, total_tput) -> str:
    return (f"model size: {model_bytes / GB:.3f} GB\t"
            f"cache size: {cache_bytes / GB:.3f} GB\t"
            f"hidden size (p): {hidden_bytes / GB:.3f} GB\n"
            f"peak gpu mem: {gpu_peak / GB:.3f} GB\t"
            f"projected: {projected}\n"
            f"prefill latency: {prefill_lat:.3f} s\t"
            f"prefill throughput: {prefill_tput:.3f} token/s\n"
            f"decode latency: {decode_lat:.3f} s\t"
            f"decode throughput: {decode_tput:.3f} token/s\n"
            f"total latency: {total_lat:.3f} s\t"
            f"total throughput: {total_tput:.3f} token/s")
