"""Real peak memory per tier, sampled by a thread: host RSS, and on CUDA the device memory as a
card would see it (torch's reserved bytes + this process's context) with NVML's sampled peak."""
from __future__ import annotations

import gc
import threading

import torch

from ..storage.device_memory import NvmlReader, context_bytes
from ..utils.host import lifetime_peak_rss_bytes, rss_bytes


class PeakMemory:
    """Context manager sampling this process's RSS (and NVML's reading on CUDA) every
    `interval` seconds."""

    def __init__(self, device: torch.device, interval: float = 0.01):
        self.device, self.interval = torch.device(device), interval
        self.peak_rss = 0
        self.peak_nvml: int | None = None
        self._nvml: NvmlReader | None = None
        self._context = 0
        self._stop = threading.Event()

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
        self._sample()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        self.peak_rss = max(self.peak_rss, rss_bytes())
        used = self._nvml.used() if self._nvml is not None else None
        if used is not None:
            self.peak_nvml = max(self.peak_nvml or 0, used)

    def _run(self):
        while not self._stop.wait(self.interval):
            self._sample()

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
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
