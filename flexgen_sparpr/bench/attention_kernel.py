"""Decode attention's kernels side by side (scripts/bench_attention.py): torch's fused CPU kernel,
as the engine calls it without the compiled one, against the compiled CPU kernel
(models/cpu_kernel.py), on caches shaped like SmolLM2's (3 KV heads, 3 query heads each, head size
64), one layer's cache per layer of a 30-layer model so that each call reads its K/V from memory
(not from a cache a previous call warmed). Per context, batch and K/V dtype: milliseconds a layer and
the K/V bytes read per second. With `sparse`: SparPR-like reads of 10 % of the 16-token blocks, picked
at random, gathered then attended (the engine's path before) against read in place by their rows."""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from ..models import cpu_kernel
from ..models.layers import kernel_decode
from .args import die
from .results import engine_commit, machine_info, md_table

HKV, G, D, LAYERS, BLOCK = 3, 3, 64, 30, 16


def _timed(f, repeats: int) -> float:
    """Median seconds of one pass of f over every layer (after one warm pass)."""
    f()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def torch_decode(q, k, v):
    """The engine's decode attention without the compiled kernel (models/layers.py decode_attention)."""
    b, h, _, d = q.shape
    return F.scaled_dot_product_attention(q.reshape(b, HKV, G, d), k, v).reshape(b, h, 1, d)


