"""Run upstream FlexGen (flexgen==0.1.8) with dummy weights: the measured peer. On CUDA as shipped
(unpatched, on the GPU); on the CPU, or when asked (`device="cpu"`), with patches.py's CPU patches.

`run_upstream(...)` runs it in a subprocess (upstream keeps module globals, starts copy threads
and may exhaust memory; a child isolates all of that) and returns its timings and tokens.
`upstream_command(...)` gives the child's argv, for a caller that wants its own memory cap or
timeout. In the child, `generate_upstream(...)` builds upstream's own ExecutionEnv, Policy and
OptLM, warms up as upstream's benchmark does, and reads upstream's own timers.

    python -m flexgen_sparpr.upstream.run --json --model opt-125m --batch 4 --prompt-len 512
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import torch

from ..utils.args import OneLineParser

DEFAULT_PERCENT = (100, 0, 100, 0, 100, 0)


def _prompt_ids(batch: int, prompt_len: int, vocab: int, seed: int) -> np.ndarray:
    """[batch, prompt_len] int: deterministic ids, never upstream's pad id (1) or BOS/EOS (0, 2)."""
    return np.random.default_rng(seed).integers(3, vocab, size=(batch, prompt_len))


def prefill_scores_bytes(batch: int, prompt_len: int, n_head: int, itemsize: int) -> int:
    """Upstream's prefill holds two [B*H, S, S] score tensors at once (bmm, then masked/softmaxed)."""
    return 2 * batch * n_head * prompt_len * prompt_len * itemsize


def _check_memory(batch: int, prompt_len: int, n_head: int, itemsize: int) -> None:
    """Refuse a run whose prefill scores alone exceed the available memory: on a shared machine
    the kernel's OOM killer could pick another process."""
    from ..utils.host import available_memory_bytes
    need, avail = prefill_scores_bytes(batch, prompt_len, n_head, itemsize), available_memory_bytes()
    if need > avail:
        raise MemoryError(f"OOM (predicted): upstream's prefill holds 2 x [B*H, S, S] scores = "
                          f"{need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB available")


def prepare_upstream(device: str = "auto", dtype: str = "auto", gpu_mem: float | None = None) -> dict:
    """Where upstream runs and how, in this process: CUDA unpatched when there is CUDA (device
    "auto") or when asked ("cuda"), with the device capped at gpu_mem GiB; else the CPU with the
    CPU patches. dtype "auto": float16 on CUDA (upstream as shipped), float32 on the CPU (its
    fast type). Returns {"device", "dtype", "patches"} (the patches in force)."""
    from .patches import apply_cpu_patches, use_float32_compute
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda (got {device!r})")
    if dtype not in ("auto", "float16", "float32"):
        raise ValueError(f"dtype must be auto, float16 or float32 (got {dtype!r})")
    on_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if on_cuda and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA device is available")
    if gpu_mem is not None and not on_cuda:
        raise ValueError("--gpu-mem caps a CUDA device; upstream runs on the CPU here")
    if on_cuda and gpu_mem is not None:
        from ..storage.device_memory import apply_cap
        apply_cap(torch.device("cuda", 0), gpu_mem)  # upstream's GPU tier is cuda:0
    patches = [] if on_cuda else apply_cpu_patches()
    dtype = dtype if dtype != "auto" else "float16" if on_cuda else "float32"
    use_float32_compute(dtype == "float32")
    return {"device": "cuda" if on_cuda else "cpu", "dtype": dtype,
            "patches": patches + (["use_float32_compute"] if dtype == "float32" else [])}


def _policy(flex_opt, batch: int, percent, sparsity: float = 1.0, gpu_batches: int = 1):
    """Upstream's Policy with its CLI defaults (one GPU batch unless told, overlap, sep-layer,
    pinned weights); batch is the whole batch, cut into gpu_batches."""
    from flexgen.compression import CompressionConfig
    p = [float(x) for x in percent]
    return flex_opt.Policy(batch // gpu_batches, gpu_batches, p[0], p[1], p[2], p[3], p[4], p[5],
                           True, True, True, False, sparsity,
                           False, CompressionConfig(num_bits=4, group_size=64, group_dim=0, symmetric=False),
                           False, CompressionConfig(num_bits=4, group_size=64, group_dim=2, symmetric=False))


