"""Host memory behind the CPU tier, and its copies to and from the compute device.

A copy between host and device memory is asynchronous only from page-locked (pinned) memory, and
only when the host side is contiguous: from a strided view torch first gathers the bytes into a
pageable temporary, and the driver then stages that through its own buffer, synchronously. And
pinned memory is scarce (WSL2 and Windows cap it near half the RAM; FlexGen #44), while torch's
pinned allocator rounds every block up to a power of two and keeps freed blocks for reuse, so
buffers of new sizes pile up. So here:

- CPU-homed weights are page-locked once, where they lie, at their exact size (`pin`, released
  on `close`); a refusal leaves them pageable and their copies go through the staging ring.
- The CPU tier's KV arenas are plain pageable memory (`arena`): made per generation, never pinned.
- Every other copy between host and compute memory goes through a small ring of pinned staging
  buffers (`to_compute`, `to_host`): the host gathers the (strided) source into a buffer, the
  copy to the device runs asynchronously on the current stream, and the buffer is reused only
  once the event recorded after that copy has passed. Pinned memory is then the CPU-homed weights
  plus the ring, whatever the number and lengths of the generations.

On the CPU (no streams) every copy is a plain `copy_` and nothing is pinned.
"""
from __future__ import annotations

import threading

import torch

from .disk import ALIGN, aligned_empty
from .streams import Streams

STAGING_BYTES = 16 << 20  # one staging buffer; a bigger copy goes in pieces
STAGING_BUFFERS = 4  # I/O threads and disk readers copy at once


