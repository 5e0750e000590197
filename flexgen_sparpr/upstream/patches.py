"""Runtime patches that let upstream FlexGen (PyPI `flexgen==0.1.8`) run with its GPU tier on a CPU.

Upstream assumes a CUDA device: it makes CUDA streams, synchronises, pins host memory, calls
`.cuda()` and gives its disk copy threads a CUDA device. Each patch below removes one of those
assumptions at runtime and says why in one line; `apply_cpu_patches()` applies them all, once.

Scope. The CUDA guards only reach upstream's own code: its modules get a `torch` whose `cuda`
namespace is a CPU stand-in, and `Tensor.cuda` / `Tensor.pin_memory` are redirected only when
called from a `flexgen.*` module. Upstream's "GPU" tier stays a CUDA-typed device (so every
upstream code path that picks by device type runs unchanged) whose tensors live in host memory.
"""
from __future__ import annotations

import contextlib
import importlib
import sys
import types

import torch

UPSTREAM_VERSION = "0.1.8"
UPSTREAM_MODULES = ("flexgen.utils", "flexgen.pytorch_backend", "flexgen.compression", "flexgen.flex_opt")
COMPUTE = torch.device("cpu")  # where upstream's GPU tier lives once patched

_applied: list[str] = []
_real_tensor_cuda = torch.Tensor.cuda
_real_pin_memory = torch.Tensor.pin_memory
_real_half = torch.Tensor.half
_float32 = {"on": False}


def upstream_available() -> bool:
    """True when upstream FlexGen is importable (installed by `make setup`)."""
    try:
        importlib.import_module("flexgen.flex_opt")
    except ImportError:
        return False
    return True


def _from_upstream(depth: int = 2) -> bool:
    """True when the caller `depth` frames up is upstream FlexGen code (module `flexgen.*`)."""
    return sys._getframe(depth).f_globals.get("__name__", "").startswith("flexgen.")


class _NoStream:
    """A CUDA stream stand-in: usable wherever upstream passes a stream, orders nothing."""

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass


class _CudaShim(types.SimpleNamespace):
    """What upstream's modules see as `torch.cuda`: patched names here, the rest from torch.cuda."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _TorchShim(types.ModuleType):
    """What upstream's modules see as `torch`: `cuda` and `empty` patched, the rest is torch."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CudaShim()

    def __getattr__(self, name):
        return getattr(torch, name)


_SHIM = _TorchShim()


# --- the patches: one assumption each ---

def patch_torch_namespace() -> None:
    """Upstream's modules read `torch.cuda.*` through their module global: give them the shim."""
    for name in UPSTREAM_MODULES:
        importlib.import_module(name).torch = _SHIM


def patch_streams() -> None:
    """No CUDA runtime: CPU copies are synchronous, so a stream has nothing to order."""
    _SHIM.cuda.Stream = lambda *args, **kwargs: _NoStream()
    _SHIM.cuda.stream = lambda stream=None: contextlib.nullcontext()
    _SHIM.cuda.current_stream = lambda *args, **kwargs: _NoStream()


def patch_synchronize() -> None:
    """`torch.cuda.synchronize()` raises without CUDA; on the CPU every op has finished already."""
    _SHIM.cuda.synchronize = lambda *args, **kwargs: None


def patch_memory_stats() -> None:
    """Upstream reads its GPU tier's memory from the CUDA allocator; there is none, so it is 0."""
    _SHIM.cuda.memory_allocated = lambda *args, **kwargs: 0
    _SHIM.cuda.max_memory_allocated = lambda *args, **kwargs: 0
    _SHIM.cuda.empty_cache = lambda: None


def patch_pinned_memory() -> None:
    """Pinning needs a CUDA driver; the compute tier is host memory, so pinning buys nothing."""
    def empty(*args, pin_memory=False, **kwargs):
        return torch.empty(*args, **kwargs)

    def pin_memory(self, *args, **kwargs):
        return self if _from_upstream() else _real_pin_memory(self, *args, **kwargs)

    _SHIM.empty = empty
    torch.Tensor.pin_memory = pin_memory


def patch_cuda_calls() -> None:
    """Upstream's `.cuda()` hops (CPU attention back to the GPU tier) land on the compute device."""
    def cuda(self, *args, **kwargs):
        return self.to(COMPUTE) if _from_upstream() else _real_tensor_cuda(self, *args, **kwargs)

    torch.Tensor.cuda = cuda


def patch_gpu_tier() -> None:
    """`TorchDevice("cuda:0")` keeps its CUDA device type (upstream's code paths) but lives on the CPU."""
    backend = importlib.import_module("flexgen.pytorch_backend")
    init = backend.TorchDevice.__init__

    def __init__(self, name, *args, **kwargs):
        init(self, name, *args, **kwargs)
        if self.dev.type == "cuda":
            self.dev = COMPUTE  # device_type stays DeviceType.CUDA

    backend.TorchDevice.__init__ = __init__


def patch_disk_copy_threads() -> None:
    """Upstream's disk copy threads call `torch.cuda.set_device` first; there is no device to set."""
    _SHIM.cuda.set_device = lambda *args, **kwargs: None


PATCHES = (patch_torch_namespace, patch_streams, patch_synchronize, patch_memory_stats,
           patch_pinned_memory, patch_cuda_calls, patch_gpu_tier, patch_disk_copy_threads)


