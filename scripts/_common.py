"""Small helpers shared by the scripts: argument errors, timing, machine info, result writing.

Results are written atomically (a temp file in the same directory, then os.replace), so a
crashed or interrupted run never leaves a half-written file under results/.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# this checkout's engine, the one engine_commit() names (not another checkout's installed in editable mode)
if str(REPO) not in sys.path[:1]:
    sys.path.insert(0, str(REPO))

from flexgen_sparpr.utils.args import OneLineParser  # noqa: E402,F401  (the scripts' parser: one-line errors)
from flexgen_sparpr.utils.files import write_atomic  # noqa: E402


def die(msg: str, code: int = 2) -> None:
    """Bad input: one clear line on stderr, then exit (2 by default)."""
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(code)


def check_context(spec, cells: list[tuple[int, int]], flag: str = "--lengths") -> None:
    """cells: (prompt tokens, tokens decoded after it). Refuses up front, in one line, a cell the
    model cannot hold (instead of failing once the cells before it have run)."""
    limit, what = spec.context_limit()
    bad = sorted({(n, new) for n, new in cells if n + new > limit})
    if bad:
        n, new = bad[0]
        die(f"{flag} {n} plus the {new} tokens decoded after it exceed {spec.name}'s {what}: "
            f"the longest prompt that fits is {limit - new}")


def int_list(text: str) -> list[int]:
    """'2048,4096' -> [2048, 4096] (for argparse `type=`; raises ValueError on bad input)."""
    vals = [int(v) for v in text.split(",") if v.strip()]
    if not vals or any(v < 1 for v in vals):
        raise ValueError(text)
    return vals


@contextmanager
def timer():
    """`with timer() as t: ...` then t() is the elapsed wall seconds (frozen at exit)."""
    t0 = time.perf_counter()
    end = []
    yield lambda: (end[0] if end else time.perf_counter()) - t0
    end.append(time.perf_counter())


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def engine_commit() -> str:
    """The engine's git commit (+ "-dirty" with local changes), for the config."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "flexgen_sparpr"], cwd=REPO, capture_output=True,
                               text=True).stdout.strip()
        return rev.stdout.strip() + ("-dirty" if dirty else "")
    except OSError:
        return "unknown"


def machine_info() -> dict:
    import torch
    info = {
        "hostname": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average": load_average(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def write_results(out_dir: Path, stem: str, payload: dict, markdown: str | None = None) -> list[Path]:
    """Write out_dir/stem.json (payload, which should carry its config) and, if given,
    out_dir/stem.md. Returns the paths written."""
    out_dir = Path(out_dir)
    paths = [out_dir / f"{stem}.json"]
    write_atomic(paths[0], json.dumps(payload, indent=2, default=str) + "\n")
    if markdown is not None:
        paths.append(out_dir / f"{stem}.md")
        write_atomic(paths[1], markdown)
    return paths


def md_table(headers: list[str], rows: list[list]) -> str:
    """A GitHub-markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def add_opt_bench_args(ap, gen_len: int) -> None:
    """The flags the OPT offload benchmarks share (bench_sparpr, reproduce_latency)."""
    ap.add_argument("--model", default="opt-125m", help="an OPT size name (default: opt-125m)")
    ap.add_argument("--contexts", default="1024,2048,4096,8192", help="prompt lengths (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per batch (default: 4)")
    ap.add_argument("--gpu-batches", type=int, default=1,
                    help="GPU batches the batch is cut into (FlexGen's --num-gpu-batches); with 2 or more, "
                         "SparPR's recovery of the next cell overlaps the current one's compute (default: 1)")
    ap.add_argument("--gen-len", type=int, default=gen_len, help=f"new tokens per sequence, >= 2 (default: {gen_len})")
    ap.add_argument("--keep-ratio", type=float, default=0.25, help="SparPR's ceiling (default: 0.25)")
    ap.add_argument("--min-keep", type=float, default=0.1, help="SparPR's floor (default: 0.1)")
    ap.add_argument("--gamma", type=float, default=0.9, help="SparPR's dense-fallback threshold (default: 0.9)")
    ap.add_argument("--block-size", type=int, default=64, help="tokens per KV block (default: 64)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar (there is none when stderr is not a terminal)")


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
    """One fresh engine (on the CPU in float32 unless told; "auto": CUDA in float16 when there is
    one; `gpu_mem` caps a CUDA device), the weights split (compute %, CPU %) with the rest on disk,
    the KV cache's compute and CPU shares as given and the rest on the disk tier with
    O_DIRECT, one greedy generation of random prompts: prefill, then gen_len - 1 decode steps.

    Returns prefill/decode seconds, per-step seconds, the bytes moved per link during decode,
    the engine's measured disk read bandwidth, the disk modes, tokens, the policy's stats, and
    with `trace` the per-step trace (runtime/timemodel.py), with `memory` peak memory."""
    import torch
    from flexgen_sparpr.engine.config import EngineConfig, Policy
    from flexgen_sparpr.engine.executor import Engine
    from flexgen_sparpr.engine.memory import PeakMemory
    from flexgen_sparpr.runtime.trace import TraceRecorder

    prompts = random_prompts(src.spec.vocab, batch, ctx, seed)
    cfg = EngineConfig(device=device, dtype=dtype, block_size=block_size, direct_io=True,
                       offload_dir=offload_dir, kv_policy=policy, policy_args=policy_args or {},
                       speculative_prefetch=speculate, gpu_mem=gpu_mem)
    pol = Policy(gpu_batch_size=batch // gpu_batches, num_gpu_batches=gpu_batches,
                 w_gpu_percent=weight_percents[0], w_cpu_percent=weight_percents[1],
                 cache_gpu_percent=cache_gpu_percent, cache_cpu_percent=cache_cpu_percent)
    peak = PeakMemory(cfg.torch_device())
    with peak if memory else _nothing(), Engine(src, pol, cfg) as eng:
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
               "kv_policy_stats": eng.kv_policy.stats() if hasattr(eng.kv_policy, "stats") else None}
        if rec is not None:
            out["trace"] = rec.trace()
    if memory:
        out["memory"] = peak.report()
    return out


@contextmanager
def _nothing():
    yield
