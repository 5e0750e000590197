"""Real peak memory per tier: host RSS sampled by a thread (psutil), GPU from torch and NVML."""
from __future__ import annotations

import resource
import threading

import psutil
import torch


class PeakMemory:
    """Context manager sampling this process's RSS every `interval` seconds."""

    def __init__(self, device: torch.device, interval: float = 0.01):
        self.device, self.interval = device, interval
        self.peak_rss = 0
        self._stop = threading.Event()
        self._proc = psutil.Process()

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.peak_rss = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(self.interval):
            self.peak_rss = max(self.peak_rss, self._proc.memory_info().rss)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak_rss = max(self.peak_rss, self._proc.memory_info().rss)

    def report(self) -> dict:
        out = {
            "host_rss_peak_bytes": self.peak_rss,
            # ru_maxrss is the whole process lifetime's peak (KiB on Linux), incl. model loading
            "host_rss_lifetime_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "gpu_peak_allocated_bytes": 0,
            "gpu_used_bytes_nvml": None,
        }
        if self.device.type == "cuda":
            out["gpu_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
            try:
                import pynvml
                pynvml.nvmlInit()
                h = pynvml.nvmlDeviceGetHandleByIndex(self.device.index or 0)
                out["gpu_used_bytes_nvml"] = pynvml.nvmlDeviceGetMemoryInfo(h).used
            except Exception:  # NVML missing (e.g. WSL without it): torch's figure still stands
                pass
        return out