def generate_upstream(model: str = "opt-125m", batch: int = 4, prompt_len: int = 512, gen_len: int = 8,
                      percent=DEFAULT_PERCENT, offload_dir: str | None = None, cut_gen_len: int | None = None,
                      sparpr: dict | None = None, weights: str = "ones", seed: int = 0,
                      warmup: bool = True, dtype: str = "auto", device: str = "auto",
                      gpu_mem: float | None = None, drop_page_cache: bool = False, gpu_batches: int = 1) -> dict:
    """In this process: run one generation (on CUDA as shipped, else patched for the CPU:
    prepare_upstream), return timings and the generated ids ([batch][gen_len]). weights: "ones"
    (upstream's own _DUMMY_) or "engine" (this engine's seeded dummy values). sparpr: keyword
    arguments of `apply_sparpr`, or None. dtype: "float32" (weights and compute; the CPU's fast
    type, as this engine uses on the CPU) or "float16" (upstream's own); "auto" picks by device.
    The KV cache is float16 either way, as upstream stores it. drop_page_cache: its disk tier's
    reads meet the disk (patches.py `uncached_disk_tier`). Returns also the decode steps' seconds
    and the KV bytes its decode loads moved from an offloaded home (the hook's count with
    SparPR, else upstream's whole-cache loads counted from the placement)."""
    where = prepare_upstream(device, dtype, gpu_mem)
    dtype = where["dtype"]
    from flexgen import flex_opt
    from flexgen.opt_config import get_opt_config
    from flexgen.pytorch_backend import TorchDevice, TorchDisk, TorchMixedDevice
    from flexgen.timer import timers
    from flexgen.utils import ExecutionEnv, project_decode_latency

    if min(batch, prompt_len, gen_len) < 1:
        raise ValueError(f"batch, prompt_len and gen_len must be >= 1 (got {batch}, {prompt_len}, {gen_len})")
    if len(percent) != 6 or min(percent) < 0 or any(percent[i] + percent[i + 1] > 100 for i in (0, 2, 4)):
        raise ValueError(f"percent needs six numbers >= 0, each pair summing to <= 100 (got {list(percent)})")
    if weights == "engine":
        from .dummy import use_engine_dummy_weights
        use_engine_dummy_weights(seed)
    elif weights != "ones":
        raise ValueError(f"weights must be 'ones' or 'engine' (got {weights!r})")
    if gpu_batches < 1 or batch % gpu_batches:
        raise ValueError(f"gpu_batches must be >= 1 and divide batch (got {gpu_batches} for {batch})")
    from .patches import uncached_disk_tier
    from .sparpr_hook import apply_sparpr, remove_sparpr, sparpr_stats
    uncached_disk_tier(drop_page_cache)
    if sparpr:
        apply_sparpr(**sparpr)
    else:
        remove_sparpr()

    # dummy weights: a context past OPT's 2048 positions gets a longer table (as --max-seq-len does here)
    config = get_opt_config(model, dtype=np.float32 if dtype == "float32" else np.float16)
    if prompt_len + gen_len > config.max_seq_len:
        config = get_opt_config(model, dtype=config.dtype, max_seq_len=prompt_len + gen_len)
    if where["device"] == "cpu":  # the GPU's own allocator refuses what does not fit
        _check_memory(batch, prompt_len, config.n_head, 4 if dtype == "float32" else 2)
    if offload_dir:
        os.makedirs(offload_dir, exist_ok=True)
    offload = tempfile.mkdtemp(prefix="flexgen-upstream-", dir=offload_dir)  # removed at the end
    gpu, cpu, disk = TorchDevice("cuda:0"), TorchDevice("cpu"), TorchDisk(offload)
    env = ExecutionEnv(gpu=gpu, cpu=cpu, disk=disk, mixed=TorchMixedDevice([gpu, cpu, disk]))
    try:
        lm = flex_opt.OptLM(config, env, flex_opt.DUMMY_WEIGHT, _policy(flex_opt, batch, percent,
                                                                          gpu_batches=gpu_batches))
        try:
            if warmup:  # upstream's benchmark warms up with one 32-token step
                lm.generate(_prompt_ids(batch, 32, config.vocab_size, seed + 1), max_new_tokens=1)
            if sparpr:
                apply_sparpr(**sparpr)  # statistics of the timed generation only
            timers("generate").reset()
            out = lm.generate(_prompt_ids(batch, prompt_len, config.vocab_size, seed),
                              max_new_tokens=gen_len, cut_gen_len=cut_gen_len)
            costs = list(timers("generate").costs)
        finally:
            lm.delete_all_weights()
            lm.delete_all_weights = lambda: None  # upstream's __del__ would delete them twice
    finally:
        env.close_copy_threads()
        shutil.rmtree(offload, ignore_errors=True)
    prefill = costs[0]
    decode = project_decode_latency(costs, prompt_len, gen_len) if cut_gen_len else sum(costs[1:])
    steps = (cut_gen_len or gen_len)
    hook = sparpr_stats().to_dict() if sparpr else None
    offloaded = 1 - float(percent[2]) / 100  # the cache's share off upstream's compute device
    row = batch * config.input_dim * 2 * 2  # K and V of one position, float16
    dense_read = sum(prompt_len + i for i in range(1, steps)) * row * config.num_hidden_layers * offloaded
    return {
        "ok": True, "prefill_s": prefill, "decode_s": decode, "total_s": prefill + decode,
        "step_s": costs[1:], "sparpr_stats": hook,
        "kv_read_bytes": sum(hook["bytes_moved"].values()) if hook else int(dense_read),
        "decode_tok_s": batch * (gen_len - 1) / max(decode, 1e-10),
        "tokens": np.asarray(out)[:, prompt_len:prompt_len + steps].tolist(),
        "projected": bool(cut_gen_len),
        # the child's lifetime peak (ru_maxrss is KiB on Linux), under the key the reports read
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "gpu_peak_reserved_bytes": torch.cuda.max_memory_reserved(0) if where["device"] == "cuda" else 0,
        "config": {"model": model, "batch": batch, "prompt_len": prompt_len, "gen_len": gen_len,
                   "percent": list(percent), "cut_gen_len": cut_gen_len, "sparpr": sparpr,
                   "weights": weights, "seed": seed, "upstream": "flexgen==0.1.8", "dtype": dtype,
                   "kv_dtype": "float16", "threads": torch.get_num_threads(), "device": where["device"],
                   "patches": where["patches"] + (["uncached_disk_tier"] if drop_page_cache else []),
                   "gpu_mem_GiB": gpu_mem, "gpu_batches": gpu_batches},
    }


