"""Does a placement fit this machine? Checked before any weight loads, with the same per-tier
arithmetic and the same test `--policy auto` plans with (runtime/placement.py `tier_use`,
`within`), against what is free now: the compute device's memory, host memory (psutil, capped by
a cgroup limit) and the offload disk, each host-wide pool shared out among the processes torchrun
starts on this host (LOCAL_WORLD_SIZE). A placement over a tier's usable capacity is refused with
the numbers and a placement that fits (the most bytes on the compute tier, then on the CPU).
"""
from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import CapacityError
from .hardware import GiB, Hardware
from .placement import Workload, _pairs, fits, tier_capacity, tier_use, total_bytes, within

SKIP_ENV = "FLEXGEN_SPARPR_NO_MEMORY_CHECK"
TIERS = ("compute", "cpu", "disk")


@dataclass(frozen=True)
class Capacity:
    """What is free now, in bytes (the attributes placement.tier_capacity reads)."""

    is_cuda: bool
    compute_memory: float
    cpu_memory: float
    disk_free: float
    disk_dir: str
    ranks: int = 1  # processes of this run sharing this host's memory and disk (LOCAL_WORLD_SIZE)


def host_available() -> float:
    """Bytes of host memory a new allocation can get: psutil's `available`, else /proc/meminfo,
    lowered to what a cgroup (v2) memory limit leaves."""
    avail = None
    try:
        import psutil
        avail = float(psutil.virtual_memory().available)
    except ImportError:  # psutil is optional: Linux says the same in /proc/meminfo
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    avail = float(line.split()[1]) * 1024
        except OSError:
            pass
    if avail is None:
        avail = float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = float(Path("/sys/fs/cgroup/memory.current").read_text())
            avail = min(avail, float(limit) - used)
    except (OSError, ValueError):
        pass
    return avail


