"""One offloaded generation on a fresh LLM, measured: what the OPT offload benchmarks
(bench_sparpr.py, reproduce_latency.py, bench_throttled.py, bench_ablations.py) time for this
engine (run_offload, its policy's knobs from their flags: policy_knobs); the device and dtype
the engine picks for their flags (resolve_device); and OPT dummy weights drawn once for all the
LLMs of a run (opt_source: a weights/sources.py OnceSource)."""
from __future__ import annotations

from contextlib import nullcontext


def resolve_device(device: str = "auto", dtype: str = "auto"):
    """(torch device, torch dtype) the engine runs these flags on ("auto": CUDA in float16 when
    there is one, else the CPU in float32); ConfigError (a ValueError) on a bad pair."""
    from ..config.options import resolve
    cfg = resolve({"device": device, "dtype": dtype})[2]
    return cfg.torch_device(), cfg.torch_dtype(cfg.torch_device())


def opt_source(model: str, max_seq_len: int, seed: int, device: str = "cpu", dtype: str = "float32"):
    """OPT `model` with seeded dummy weights for max_seq_len positions, each tensor drawn once in
    the dtype the engine runs on `device` (an OnceSource); ModelNotFound or ValueError on bad input."""
    from ..weights.resolve import resolve_source
    from ..weights.sources import OnceSource
    return OnceSource(resolve_source(model, "_DUMMY_", max_seq_len=max_seq_len, seed=seed),
                      resolve_device(device, dtype)[1])


def policy_knobs(args, policy: str, **extra) -> dict:
    """A run's policy knobs from the OPT offload flags: none for the reference (dense), else
    SparPR's --keep-ratio, --min-keep, --min-keep-tokens and --gamma, its probe under --offload-dir,
    and `extra`."""
    from .sweep import REFERENCE
    if policy == REFERENCE:
        return {}
    return dict(keep_ratio=args.keep_ratio, min_keep=args.min_keep, min_keep_tokens=args.min_keep_tokens,
                gamma=args.gamma, probe_dir=args.offload_dir, **extra)


def random_prompts(vocab: int, batch: int, ctx: int, seed: int) -> list[list[int]]:
    """batch random prompts of ctx ids in [4, vocab) (no pad/BOS/EOS), seeded by seed + ctx."""
    import torch
    gen = torch.Generator().manual_seed(seed + ctx)
    return torch.randint(4, vocab, (batch, ctx), generator=gen).tolist()


def run_offload(src, *, batch: int, ctx: int, gen_len: int, policy: str = "dense", policy_args: dict | None = None,
                block_size: int = 64, offload_dir: str, cache_gpu_percent: float = 0, seed: int = 0,
                trace: bool = False, memory: bool = False, gpu_batches: int = 1, device: str = "cpu",
                dtype: str = "float32", speculate: bool = False, cache_cpu_percent: float = 0,
                weight_percents: tuple[float, float] = (100, 0), gpu_mem: float | None = None) -> dict:
    """One fresh LLM (on the CPU in float32 unless told; "auto": CUDA in float16 when there is
    one; `gpu_mem` caps a CUDA device), the weights split (compute %, CPU %) with the rest on disk,
    the KV cache's compute and CPU shares as given and the rest on the disk tier with
    O_DIRECT, one greedy generation of random prompts: prefill, then gen_len - 1 decode steps.

    Returns prefill/decode seconds, per-step seconds, the bytes moved per link during decode,
    the engine's measured disk read bandwidth, the disk modes, tokens, the policy's stats, the
    configuration as the engine resolved it (api/resolved.py), and with `trace` the per-step
    trace (runtime/timemodel.py), with `memory` peak memory."""
    from ..api.llm import LLM
    from ..api.measure import PeakMemory
    from ..runtime.trace import TraceRecorder
    from ..api.resolved import resolved

    prompts = random_prompts(src.spec.vocab, batch, ctx, seed)
    percent = [*weight_percents, cache_gpu_percent, cache_cpu_percent, 100, 0]
    flags = dict(device=device, dtype=dtype, block_size=block_size, direct_io=True, offload_dir=offload_dir,
                 kv_policy=policy, policy_args=policy_args or {}, speculative_prefetch=speculate, gpu_mem=gpu_mem,
                 gpu_batch_size=batch // gpu_batches, num_gpu_batches=gpu_batches, quiet=True,
                 percent=[int(p) if float(p).is_integer() else p for p in percent])  # --percent: integers
    peak = PeakMemory(resolve_device(device, dtype)[0])
    with peak if memory else nullcontext(), LLM(src, **flags) as llm:
        eng = llm.engine
        rec = TraceRecorder(eng) if trace else None
        st = eng.prefill(prompts, gen_len)
        before, before_req = eng.devices.counters.snapshot(), eng.devices.counters.requests()
        res = eng.decode(st)
        moved = {k: v - before.get(k, 0) for k, v in eng.devices.counters.snapshot().items()}
        requests = {k: v - before_req.get(k, 0) for k, v in eng.devices.counters.requests().items()}
        spec = eng.devices.counters.tagged("speculative")
        out = {"prefill_s": res.step_times[0], "decode_s": sum(res.step_times[1:]), "step_s": res.step_times[1:],
               "speculative_bytes": spec.get("disk->cpu", 0) + spec.get("cpu->compute", 0),
               "bytes_moved": moved, "requests": requests, "disk_read_Bps": eng.devices.counters.bandwidth("disk", "cpu"),
               "disk_mode": sorted({f.direct_mode for f in eng.disk.files.values()}) if eng.disk else [],
               "tokens": res.tokens, "device": str(eng.devices.compute), "dtype": str(eng.dtype).removeprefix("torch."),
               "kv_policy_stats": eng.kv_policy.stats() if hasattr(eng.kv_policy, "stats") else None,
               "resolved": resolved(llm)}
        if rec is not None:
            out["trace"] = rec.trace()
    if memory:
        out["memory"] = peak.report()
    return out