def upstream_command(model: str = "opt-125m", batch: int = 4, prompt_len: int = 512, gen_len: int = 8,
                     percent=DEFAULT_PERCENT, offload_dir: str | None = None, cut_gen_len: int | None = None,
                     sparpr: dict | None = None, weights: str = "ones", output: str | None = None,
                     dtype: str = "float32", threads: int | None = None, device: str = "cpu",
                     gpu_mem: float | None = None, drop_page_cache: bool = False, gpu_batches: int = 1) -> list[str]:
    """argv of the child that runs `generate_upstream` and prints (or writes) its JSON."""
    cmd = [sys.executable, "-m", "flexgen_sparpr.upstream.run", "--json", "--model", model,
           "--batch", str(batch), "--prompt-len", str(prompt_len), "--gen-len", str(gen_len),
           "--percent", *map(str, percent), "--weights", weights, "--dtype", dtype, "--device", device]
    if gpu_mem is not None:
        cmd += ["--gpu-mem", str(gpu_mem)]
    if drop_page_cache:
        cmd += ["--drop-page-cache"]
    if gpu_batches != 1:
        cmd += ["--gpu-batches", str(gpu_batches)]
    if offload_dir:
        cmd += ["--offload-dir", offload_dir]
    if cut_gen_len:
        cmd += ["--cut-gen-len", str(cut_gen_len)]
    if sparpr:
        cmd += ["--sparpr", json.dumps(sparpr)]
    if output:
        cmd += ["--output", output]
    if threads:
        cmd += ["--threads", str(threads)]
    return cmd


def parse_child(returncode: int, stdout: str, stderr: str) -> dict:
    """The child's result dict, or {"ok": False, "error": one line} when it failed."""
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                break
    if returncode in (-9, 137):
        return {"ok": False, "error": "killed (out of memory?)"}
    tail = [x for x in stderr.strip().splitlines() if x.strip()]
    return {"ok": False, "error": f"exit {returncode}: {tail[-1] if tail else 'no output'}"}


