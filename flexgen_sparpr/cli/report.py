"""FlexGen's summary lines and `fo-...` benchmark log (kept byte-compatible for log parsers),
plus the engine's --output-json."""
from __future__ import annotations


GB = 1 << 30


def flexgen_log_name(run, policy) -> str:
    """Upstream's automatic log name: fo-<size>-gbs<g>-ngbs<n>-prompt<p>-gen<g>-percent-<...>."""
    size = run.model.rstrip("/").split("-")[-1]
    percent = "".join(f"{p}-" for p in run.percent)
    name = (f"fo-{size}-gbs{policy.gpu_batch_size}-ngbs{policy.num_gpu_batches}-prompt{run.prompt_len}-"
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


def append_log(path: str, text: str) -> None:
    with open(path, "a") as f:
        f.write(text + "\n")
