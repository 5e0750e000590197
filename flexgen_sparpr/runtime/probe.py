"""A short start-up probe of the machine's speeds, cached per machine.

Measures host <-> device copy bandwidth (CUDA only), the O_DIRECT read bandwidth of the disk a
folder lies on (storage/disk_store.py `disk_bandwidth`; one entry per file system, whatever the
folder: utils/host.py `disk_key`), per dtype the matmul FLOP/s and one small matmul's latency on
the compute device, and on the CPU how fast each weight format multiplies (the choice of
--weight-format auto). The answers are cached in `default_cache_dir()/probe-<hostname>-<device>.json`
and extended when a new dtype or disk is asked for; `refresh=True` measures again.
"""
from __future__ import annotations

import json
import math
import platform
import re
import time
from pathlib import Path

import torch

from ..storage.disk_store import disk_bandwidth
from ..utils.files import write_json_atomic
from ..utils.host import disk_key
from ..utils.paths import default_cache_dir
from .costs import dtype_name

VERSION = 1
COPY_BYTES = 64 << 20
DISK_BYTES = 32 << 20
MIN_TIMED_S = 0.05  # repeat a measurement until it has run this long (timer noise)


def device_label(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    idx = device.index if device.index is not None else torch.cuda.current_device()
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", torch.cuda.get_device_name(idx))
    return f"cuda{idx}-{name}"


def cache_path(device: torch.device, cache_dir: Path | None = None) -> Path:
    host = re.sub(r"[^A-Za-z0-9_.-]+", "_", platform.node() or "host")
    return Path(cache_dir or default_cache_dir()) / f"probe-{host}-{device_label(device)}.json"


def load(path: Path) -> dict | None:
    """The cached probe, or None when missing, unreadable or from another format version."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("version") == VERSION else None


def save(path: Path, data: dict) -> None:
    """Atomically (temp file, then rename): concurrent runs never read half a file."""
    write_json_atomic(path, data)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> float:
    """Seconds per call of fn, after one warm-up call, repeated for at least MIN_TIMED_S."""
    fn()
    _sync(device)
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        _sync(device)
        dt = time.perf_counter() - t0
        if dt >= MIN_TIMED_S and n >= 3:
            return dt / n


def measure_copy(device: torch.device, nbytes: int = COPY_BYTES) -> tuple[float, float]:
    """(host->device, device->host) bytes/s through pinned host memory."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = _timed(lambda: dev.copy_(host, non_blocking=True), device)
    d2h = _timed(lambda: host.copy_(dev, non_blocking=True), device)
    return nbytes / h2d, nbytes / d2h


def measure_matmul(device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """(FLOP/s of a square matmul, seconds of one small [16, 64] @ [64, 64] matmul call)."""
    n = 4096 if device.type == "cuda" else 512
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    flops = 2 * n ** 3 / _timed(lambda: a @ b, device)
    x, w = torch.randn(16, 64, device=device).to(dtype), torch.randn(64, 64, device=device).to(dtype)
    return flops, _timed(lambda: x @ w, device)


def _empty(device: torch.device) -> dict:
    """A probe file with nothing measured yet."""
    return {"version": VERSION, "hostname": platform.node(), "device": device_label(device),
            "torch": torch.__version__, "h2d_Bps": None, "d2h_Bps": None, "disk": {},
            "matmul_flops": {}, "matmul_latency_s": {}}


def probe(device: torch.device, dtypes: list[torch.dtype], disk_dir: str | Path,
          refresh: bool = False, cache_dir: Path | None = None) -> dict:
    """The machine's speeds for `device`, the given dtypes and the disk folder `disk_dir`,
    measured once per machine and cached (see the module docstring)."""
    path = cache_path(device, cache_dir)
    data = (None if refresh else load(path)) or _empty(device)
    changed = False
    if device.type == "cuda" and data["h2d_Bps"] is None:
        data["h2d_Bps"], data["d2h_Bps"] = measure_copy(device)
        changed = True
    if any(k.startswith("/") for k in data["disk"]):  # an older file's entries, one per folder
        data["disk"] = {k: v for k, v in data["disk"].items() if not k.startswith("/")}
        changed = True
    folder = Path(disk_dir).expanduser().resolve()
    key = disk_key(folder)
    if key not in data["disk"]:
        # out of inference mode: storage/disk.py keeps a per-thread staging buffer, and one made
        # as an inference tensor would refuse later writes outside inference mode
        with torch.inference_mode(False):
            bw = disk_bandwidth(folder, nbytes=DISK_BYTES, direct=True, chunk_bytes=4 << 20)
        data["disk"][key] = {"read_Bps": bw["read_GBps"] * 1e9, "write_Bps": bw["write_GBps"] * 1e9,
                             "mode": bw["mode"], "measured_in": str(folder)}
        changed = True
    for dt in dtypes:
        if dtype_name(dt) not in data["matmul_flops"]:
            flops, lat = measure_matmul(device, dt)
            data["matmul_flops"][dtype_name(dt)], data["matmul_latency_s"][dtype_name(dt)] = flops, lat
            changed = True
    if changed:
        data["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        save(path, data)
    return data


def disk_entry(data: dict, disk_dir: str | Path) -> dict:
    """The probe's figures for the disk `disk_dir` lies on (read_Bps, write_Bps, mode, measured_in)."""
    return data["disk"][disk_key(disk_dir)]


WEIGHT_PROBE_SHAPES = ((1024, 1024), (4096, 1024), (1024, 4096))  # a decoder layer's kinds of matrix
WEIGHT_PROBE_LAYERS = 6  # 6 x 9.4 M weights, 226 MB in float32: larger than any cache, as a model is
# rounds over every format, each format's best round kept: a burst of other work on the machine
# (an install beside `prepare`) slows one round, not the choice (one round had picked float32
# weights at 0.4 ms against int4's 6.7 ms, where int4 is 4x faster)
WEIGHT_PROBE_ROUNDS = 5


def measure_weight_formats(rows: int, formats=("raw", "bfloat16", "int8", "int4")) -> dict[str, float]:
    """Seconds per product of a [rows, in] input with each format's weights, as the engine runs them
    (models/layers.linear; raw float32 transposed at one row, as engine/weights.py stores it),
    streamed from memory: WEIGHT_PROBE_LAYERS layers of distinct weights, so no cache holds them.
    A format the machine's torch lacks a kernel for is left out."""
    from ..models.layers import Transposed, linear
    from ..models.packed import pack
    gen = torch.Generator().manual_seed(0)
    raws = [torch.randn(s, generator=gen) * 0.02 for _ in range(WEIGHT_PROBE_LAYERS) for s in WEIGHT_PROBE_SHAPES]
    xs = {n: torch.randn(rows, n, generator=gen) for n in {s[1] for s in WEIGHT_PROBE_SHAPES}}
    runs = {}
    for fmt in formats:
        try:
            ws = [Transposed(w.T.contiguous()) if fmt == "raw" and rows == 1 else pack(w, fmt) for w in raws]
            run = lambda ws=ws: [linear(xs[w.shape[1] if not isinstance(w, Transposed) else w.t.shape[0]], w) for w in ws]
            run()  # a kernel the build lacks fails here, before any timing
        except (RuntimeError, NotImplementedError):  # no such kernel in this build of torch
            continue
        runs[fmt] = (run, len(ws))
    out = dict.fromkeys(runs, math.inf)
    for _ in range(WEIGHT_PROBE_ROUNDS):  # interleaved: every format in every round
        for fmt, (run, n) in runs.items():
            out[fmt] = min(out[fmt], _timed(run, torch.device("cpu")) / n)
    return out


def weight_formats(rows: int, refresh: bool = False, cache_dir: Path | None = None) -> dict[str, float]:
    """measure_weight_formats on the CPU for `rows` rows (one sequence, or a batch of up to 16),
    measured once per machine and cached with the probe (`prepare` and `profile` measure it anew)."""
    rows = 1 if rows <= 1 else min(rows, 16)
    path = cache_path(torch.device("cpu"), cache_dir)
    data = load(path) or _empty(torch.device("cpu"))
    kernels = _kernels()
    if data.get("weight_format_kernels") != kernels:  # measured with other kernels (or none built then)
        data["weight_format_s"], data["weight_format_kernels"] = {}, kernels
    table = data.setdefault("weight_format_s", {})
    if refresh or str(rows) not in table:
        table[str(rows)] = measure_weight_formats(rows)
        data["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        save(path, data)
    return table[str(rows)]


def _kernels() -> str:
    """Which compiled CPU kernels the weight formats run on here (models/cpu_kernel.py: its build's name,
    which changes with its sources, this CPU's flags and torch), or why none: a table measured with
    other kernels is measured anew."""
    from ..models import cpu_kernel
    return cpu_kernel.build_name() if cpu_kernel.kernel() is not None else f"none ({cpu_kernel.why_not()})"


def say_weight_formats(say, refresh: bool = True) -> None:
    """Measure (refresh) the weight formats at one row and at a batch of 4, and say what was found."""
    for rows in (1, 4):
        t = weight_formats(rows, refresh=refresh)
        say(f"weight formats, {rows} row{'s' if rows > 1 else ''}: " +
            ", ".join(f"{f} {s * 1e6:.0f} us" for f, s in sorted(t.items(), key=lambda kv: kv[1])) +
            " per product (a 4 M-weight matrix streamed from memory)")