def use_float32_compute(on: bool = True) -> None:
    """Opt-in, not a CPU guard: upstream computes in float16, which CPUs run 3-7x slower than
    float32; with this on, upstream's `.half()` hops keep float32 (give its OptConfig
    dtype=np.float32 too). Its KV cache is still stored in float16, as upstream allocates it."""
    def half(self, *args, **kwargs):
        if _float32["on"] and _from_upstream():
            return self
        return _real_half(self, *args, **kwargs)

    _float32["on"] = on
    torch.Tensor.half = half


def apply_cpu_patches() -> list[str]:
    """Patch upstream FlexGen in this process so it runs on the CPU. Idempotent: a second call
    changes nothing. Returns the names of the patches in force. Raises ImportError when upstream
    FlexGen is not installed, RuntimeError when its version is not the pinned one."""
    if _applied:
        return list(_applied)
    from importlib.metadata import version
    found = version("flexgen")
    if found != UPSTREAM_VERSION:
        raise RuntimeError(f"these patches are for flexgen=={UPSTREAM_VERSION}, found {found}")
    for patch in PATCHES:
        patch()
        _applied.append(patch.__name__)
    return list(_applied)


def applied() -> list[str]:
    """Names of the patches in force in this process (empty before apply_cpu_patches)."""
    return list(_applied)


# --- opt-in: upstream's disk reads meet the disk ---

class _Rendezvous:
    """A copy item every disk copy thread takes exactly one of: its `copy_` waits for all of
    them, so each thread has dropped the memory map of its previous item (a mapped page stays
    cached whatever fadvise says)."""

    def __init__(self, barrier):
        self.device, self.data, self.barrier = types.SimpleNamespace(device_type=None), self, barrier

    def copy_(self, other):
        self.barrier.wait()


def _advise_rows(arr, indices) -> None:
    """No read-around on this memory map of a disk tensor [S, ...]; its rows `indices[0]` are read
    ahead at once (a fault would otherwise read the disk's whole read-ahead window around it)."""
    import mmap
    mm, step = arr._mmap, mmap.PAGESIZE
    mm.madvise(mmap.MADV_RANDOM)
    rows = indices[0] if indices and isinstance(indices[0], slice) else slice(0, arr.shape[0])
    r0, r1, _ = rows.indices(arr.shape[0])
    if r1 > r0:
        base, row = arr.offset % mmap.ALLOCATIONGRANULARITY, arr.strides[0]
        a, b = base + r0 * row, base + r1 * row
        a -= a % step
        mm.madvise(mmap.MADV_WILLNEED, a, min(len(mm), -(-b // step) * step) - a)


def uncached_disk_tier(on: bool = True) -> None:
    """Opt-in, not a CPU guard: upstream's disk tier reads and writes through numpy memory maps,
    so what it wrote is read back from the page cache, never from the disk (this engine's disk
    tier uses O_DIRECT), and a page fault reads the disk's whole read-ahead window around it (8
    MiB on this project's VM), whatever rows were asked for. With this on, a disk copy reads the
    rows it asks for, read ahead at once (madvise RANDOM + WILLNEED on its map); and after each of
    upstream's disk synchronisations the files its copies touched are flushed (fdatasync) and
    dropped from the page cache (POSIX_FADV_DONTNEED), once every copy thread has let go of its
    map. So each read of a block comes from the disk, as under a throttled disk it must."""
    import os
    import threading
    backend = importlib.import_module("flexgen.pytorch_backend")
    disk_cls = backend.TorchDisk
    if not hasattr(disk_cls, "_fgsp_submit"):
        disk_cls._fgsp_submit, disk_cls._fgsp_sync = disk_cls.submit_copy, disk_cls.synchronize
        backend._fgsp_map = backend.map_to_torch_tensor
    if not on:
        disk_cls.submit_copy, disk_cls.synchronize = disk_cls._fgsp_submit, disk_cls._fgsp_sync
        backend.map_to_torch_tensor = backend._fgsp_map
        return
    DISK = backend.DeviceType.DISK
    np = importlib.import_module("numpy")

    def map_to_torch_tensor(tensor, indices):
        if tensor.device.device_type != DISK or torch.is_tensor(indices):
            return backend._fgsp_map(tensor, indices)
        arr = np.lib.format.open_memmap(tensor.data)
        _advise_rows(arr, indices)
        data = torch.from_numpy(arr)
        return data[indices] if indices else data

    def submit_copy(self, *args):
        touched = self.__dict__.setdefault("_fgsp_touched", {})
        dst, _, src, _ = args
        for t, written in ((dst, True), (src, False)):
            if getattr(t.device, "device_type", None) == DISK:
                touched[t.data] = touched.get(t.data, False) or written
        return disk_cls._fgsp_submit(self, *args)

    def synchronize(self):
        disk_cls._fgsp_sync(self)
        touched = self.__dict__.pop("_fgsp_touched", {})
        if not touched:
            return
        n = len(self.copy_threads)
        barrier = threading.Barrier(n)
        for _ in range(n):
            item = _Rendezvous(barrier)
            self.copy_queue.put_nowait((item, None, item, None))
        disk_cls._fgsp_sync(self)
        for path, written in touched.items():
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:  # deleted meanwhile
                continue
            try:
                if written:
                    os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    disk_cls.submit_copy, disk_cls.synchronize = submit_copy, synchronize
    backend.map_to_torch_tensor = map_to_torch_tensor
