"""The compute device's streams and every hand-off between them: the one place that knows them.

On CUDA the engine computes on the device's default stream and moves bytes on one I/O stream of
its own, so copies overlap compute. The rules, all kept here:

1. An I/O task waits for the compute stream's work before it starts (a store job reads what
   compute wrote; a gather refills a buffer compute read two cells ago) — `io_task`.
2. An I/O task's work is complete before its result is handed over: the task synchronizes the
   I/O stream before it returns (its Future is the hand-off).
3. Memory made on one stream and used on another is recorded on the stream that uses it
   (`hand_off`: every tensor of the payload, in dicts, sequences and dataclasses alike — a
   prefetch's `Fetched`, a store job's exact rows), so the caching allocator does not give it
   out again while that stream may still read it.
4. A thread that copies on an I/O task's behalf (the disk readers) runs on that task's stream
   (`carry`): its copies are ordered after the task's other writes to the same buffer (a gather
   buffer's fill) and covered by the task's synchronize.

On the CPU there are no streams: `api` is None and everything here is inert, except that a
helper thread takes its caller's inference mode. `api` is `CudaAPI` on CUDA, or a stand-in with
the same calls (tests/stream_double.py runs these paths on the CPU and checks rules 1-4).
"""
from __future__ import annotations

import dataclasses
import threading
from contextlib import nullcontext

import torch


class CudaAPI:
    """torch.cuda's stream, event and host-memory calls, as Streams and HostMemory use them."""

    Stream = staticmethod(lambda device: torch.cuda.Stream(device))
    Event = staticmethod(lambda: torch.cuda.Event())
    current_stream = staticmethod(lambda device: torch.cuda.current_stream(device))
    default_stream = staticmethod(lambda device: torch.cuda.default_stream(device))
    stream = staticmethod(lambda s: torch.cuda.stream(s))
    record_stream = staticmethod(lambda t, s: t.record_stream(s))
    is_pinned = staticmethod(lambda t: t.is_pinned())

    @staticmethod
    def pin(t: torch.Tensor) -> bool:
        """Page-lock t's bytes where they are, at their exact size (the pinned caching allocator
        would round to a power of two and keep freed blocks); False when refused (WSL2 caps it)."""
        return int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.nbytes, 0)) == 0

    @staticmethod
    def unpin(t: torch.Tensor) -> None:
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())

    @staticmethod
    def note_host(t: torch.Tensor) -> None:
        """A host buffer (CUDA knows it from the pointer; a stand-in is told)."""


class Streams:
    def __init__(self, device: torch.device, api=None):
        self.device, self.api = device, api
        self._io = None
        self._lock = threading.Lock()

    @property
    def compute(self):
        """The stream the engine computes on: the device's default stream."""
        return self.api.default_stream(self.device)

    @property
    def io(self):
        """The stream the I/O tasks copy on (made at first use: nothing touches the device before)."""
        with self._lock:
            if self._io is None:
                self._io = self.api.Stream(self.device)
            return self._io

    @property
    def active(self) -> bool:
        """Whether there are streams to order (CUDA, or a stand-in)."""
        return self.api is not None

    def io_task(self, fn, *args):
        """Run fn(*args) on the I/O stream, on an I/O thread (rules 1 and 2)."""
        if self.api is None:
            return fn(*args)
        self.io.wait_stream(self.compute)
        with self.api.stream(self.io):
            out = fn(*args)
        self.io.synchronize()
        return out

    def hand_off(self, obj):
        """Record every compute-device tensor in obj on the compute stream (rule 3); returns obj.
        obj: a tensor, or dicts, lists, tuples and dataclasses of them, nested."""
        if self.api is not None:
            for t in _tensors(obj):
                if t.device == self.device:
                    self.api.record_stream(t, self.compute)
        return obj

    def carry(self, fn):
        """fn, to be run on another thread as if on this one: with this thread's inference mode
        and current stream (rule 4)."""
        mode = torch.is_inference_mode_enabled()  # per thread: the helper takes the caller's
        stream = self.api.current_stream(self.device) if self.api is not None else None

        def run(*args):
            with torch.inference_mode(mode), (self.api.stream(stream) if stream is not None else nullcontext()):
                return fn(*args)
        return run

    def on_host(self, t: torch.Tensor) -> torch.Tensor:
        """t, a CPU tensor the engine keeps on the host because the host branches on it (a
        selection's readers): reading it needs no sync. Said so to a stand-in; returns t."""
        if self.api is not None:
            self.api.note_host(t)
        return t

    def record(self):
        """An event recorded on the current stream (None without streams): what was launched so far."""
        if self.api is None:
            return None
        ev = self.api.Event()
        ev.record(self.api.current_stream(self.device))
        return ev


def _tensors(obj):
    """The tensors in obj: a tensor, or dicts, lists, tuples and dataclasses of them, nested."""
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name))