class HostMemory:
    def __init__(self, streams: Streams, pin: bool = True, staging_bytes: int = STAGING_BYTES,
                 staging_buffers: int = STAGING_BUFFERS):
        self.streams, self.api = streams, streams.api
        self.may_pin = pin and streams.active
        self.staging_bytes = staging_bytes
        self._pinned: list[torch.Tensor] = []  # page-locked by pin(), unlocked by close()
        self.refused = 0  # page-locks the OS refused (those buffers stayed pageable)
        self._lock = threading.RLock()  # re-entered: the ring is made (pinned) under its condition
        self._ring: list[list] | None = None  # [buffer, event of its last copy or None]
        self._free = threading.Condition(self._lock)
        self._ring_size = staging_buffers

    # --- buffers ---
    @property
    def pinned_bytes(self) -> int:
        """Bytes page-locked now (pinned weights and the staging ring)."""
        with self._lock:
            return sum(t.nbytes for t in self._pinned)

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        """t in host memory, page-locked at its exact size (whole pages) until close when pinning
        is allowed and the OS agrees; else t itself, contiguous."""
        if not self.may_pin:
            return t.contiguous()
        raw = self._locked(t.nbytes)
        if raw is None:
            return t.contiguous()
        out = raw[:t.nbytes].view(t.dtype).view(t.shape)
        out.copy_(t)
        return out

    def _locked(self, nbytes: int) -> torch.Tensor | None:
        """Whole pages of fresh host memory, page-locked (kept until close); None when refused."""
        raw = self._note(aligned_empty((_round_up(max(1, nbytes)),), torch.uint8))
        if not self.api.pin(raw):
            self.refused += 1
            return None
        with self._lock:
            self._pinned.append(raw)
        return raw

    def arena(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A CPU-tier arena: pageable host memory (its copies go through the staging ring)."""
        return self._note(torch.empty(shape, dtype=dtype))

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A short-lived host buffer for one read, pinned on CUDA (torch's pinned allocator: it
        records the stream of a copy from it, so the buffer outlives the copy)."""
        return self._note(torch.empty(shape, dtype=dtype, pin_memory=self.may_pin and _cuda(self.streams)))

    def _note(self, t: torch.Tensor) -> torch.Tensor:
        if self.api is not None:
            self.api.note_host(t)
        return t

    # --- copies ---
    def to_compute(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst (compute memory, any strides) <- src (host memory, any strides), asynchronously on
        the current stream where streams exist."""
        if not self.streams.active:
            dst.copy_(src)
            return
        if dst.dtype != src.dtype:  # the link moves src's bytes; the conversion runs on compute
            tmp = torch.empty(dst.shape, dtype=src.dtype, device=dst.device)
            self.to_compute(tmp, src)
            dst.copy_(tmp)
            return
        if src.is_contiguous() and self.api.is_pinned(src):
            dst.copy_(src, non_blocking=True)
            return
        for d, s in _pieces(dst, src, self.staging_bytes):
            i, buf = self._take()
            tmp = _as(buf, s)
            tmp.copy_(s)  # on the host: the source gathered into page-locked memory
            d.copy_(tmp, non_blocking=True)
            self._give(i, self.streams.record())

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst (host memory, any strides) <- src (compute memory); done when this returns."""
        if not self.streams.active:
            dst.copy_(src)
            return
        for d, s in _pieces(dst, src, self.staging_bytes):
            i, buf = self._take()
            tmp = _as(buf, s)
            tmp.copy_(s, non_blocking=True)
            ev = self.streams.record()
            ev.synchronize()  # the bytes are on the host before they are read there
            d.copy_(tmp)
            self._give(i, None)

    def to_compute_new(self, src: torch.Tensor) -> torch.Tensor:
        """A compute-device copy of host tensor src."""
        if not self.streams.active:
            return src
        out = torch.empty(src.shape, dtype=src.dtype, device=self.streams.device)
        self.to_compute(out, src)
        return out

    # --- the staging ring ---
    def _take(self) -> tuple[int, torch.Tensor]:
        """A free staging buffer (waits for the copy that used it last)."""
        with self._free:
            if self._ring is None:
                self._ring = [[self._staging(), None] for _ in range(self._ring_size)]
                self._busy = [False] * len(self._ring)
            while all(self._busy):
                self._free.wait()
            i = self._busy.index(False)
            self._busy[i] = True
            buf, ev = self._ring[i]
        if ev is not None:
            ev.synchronize()
        return i, buf

    def _give(self, i: int, ev) -> None:
        with self._free:
            self._ring[i][1] = ev
            self._busy[i] = False
            self._free.notify()

    def _staging(self) -> torch.Tensor:
        """One staging buffer: page-locked, or (refused) pageable, still correct but synchronous."""
        buf = self._locked(self.staging_bytes) if self.may_pin else None
        return buf[:self.staging_bytes] if buf is not None else self._note(torch.empty(self.staging_bytes, dtype=torch.uint8))

    def close(self) -> None:
        """Unlock what pin() and the ring locked (the tensors stay valid, pageable)."""
        with self._lock:
            locked, self._pinned = self._pinned, []
            ring, self._ring = self._ring or [], None
        for _, ev in ring:
            if ev is not None:
                ev.synchronize()  # no copy still reads a buffer about to be unlocked
        for t in locked:
            self.api.unpin(t)


def _round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def _cuda(streams: Streams) -> bool:
    return streams.device.type == "cuda"


def _as(buf: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The first bytes of staging buffer buf, viewed as a contiguous tensor shaped like `like`."""
    return buf[:like.numel() * like.element_size()].view(like.dtype).view(like.shape)


def _pieces(dst: torch.Tensor, src: torch.Tensor, cap: int):
    """(dst, src) sub-views whose source bytes each fit `cap`, split along the leading dims."""
    if src.numel() * src.element_size() <= cap or src.dim() == 0:
        yield dst, src
        return
    row = src[0].numel() * src.element_size()
    step = max(1, cap // max(1, row))
    for i in range(0, src.shape[0], step):
        if step == 1 and row > cap:
            yield from _pieces(dst[i], src[i], cap)
        else:
            yield dst[i:i + step], src[i:i + step]
