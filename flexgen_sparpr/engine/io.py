"""The I/O side of FlexGen's overlapped schedule: a thread pool that loads weights and KV blocks
and stores sealed blocks while the compute thread works, with (on CUDA) a stream of its own, and
the hand-off of what it made to the compute stream. `overlap=False` runs every task inline."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..storage.tiers import Devices


class Done(Future):
    """A future that is already done (a task run inline)."""

    def __init__(self, value=None):
        super().__init__()
        self.set_result(value)


class IOPool:
    def __init__(self, devices: Devices, threads: int, overlap: bool):
        self.devices, self.overlap = devices, overlap
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="flexgen-io")
        # on CUDA the I/O tasks copy on their own stream so they overlap the compute stream
        self._stream = torch.cuda.Stream(devices.compute) if devices.is_cuda else None

    def submit(self, fn, *args) -> Future:
        """Run fn(*args) on the pool (inline when not overlapping)."""
        if self.overlap:
            return self._pool.submit(self._task, fn, *args)
        return Done(fn(*args))

    def _task(self, fn, *args):
        """Runs on a pool thread. Inference mode is per thread, so it is entered here too."""
        with torch.inference_mode():
            if self._stream is None:
                return fn(*args)
            # wait for what the compute stream produced (sealed blocks), copy, then finish
            # before handing back, so the compute stream never reads a half-done copy
            self._stream.wait_stream(torch.cuda.current_stream(self.devices.compute))
            with torch.cuda.stream(self._stream):
                out = fn(*args)
            self._stream.synchronize()
            return out

    def adopt(self, obj):
        """Tensors made on the I/O stream are used on the compute stream: tell the caching
        allocator, so their memory is not reused while the compute stream still reads it.
        obj: a tensor dict, tuple, or anything else (returned as is)."""
        if self._stream is not None and self.overlap:
            stream = torch.cuda.current_stream(self.devices.compute)
            items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, tuple) else ()
            for t in items:
                if torch.is_tensor(t) and t.is_cuda:
                    t.record_stream(stream)
        return obj

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def to_compute(devices: Devices, x: torch.Tensor | None) -> torch.Tensor | None:
    """A hidden state parked on the CPU tier, on the compute device (counted on its link)."""
    if x is not None and x.device != devices.compute:
        devices.counters.add("cpu", "compute", x.nbytes)
        return x.to(devices.compute, non_blocking=True)
    return x