def cell(tokens: int, batch: int, dtype: torch.dtype, repeats: int, keep: float, seed: int) -> dict:
    """One context, batch and K/V dtype: dense and block-sparse reads, torch's kernel and the compiled one."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, HKV * G, 1, D, generator=gen).to(dtype)  # q: [B, H, 1, D]
    caches = [torch.randn(2, batch, HKV, tokens + 64, D, generator=gen).to(dtype) for _ in range(LAYERS)]
    views = [(c[0, :, :, :tokens], c[1, :, :, :tokens]) for c in caches]  # a narrowed arena, as the engine's
    nb = tokens // BLOCK
    picked = torch.randperm(nb, generator=gen)[:max(1, int(keep * nb))].sort().values
    rows = (picked[:, None] * BLOCK + torch.arange(BLOCK)).flatten()  # rows: [T'] the picked blocks' tokens
    kv_bytes = 2 * batch * HKV * D * caches[0].element_size()  # one token's K and V
    out = {"tokens": tokens, "batch": batch, "kv_dtype": str(dtype).removeprefix("torch."), "keep": keep}

    def per_layer(f) -> float:
        return _timed(lambda: [f(k, v) for k, v in views], repeats) / LAYERS

    out["dense_torch_ms"] = per_layer(lambda k, v: torch_decode(q, k, v)) * 1e3
    out["sparse_gather_torch_ms"] = per_layer(
        lambda k, v: torch_decode(q, k.index_select(2, rows), v.index_select(2, rows))) * 1e3
    if cpu_kernel.kernel() is not None:
        out["dense_kernel_ms"] = per_layer(lambda k, v: kernel_decode(q, k, v, None)) * 1e3
        out["sparse_rows_kernel_ms"] = per_layer(lambda k, v: kernel_decode(q, k, v, None, rows[None])) * 1e3
    out["dense_GB"] = tokens * kv_bytes / 1e9
    out["sparse_GB"] = len(rows) * kv_bytes / 1e9
    return out


def grid(args) -> tuple[list[int], list[int], list[str]]:
    """(lengths, batches, K/V dtypes) from the flags; one line and exit 2 when they are not usable."""
    try:
        lengths, batches = ([int(x) for x in v.split(",") if x] for v in (args.lengths, args.batches))
    except ValueError:
        die("--lengths and --batches are comma-separated integers")
    dtypes = [d for d in args.kv_dtypes.split(",") if d]
    if not lengths or min(lengths) < 16 or not batches or min(batches) < 1 or args.repeats < 1 or \
            not 0 < args.keep <= 1 or not dtypes or not set(dtypes) <= {"float32", "bfloat16", "float16"}:
        die("--lengths >= 16, --batches >= 1, --repeats >= 1, --keep in (0, 1], --kv-dtypes of "
            "float32, bfloat16, float16")
    return lengths, batches, dtypes


def run(args, command: list[str]) -> dict:
    """Every cell of the grid (printed as it ends), with the configuration, the commit, the machine
    and the command."""
    lengths, batches, dtypes = grid(args)
    torch.set_num_threads(args.threads)
    built = cpu_kernel.kernel() is not None
    cells = []
    for n in lengths:
        for b in batches:
            for d in dtypes:
                cells.append(cell(n, b, getattr(torch, d), args.repeats, args.keep, args.seed))
                print(cells[-1], flush=True)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    config["engine_commit"] = engine_commit()
    config["kernel"] = f"compiled ({cpu_kernel.built_for()})" if built else f"not built: {cpu_kernel.why_not()}"
    return {"config": config, "machine": machine_info(), "cells": cells, "command": "python " + " ".join(command)}


def report(payload: dict) -> str:
    """The results file's markdown: one row a cell."""
    config, cells = payload["config"], payload["cells"]
    f = lambda c, key: f"{c[key]:.3f}" if key in c else "not built"  # noqa: E731
    ratio = lambda c, a, b: f"{c[a] / c[b]:.2f}x" if b in c else ""  # noqa: E731
    rows = [[c["tokens"], c["batch"], c["kv_dtype"], f(c, "dense_torch_ms"), f(c, "dense_kernel_ms"),
             ratio(c, "dense_torch_ms", "dense_kernel_ms"),
             f"{c['dense_GB'] / (c['dense_kernel_ms'] / 1e3):.1f}" if "dense_kernel_ms" in c else "",
             f(c, "sparse_gather_torch_ms"), f(c, "sparse_rows_kernel_ms"),
             ratio(c, "sparse_gather_torch_ms", "sparse_rows_kernel_ms")] for c in cells]
    return (f"# Decode attention: torch's CPU kernel against the compiled one (engine {config['engine_commit']})\n\n"
            f"Machine: {payload['machine'].get('cpu_model')}, {config['threads']} threads, torch "
            f"{payload['machine'].get('torch')}; kernel: {config['kernel']}. One decode query per head, SmolLM2's "
            f"heads (3 KV heads x 3 query heads, head size 64), 30 layers' caches read in turn; ms a layer, "
            f"median of {config['repeats']} passes. Sparse: {config['keep']:g} of the 16-token blocks, at random. "
            "Produced by `scripts/bench_attention.py`.\n\n"
            + md_table(["tokens", "batch", "K/V dtype", "dense, torch ms", "dense, compiled ms", "speed-up",
                        "compiled GB/s", "sparse, gather + torch ms", "sparse, rows in place ms", "speed-up"], rows))


def main(argv=None) -> int:
    """scripts/bench_attention.py's command line."""
    import sys
    from pathlib import Path
    from .args import OneLineParser
    from .results import REPO, write_results
    ap = OneLineParser(description="Decode attention's kernels: torch's fused CPU kernel against the compiled one")
    ap.add_argument("--lengths", default="2048,4096,8000", help="context lengths, tokens (default: 2048,4096,8000)")
    ap.add_argument("--batches", default="1,4", help="batch sizes (default: 1,4)")
    ap.add_argument("--kv-dtypes", default="float32,bfloat16", help="K/V dtypes (default: float32,bfloat16)")
    ap.add_argument("--keep", type=float, default=0.1, help="share of blocks the sparse reads pick (default: 0.1)")
    ap.add_argument("--repeats", type=int, default=10, help="timed passes over the layers (default: 10)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    ap.add_argument("--seed", type=int, default=0, help="picks the sparse reads' blocks (default: 0)")
    ap.add_argument("--out", default=str(REPO / "results" / "attention"), help="output folder")
    args = ap.parse_args(argv)
    payload = run(args, ["scripts/bench_attention.py", *(argv if argv is not None else sys.argv[1:])])
    print("\n".join(map(str, write_results(Path(args.out), "attention", payload, report(payload)))))
    return 0
