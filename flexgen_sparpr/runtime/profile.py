"""Measure this machine into a Hardware object (`flexgen-sparpr profile`).

Reuses the start-up probe's pieces (runtime/probe.py: pinned copies, matmul throughput and
latency; storage/disk_store.py: O_DIRECT disk bandwidth) and adds what a placement needs beside them:
pageable copies, free memory per tier, free disk space and the compute device's memory
bandwidth. `hardware_from_probe` builds a Hardware from the cached probe instead (what
`--policy auto` uses when no hardware file is given).
"""
from __future__ import annotations

import platform
import shutil
import time
from pathlib import Path

import torch

from ..storage.disk_store import disk_bandwidth
from ..utils.host import available_memory_bytes, cpu_count
from .costs import dtype_name
from .hardware import Hardware
from .probe import _timed, disk_entry, measure_copy, measure_matmul, probe

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
QUICK = {"copy_bytes": 16 << 20, "disk_bytes": 32 << 20, "membw_bytes": 32 << 20}
FULL = {"copy_bytes": 256 << 20, "disk_bytes": 256 << 20, "membw_bytes": 256 << 20}


def free_memory(device: torch.device) -> tuple[float, float]:
    """(bytes usable on the compute device, bytes of host memory available now)."""
    host = float(available_memory_bytes())
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return float(free), host
    return host, host


def measure_pageable_copy(device: torch.device, nbytes: int) -> tuple[float, float]:
    """(host->device, device->host) bytes/s through ordinary (pageable) host memory."""
    host = torch.empty(nbytes, dtype=torch.uint8)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = _timed(lambda: dev.copy_(host), device)
    d2h = _timed(lambda: host.copy_(dev), device)
    return nbytes / h2d, nbytes / d2h


def measure_memory_bw(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a large copy on the device, counting the read and the write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return 2 * nbytes / _timed(lambda: dst.copy_(src), device)


def measure_disk(offload_dir: str | Path, nbytes: int) -> tuple[float, float, str]:
    """(read bytes/s, write bytes/s, mode) of a folder, page cache bypassed where the file
    system allows it (storage/disk.py)."""
    folder = Path(offload_dir).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    # out of inference mode: disk.py keeps a per-thread staging buffer (see runtime/probe.py)
    with torch.inference_mode(False):
        bw = disk_bandwidth(folder, nbytes=nbytes, direct=True, chunk_bytes=min(nbytes, 8 << 20))
    return bw["read_GBps"] * 1e9, bw["write_GBps"] * 1e9, bw["mode"]


def measure(device: torch.device, offload_dir: str | Path, quick: bool = False,
            say=lambda msg: None) -> Hardware:
    """Measure this machine: links (pinned and pageable, each way; CUDA only), disk read/write
    with the page cache bypassed, matmul FLOP/s per dtype on the compute device and the host,
    and free memory per tier. `quick` uses small transfers (a few seconds in all)."""
    sizes = QUICK if quick else FULL
    is_cuda = device.type == "cuda"
    notes = []
    h2d = d2h = h2d_pg = d2h_pg = 0.0
    if is_cuda:
        say("host <-> device copies (pinned, pageable)...")
        h2d, d2h = measure_copy(device, sizes["copy_bytes"])
        h2d_pg, d2h_pg = measure_pageable_copy(device, sizes["copy_bytes"])
    else:
        notes.append("compute is cpu: host<->device links are not applicable")
    say(f"disk read/write in {offload_dir}...")
    disk_r, disk_w, mode = measure_disk(offload_dir, sizes["disk_bytes"])
    if mode != "o_direct":
        notes.append(f"disk measured with page-cache mode {mode!r} (O_DIRECT unavailable here)")
    say("matmul throughput per dtype...")
    flops, latency = {}, {}
    for dt in DTYPES:
        flops[dtype_name(dt)], latency[dtype_name(dt)] = measure_matmul(device, dt)
    cpu_flops = dict(flops) if not is_cuda else {
        dtype_name(dt): measure_matmul(torch.device("cpu"), dt)[0] for dt in DTYPES}
    if not is_cuda:
        from .probe import say_weight_formats
        say_weight_formats(lambda msg: (say(msg), notes.append(msg)))
    say("device memory bandwidth...")
    mem_bw = measure_memory_bw(device, sizes["membw_bytes"])
    compute_mem, cpu_mem = free_memory(device)
    folder = Path(offload_dir).expanduser()
    host = platform.node() or "host"
    name = torch.cuda.get_device_name(device) if is_cuda else f"cpu-{cpu_count()}core"
    notes.append(f"{'quick ' if quick else ''}profile; free memory as seen at the time of the run; "
                 f"torch {torch.__version__}")
    return Hardware(
        name=name, compute="cuda" if is_cuda else "cpu", compute_memory=compute_mem, cpu_memory=cpu_mem,
        disk_free=float(shutil.disk_usage(folder).free), h2d_bw=h2d, d2h_bw=d2h, h2d_pageable_bw=h2d_pg,
        d2h_pageable_bw=d2h_pg, disk_read_bw=disk_r, disk_write_bw=disk_w, flops=flops, cpu_flops=cpu_flops,
        source=f"measured {time.strftime('%Y-%m-%d')} on {host}", notes="; ".join(notes),
        matmul_latency_s=latency, compute_memory_bw=mem_bw)


def hardware_from_probe(device: torch.device, dtype: torch.dtype, offload_dir: str | Path) -> Hardware:
    """A Hardware from the start-up probe (cached per machine) and the free memory now: no
    pageable copies (the pinned figure stands in) and one host matmul figure (float32)."""
    folder = Path(offload_dir).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    data = probe(device, [dtype], folder)
    disk = disk_entry(data, folder)
    is_cuda = device.type == "cuda"
    compute_mem, cpu_mem = free_memory(device)
    flops = dict(data["matmul_flops"])
    h2d, d2h = (data["h2d_Bps"], data["d2h_Bps"]) if is_cuda else (0.0, 0.0)
    return Hardware(
        name=data["device"], compute=device.type, compute_memory=compute_mem, cpu_memory=cpu_mem,
        disk_free=float(shutil.disk_usage(folder).free), h2d_bw=h2d, d2h_bw=d2h, h2d_pageable_bw=h2d,
        d2h_pageable_bw=d2h, disk_read_bw=disk["read_Bps"], disk_write_bw=disk["write_Bps"], flops=flops,
        cpu_flops=flops if not is_cuda else {"float32": measure_matmul(torch.device("cpu"), torch.float32)[0]},
        source=f"start-up probe of {data['hostname']}",
        matmul_latency_s=dict(data["matmul_latency_s"]))
