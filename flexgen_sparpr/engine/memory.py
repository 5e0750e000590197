"""Real peak memory per tier: host RSS, from the kernel's own high-water mark where Linux keeps
one (no thread: a sampler waking every 10 ms took a core and the GIL from the step's matmuls, ~7 %
of a batch-1 decode step on two cores), else sampled by a thread; and on CUDA the device memory
as a card would see it (torch's reserved bytes + this process's context) with NVML's sampled peak."""
from __future__ import annotations

import gc
import threading

import torch

from ..storage.device_memory import NvmlReader, context_bytes
from ..utils.host import lifetime_peak_rss_bytes, reset_rss_high_water, rss_bytes, rss_high_water_bytes

_open: list["PeakMemory"] = []  # windows reading the high-water mark now: a reset folds it into each
_lock = threading.Lock()


class PeakMemory:
    """Context manager measuring this process's peak RSS inside it (the kernel's high-water mark,
    reset on entry; or sampled every `interval` seconds where it cannot be reset), and NVML's
    reading on CUDA (sampled)."""

    def __init__(self, device: torch.device, interval: float = 0.01):
        self.device, self.interval = torch.device(device), interval
        self.peak_rss = 0
        self.peak_nvml: int | None = None
        self._nvml: NvmlReader | None = None
        self._context = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.high_water = False  # whether the kernel's high-water mark measures this window

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def __enter__(self):
        if self.is_cuda:
            # blocks an earlier run left cached would count as this one's reserved memory
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self._nvml = NvmlReader(self.device)
        with _lock:
            _fold(_open)  # an enclosing window keeps the peak it saw before this reset
            self.high_water = reset_rss_high_water()
            if self.high_water:
                _open.append(self)
        self._sample()
        if not self.high_water or self._nvml is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        if not self.high_water:
            self.peak_rss = max(self.peak_rss, rss_bytes())
        used = self._nvml.used() if self._nvml is not None else None
        if used is not None:
            self.peak_nvml = max(self.peak_nvml or 0, used)

    def _run(self):
        while not self._stop.wait(self.interval):
            self._sample()

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with _lock:
            if self.high_water:
                _fold([self])
                _open.remove(self)
        self._sample()
        if self.is_cuda:  # measured at the end: lazily loaded kernels have joined the context by then
            self._context = context_bytes(self.device, self._nvml)

    def report(self) -> dict:
        out = {
            "host_rss_peak_bytes": self.peak_rss,
            # ru_maxrss is the whole process lifetime's peak, incl. model loading
            "host_rss_lifetime_peak_bytes": lifetime_peak_rss_bytes(),
            "gpu_peak_bytes": 0,  # what a card must hold: torch's peak reserved + the context
            "gpu_peak_reserved_bytes": 0,
            "gpu_peak_allocated_bytes": 0,
            "gpu_context_bytes": 0,
            "gpu_peak_nvml_bytes": None,  # NVML's sampled peak (None without NVML)
            "gpu_nvml_scope": None,  # "process", or "device" when NVML cannot see this process
        }
        if self.is_cuda:
            reserved = torch.cuda.max_memory_reserved(self.device)
            out.update(gpu_peak_bytes=reserved + self._context, gpu_peak_reserved_bytes=reserved,
                       gpu_peak_allocated_bytes=torch.cuda.max_memory_allocated(self.device),
                       gpu_context_bytes=self._context, gpu_peak_nvml_bytes=self.peak_nvml,
                       gpu_nvml_scope=self._nvml.scope if self._nvml else None)
        return out


def _fold(windows: list[PeakMemory]) -> None:
    """The high-water mark since the last reset, into each window's peak (under _lock)."""
    mark = rss_high_water_bytes() if windows else None
    for w in windows:
        w.peak_rss = max(w.peak_rss, mark or 0)
