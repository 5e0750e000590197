"""The compute tier's memory on CUDA: this process's CUDA context, the `--gpu-mem` cap, and
NVML's reading of what the process holds. nvidia-ml-py is optional (reporting only): without
it, torch's own figures stand alone.

A cap of G GiB emulates a card of G GiB: the card's memory also holds the process's CUDA
context (and, on a laptop, the display), which torch's allocator never sees, so the allocator
is allowed G GiB minus the context measured here.
"""
from __future__ import annotations

import os

import torch

from ..errors import ConfigError

GiB = 1 << 30


class NvmlReader:
    """What NVML says this process holds on one device, read on each call (PeakMemory samples
    it). `scope` is "process" when NVML lists this process, "device" when it cannot see it (a
    container's PID namespace: then the whole device's used memory is the reading) and None
    without NVML."""

    def __init__(self, device: torch.device):
        self.scope, self._nv, self._h = None, None, None
        try:
            import pynvml
            pynvml.nvmlInit()
            self._nv, self._h = pynvml, _handle(pynvml, device)
        except Exception:  # no nvidia-ml-py, no driver library (e.g. WSL without NVML)
            return
        self.scope = "process" if self._process_used() is not None else "device"

    def _process_used(self) -> int | None:
        try:
            procs = self._nv.nvmlDeviceGetComputeRunningProcesses(self._h)
        except Exception:
            return None
        mine = [p.usedGpuMemory for p in procs if p.pid == os.getpid() and p.usedGpuMemory is not None]
        return sum(mine) if mine else None

    def used(self) -> int | None:
        """Bytes: this process's (scope "process"), the device's (scope "device"), or None."""
        if self.scope == "process":
            return self._process_used()
        if self.scope == "device":
            try:
                return int(self._nv.nvmlDeviceGetMemoryInfo(self._h).used)
            except Exception:
                return None
        return None


def _handle(nv, device: torch.device):
    """NVML's handle of a torch device: by UUID (NVML numbers every GPU, torch only the visible
    ones), else by index."""
    try:
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        return nv.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except Exception:
        return nv.nvmlDeviceGetHandleByIndex(device.index or 0)


def context_bytes(device: torch.device, nvml: NvmlReader | None = None) -> int:
    """What this process holds on `device` outside torch's caching allocator (the CUDA context,
    loaded kernels): NVML's per-process figure minus torch's reserved bytes, else the device's
    used memory minus reserved (which then also counts other processes on the device)."""
    torch.cuda.synchronize(device)  # creates the context if nothing has yet
    reserved = torch.cuda.memory_reserved(device)
    nvml = nvml or NvmlReader(device)
    used = nvml.used() if nvml.scope == "process" else None
    if used is None:
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
    return max(0, int(used) - reserved)


def cap_bytes(device: torch.device, gpu_mem_gib: float) -> int:
    """Bytes torch's allocator may reserve on `device` so that the process fits a card of
    `gpu_mem_gib` GiB (the context counted in). ValueError when no such cap can hold."""
    total = torch.cuda.get_device_properties(device).total_memory
    cap = int(gpu_mem_gib * GiB)
    if cap > total:
        raise ValueError(f"--gpu-mem {gpu_mem_gib:g} GiB is more than {device}'s {total / GiB:.1f} GiB")
    limit = cap - context_bytes(device)
    if limit <= 0:
        raise ValueError(f"--gpu-mem {gpu_mem_gib:g} GiB leaves nothing beside this process's CUDA context")
    return limit


def apply_cap(device: torch.device, gpu_mem_gib: float) -> int:
    """Enforce the cap (torch.cuda.set_per_process_memory_fraction); returns the allocator's limit
    in bytes. An allocation past it raises torch's OutOfMemoryError, as on a card that small."""
    limit = cap_bytes(device, gpu_mem_gib)
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(limit / total, device)
    return limit


def cap_device(devices, gpu_mem: float | None) -> int | None:
    """--gpu-mem: the bytes torch's allocator may reserve (the card's size less this process's
    context), enforced before anything is allocated; None without a cap."""
    if gpu_mem is None:
        return None
    if not devices.is_cuda:
        raise ConfigError("--gpu-mem caps a CUDA device; the compute device here is the CPU")
    try:
        return apply_cap(devices.compute, gpu_mem)
    except ValueError as e:
        raise ConfigError(str(e)) from None

