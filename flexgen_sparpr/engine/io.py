"""The I/O side of FlexGen's overlapped schedule: a thread pool that loads weights and KV blocks
and stores sealed blocks while the compute thread works, on (CUDA) the I/O stream, and the
hand-off of what it made to the compute stream (both kept by storage/streams.py).
`overlap=False` runs every task inline."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..storage.tiers import Devices


def one_thread() -> None:
    """An I/O thread's tensor ops (a gather's copies and casts) run on that thread alone: torch's
    intra-op threads are per calling thread, and a second team spinning beside the compute
    thread's would take the cores the compute needs (measured: a dense step with the KV on disk
    spent as long again in compute while its gathers ran)."""
    torch.set_num_threads(1)


class Done:
    """A task run inline: what a done Future answers, without one's lock and condition (a decode
    step makes one a cell for resident weights and caches)."""

    __slots__ = ("value",)

    def __init__(self, value=None):
        self.value = value

    def result(self, timeout=None):
        return self.value

    def done(self) -> bool:
        return True


class IOPool:
    def __init__(self, devices: Devices, threads: int, overlap: bool):
        self.devices, self.overlap = devices, overlap
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="flexgen-io", initializer=one_thread)
        # the I/O stream and every hand-off across it are the streams' (storage/streams.py)
        self.streams = devices.streams

    def submit(self, fn, *args) -> Future | Done:
        """Run fn(*args) on the pool (inline when not overlapping)."""
        if self.overlap:
            return self._pool.submit(self._task, fn, *args)
        return Done(fn(*args))

    def _task(self, fn, *args):
        """Runs on a pool thread. Inference mode is per thread, so it is entered here too."""
        with torch.inference_mode():
            return self.streams.io_task(fn, *args)

    def adopt(self, obj):
        """What an I/O task made, taken by the compute thread: recorded on the compute stream
        (storage/streams.py, rule 3). obj: tensors in dicts, sequences or dataclasses (a
        prefetch's Fetched), or anything else (returned as is)."""
        return self.streams.hand_off(obj) if self.overlap else obj

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def to_compute(devices: Devices, x: torch.Tensor | None) -> torch.Tensor | None:
    """A hidden state parked on the CPU tier, on the compute device (counted on its link)."""
    if x is not None and x.device != devices.compute:
        devices.counters.add("cpu", "compute", x.nbytes)
        return x.to(devices.compute, non_blocking=True)
    return x