def run_upstream(model: str = "opt-125m", batch: int = 4, prompt_len: int = 512, gen_len: int = 8,
                 percent=(100, 0, 100, 0, 100, 0), offload_dir: str | None = None,
                 cut_gen_len: int | None = None, sparpr: dict | None = None) -> dict:
    """Upstream FlexGen on this CPU (patched) with its own dummy weights, in a subprocess.

    Returns {"ok": True, "prefill_s", "decode_s", "total_s", "decode_tok_s", "tokens": [[...]], ...}
    (tokens: [batch][gen_len] generated ids) or {"ok": False, "error": "<one line>"}. The child
    uses this process's torch thread count, so a caller's `torch.set_num_threads` applies to both."""
    cmd = upstream_command(model, batch, prompt_len, gen_len, percent, offload_dir, cut_gen_len, sparpr,
                           threads=torch.get_num_threads())
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        return {"ok": False, "error": f"could not start upstream: {e}"}
    return parse_child(proc.returncode, proc.stdout, proc.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(description="upstream FlexGen 0.1.8 with dummy weights: as shipped on CUDA, patched on the CPU")
    ap.add_argument("--model", default="opt-125m")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=8)
    ap.add_argument("--percent", type=int, nargs=6, default=list(DEFAULT_PERCENT))
    ap.add_argument("--offload-dir")
    ap.add_argument("--cut-gen-len", type=int)
    ap.add_argument("--sparpr", help="JSON keyword arguments of apply_sparpr, e.g. '{\"keep_ratio\": 0.5}'")
    ap.add_argument("--weights", choices=("ones", "engine"), default="ones",
                    help="ones: upstream's own _DUMMY_ weights; engine: this engine's seeded dummy values")
    ap.add_argument("--dtype", choices=("auto", "float32", "float16"), default="auto",
                    help="weights and compute (the KV cache is float16 either way, as upstream stores it); "
                         "auto: float16 on CUDA (as shipped), float32 on the CPU")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="auto: CUDA, unpatched, when there is one; cpu: the CPU patches (default auto)")
    ap.add_argument("--gpu-mem", type=float, help="cap the CUDA device at this many GiB (an 8 GB card: 8)")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--drop-page-cache", action="store_true",
                    help="its disk tier's reads meet the disk: touched files are flushed and dropped from the "
                         "page cache at each of its disk synchronisations")
    ap.add_argument("--gpu-batches", type=int, default=1, help="FlexGen's --num-gpu-batches (default: 1)")
    ap.add_argument("--json", action="store_true", help="print one JSON line (the result dict)")
    ap.add_argument("--output", help="also write the result JSON here (atomically)")
    args = ap.parse_args(argv)
    try:
        if args.threads is not None:
            if args.threads < 1:
                raise ValueError(f"--threads must be >= 1 (got {args.threads})")
            torch.set_num_threads(args.threads)
        sparpr = json.loads(args.sparpr) if args.sparpr else None
        if sparpr is not None and not isinstance(sparpr, dict):
            raise ValueError("--sparpr must be a JSON object")
        result = generate_upstream(args.model, args.batch, args.prompt_len, args.gen_len, tuple(args.percent),
                                   args.offload_dir, args.cut_gen_len, sparpr, weights=args.weights,
                                   dtype=args.dtype, device=args.device, gpu_mem=args.gpu_mem,
                                   drop_page_cache=args.drop_page_cache, gpu_batches=args.gpu_batches)
    except Exception as e:  # one line for the caller; bad input (ValueError, ...) exits 2
        msg = str(e).strip().splitlines()[0] if str(e).strip() else "no message"
        result = {"ok": False, "error": f"{type(e).__name__}: {msg}"}
        code = 2 if isinstance(e, (ValueError, ImportError, NotImplementedError)) else 1
    else:
        code = 0
    if args.output:
        from ..utils.files import write_json_atomic
        write_json_atomic(args.output, result)
    if args.json:
        print(json.dumps(result))
    elif result["ok"]:
        print(f"prefill {result['prefill_s']:.3f} s, decode {result['decode_s']:.3f} s, "
              f"{result['decode_tok_s']:.2f} tok/s")
    else:
        print(f"error: {result['error']}", file=sys.stderr)
    return code


if __name__ == "__main__":
    from ..utils.guard import guarded
    sys.exit(guarded(main))  # one error line for any failure, signals included (utils/guard.py)
