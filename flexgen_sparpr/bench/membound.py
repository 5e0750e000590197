"""The memory-bound floor of a decode step on the CPU: the bytes a step must read at the least
(the weights every token multiplies, the KV its attention reads, and SparPR's key codes it scores)
over the machine's memory read bandwidth, measured one way everywhere: the best of three float32
`sum`s over 1 GiB on the benchmark's threads. A step's ratio to that floor says how far it is from
the memory bus, i.e. how much of it is spent outside streaming the bytes it needs."""
from __future__ import annotations

import time

import torch

GIB = 1 << 30


def read_bandwidth(threads: int, nbytes: int = GIB) -> float:
    """Memory read bandwidth in bytes/s: the best of three sums of a float32 buffer of nbytes."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(nbytes // 4)  # x: [nbytes / 4] float32, written once (its pages in)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            float(x.sum())
            best = min(best, time.perf_counter() - t0)
        return nbytes / best
    finally:
        torch.set_num_threads(before)


def weight_bytes(llm) -> int:
    """Bytes of the weights one decode step multiplies: every layer's but the embedding lookup's
    (a step reads one row of it), in their stored format."""
    eng = llm.engine
    ws = eng.weights
    return sum(ws.stored[name].nbytes for layer, names in zip(eng.layers, ws.layers) if layer.kind != "embed"
               for name in names.values())


def step_bytes(llm, context: int, batch: int, keep: float = 1.0, code_bytes: int = 0) -> dict[str, int]:
    """The least bytes a decode step reads at `context` tokens per sequence: the weights once, the
    KV tokens attention reads (keep of them; resident, in the dtype its tables store them in) and,
    for SparPR, its key codes of every cached token (code_bytes per token and KV head)."""
    spec = llm.spec
    tables = llm.engine.tables  # the last run's (resident_dtype: float16 on a CPU with the kernel)
    size = next(iter(tables.values())).store.resident_dtype.itemsize if tables else llm.engine.dtype.itemsize
    per_token = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * size
    return {"weights": weight_bytes(llm), "kv": int(keep * context * batch * per_token),
            "codes": context * batch * spec.num_layers * spec.num_kv_heads * code_bytes}


def sparpr_code_bytes(config: dict | None, head_dim: int) -> int:
    """Bytes per token and KV head of SparPR's 4-bit key codes (its low-rank summary: rank share x
    head dim directions, two per byte); 0 without them."""
    lowrank = config and (config.get("summary") == "lowrank" or
                          config.get("summary") == "auto" and config.get("summaries_on") != "cpu")
    if not lowrank:
        return 0
    return int(config["summary_rank"] * head_dim) // 2