def existing_ancestor(path: Path) -> Path:
    p = Path(path).expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def local_ranks(env=os.environ) -> int:
    """How many processes of this run share this host: torchrun's LOCAL_WORLD_SIZE (1 when
    unset or not a positive integer: a lone process)."""
    try:
        return max(1, int(env.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def live_capacity(device, offload_dir, env=os.environ) -> Capacity:
    """This process's share of this machine's free memory per tier and of the offload dir's free
    disk, measured now: host memory and disk are shared evenly by the local_ranks() processes on
    this host (each starts with the same free memory in view, and all of them will fill it); a
    CUDA device is its own rank's (torchrun gives each local rank its own)."""
    n = local_ranks(env)
    host = host_available() / n
    compute = host
    if device.type == "cuda":
        import torch
        compute = float(torch.cuda.mem_get_info(device)[0])
    disk_dir = existing_ancestor(Path(offload_dir))
    return Capacity(device.type == "cuda", compute, host, float(shutil.disk_usage(disk_dir).free) / n,
                    str(disk_dir), n)


def planning_hardware(hw: Hardware, cap: Capacity) -> Hardware:
    """hw with its memory and disk no larger than `cap` (what the check will allow), when hw
    describes this kind of machine (a CUDA file on a CUDA device, a CPU-only one on the CPU): the
    plan `--policy auto` makes then passes the check. A file for another kind of machine plans for
    that machine; the check still measures this one."""
    if hw.is_cuda != cap.is_cuda:
        return hw
    return dataclasses.replace(hw, compute_memory=min(hw.compute_memory, cap.compute_memory),
                               cpu_memory=min(hw.cpu_memory, cap.cpu_memory), disk_free=min(hw.disk_free, cap.disk_free))


def _gib(x: float) -> str:
    return f"{x / GiB:.1f}"


def _tier_name(tier: str, cap: Capacity) -> str:
    shared = f" (this process's 1/{cap.ranks} share: {cap.ranks} processes on this host)" if cap.ranks > 1 else ""
    if tier == "compute":
        return "GPU memory" if cap.is_cuda else f"host memory (the compute tier){shared}"
    return {"cpu": f"host memory{shared}", "disk": f"disk in {cap.disk_dir}{shared}"}[tier]


def _have(tier: str, cap: Capacity) -> float:
    return {"compute": cap.compute_memory if cap.is_cuda else min(cap.compute_memory, cap.cpu_memory),
            "cpu": cap.cpu_memory, "disk": cap.disk_free}[tier]


def predicted_use(wl: Workload, percent, gpu_batch_size: int, cap: Capacity) -> dict[str, dict]:
    """tier -> {"weights", "kv", "working"} bytes of this placement (placement.tier_use)."""
    wg, wc, cg, cc = (float(p) / 100 for p in percent[:4])
    use = tier_use(wl, cap.is_cuda, wg, wc, cg, cc, gpu_batch_size, act_on_cpu=percent[5] == 100)
    return {t: {k: float(v) for k, v in parts.items()} for t, parts in use.items()}


def suggest(wl: Workload, gpu_batch_size: int, act_on_cpu: bool, cap: Capacity, step: int = 5):
    """(percent, use) of the grid placement that fits and keeps the most bytes on the compute
    tier, then on the CPU; None when nothing on the grid fits."""
    w = _pairs(step, cap.is_cuda)[:, None, :] / 100  # [Nw, 1, 2]
    c = _pairs(step, cap.is_cuda)[None, :, :] / 100  # [1, Nc, 2]
    use = tier_use(wl, cap.is_cuda, w[..., 0], w[..., 1], c[..., 0], c[..., 1], gpu_batch_size, act_on_cpu)
    shape = np.broadcast_shapes(w.shape[:2], c.shape[:2])
    ok = np.broadcast_to(fits(use, cap), shape)
    if not ok.any():
        return None
    on = lambda t: np.broadcast_to(use[t]["weights"] + use[t]["kv"], shape)  # noqa: E731
    order = np.lexsort((-on("cpu").ravel(), -on("compute").ravel(), ~ok.ravel()))
    i, j = np.unravel_index(order[0], shape)
    pct = (round(100 * w[i, 0, 0]), round(100 * w[i, 0, 1]), round(100 * c[0, j, 0]), round(100 * c[0, j, 1]),
           0 if act_on_cpu else 100, 100 if act_on_cpu else 0)
    return pct, predicted_use(wl, pct, gpu_batch_size, cap)


def check_placement(wl: Workload, percent, gpu_batch_size: int, cap: Capacity) -> dict[str, float]:
    """The predicted bytes per tier of an explicit placement, or CapacityError (one line: the
    tier, its need and what is free, and a --percent that fits) when one exceeds its usable
    capacity (what is free less placement.py's margin)."""
    use = predicted_use(wl, percent, gpu_batch_size, cap)
    limit = tier_capacity(cap)
    need = {t: total_bytes(use[t]) for t in TIERS}
    ok = within(use, cap)
    over = [t for t in TIERS if not ok[t]]
    if not over:
        return need
    t = over[0]
    parts = use[t]
    msg = (f"--percent {' '.join(map(str, percent))} does not fit: {_tier_name(t, cap)} would need "
           f"{_gib(need[t])} GiB (weights {_gib(parts['weights'])}, KV cache {_gib(parts['kv'])}, buffers and "
           f"activations {_gib(parts['working'])}) but {_gib(_have(t, cap))} GiB is free "
           f"({_gib(limit[t])} usable)")
    better = suggest(wl, gpu_batch_size, percent[5] == 100, cap)
    if better is None:
        msg += ("; no placement fits this machine: lower the batch or the lengths, try --compress-weight, "
                "or free disk space")
    else:
        pct, u = better
        label = {"compute": "GPU" if cap.is_cuda else "host", "cpu": "CPU", "disk": "disk"}
        shown = [f"{_gib(total_bytes(u[x]))} GiB {label[x]}" for x in TIERS if total_bytes(u[x]) > 0]
        msg += f"; try --percent {' '.join(map(str, pct))} ({', '.join(shown)}) or --policy auto"
    raise CapacityError(msg + f" ({SKIP_ENV}=1 runs it anyway)")
