"""Disk tier: preallocated slot files for weights and KV-cache blocks.

A `DiskFile` is one file cut into `num_slots` fixed-size slots; each slot holds
the raw bytes of one contiguous tensor (O_DIRECT where the filesystem allows it).
The directory of one run and its readers: storage/disk_store.py.
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import torch

from . import aio
from .aligned import ALIGN, aligned_empty, byte_view, is_aligned, np_bytes, round_up, staging  # noqa: F401 (re-exported)

_MAX_IO = 1 << 30  # one syscall moves at most ~2 GiB on Linux; stay well below


def _pio(fn, fd: int, mv: memoryview, off: int) -> None:
    """Loop a positional read/write (`os.preadv`/`os.pwritev`) until `mv` is done."""
    done = 0
    while done < len(mv):
        n = fn(fd, [mv[done:done + _MAX_IO]], off + done)
        if n <= 0:
            raise OSError(errno.EIO, f"short I/O at offset {off + done}")
        done += n


class DiskFile:
    """A preallocated file of `num_slots` slots, each `slot_bytes` long (padded to 4096, unless
    `packed` and not `direct`: then slot after slot, so that any run of slots is one range).

    `direct_mode` is "o_direct" (page cache bypassed), "fadvise" (O_DIRECT was
    refused; pages are dropped with POSIX_FADV_DONTNEED instead) or "buffered".
    Reads and writes of different slots may run concurrently from many threads.
    """

    def __init__(self, path: Path, num_slots: int, slot_bytes: int, direct: bool = False, packed: bool = False):
        if num_slots <= 0 or slot_bytes <= 0:
            raise ValueError(f"need num_slots > 0 and slot_bytes > 0, got {num_slots}, {slot_bytes}")
        self.path = Path(path)
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.slot_stride = slot_bytes if packed and not direct else round_up(slot_bytes)
        self.bytes_read = 0
        self.bytes_written = 0
        self._lens = [-1] * num_slots  # payload bytes last written per slot; -1 = never
        self._lock = threading.Lock()
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        self._fd = os.open(self.path, flags, 0o600)
        self.direct_mode = "buffered"
        try:  # fail early (e.g. ENOSPC) rather than mid-run, and leave no file behind
            self._preallocate(num_slots * self.slot_stride)
            if direct:
                self.direct_mode = self._try_o_direct(flags & ~(os.O_CREAT | os.O_TRUNC))
        except BaseException:
            self.close()
            raise

    def _preallocate(self, size: int) -> None:
        try:
            os.posix_fallocate(self._fd, 0, size)
        except OSError as e:  # some filesystems lack fallocate: a sparse file still works
            if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise OSError(e.errno, e.strerror, str(self.path)) from None  # name the file (ENOSPC)
            os.ftruncate(self._fd, size)

    def _try_o_direct(self, flags: int) -> str:
        """Reopen with O_DIRECT; probe one aligned read because some filesystems fail late."""
        o_direct = getattr(os, "O_DIRECT", 0)
        if o_direct:
            fd = -1
            try:
                fd = os.open(self.path, flags | o_direct)
                os.preadv(fd, [memoryview(staging.get(ALIGN).numpy())], 0)
            except OSError as e:
                if fd >= 0:
                    os.close(fd)
                if e.errno != errno.EINVAL:
                    raise
            else:
                os.close(self._fd)
                self._fd = fd
                return "o_direct"
        return "fadvise" if hasattr(os, "posix_fadvise") else "buffered"

    # ------------------------------------------------------------------ I/O
    def _check(self, slot: int, nbytes: int) -> int:
        if self._fd < 0:
            raise ValueError(f"{self.path} is closed")
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        if nbytes > self.slot_bytes:
            raise ValueError(f"{nbytes} bytes do not fit a {self.slot_bytes}-byte slot")
        return slot * self.slot_stride

    def _drop_cache(self, off: int, n: int) -> None:
        if self.direct_mode == "fadvise":
            os.posix_fadvise(self._fd, off, n, os.POSIX_FADV_DONTNEED)

    def write(self, slot: int, t: torch.Tensor) -> None:
        """Store the raw bytes of contiguous tensor `t` (any shape/dtype/device) in `slot`."""
        if not t.is_contiguous():
            raise ValueError("DiskFile.write needs a contiguous tensor")
        n = t.nbytes
        off = self._check(slot, n)
        if n:
            if self.direct_mode == "o_direct" and not (t.is_cpu and is_aligned(t)):
                buf = staging.get(round_up(n))
                buf[:n].copy_(byte_view(t))  # CUDA: device-to-host straight into the bounce buffer
                buf[n:].zero_()
                _pio(os.pwritev, self._fd, memoryview(buf.numpy()), off)
            else:
                src = t if t.is_cpu else t.cpu()
                _pio(os.pwritev, self._fd, np_bytes(src), off)
                self._drop_cache(off, n)
        self._lens[slot] = n
        with self._lock:
            self.bytes_written += n

    def read(self, slot: int, out: torch.Tensor) -> torch.Tensor:
        """Fill contiguous `out` (exactly the byte size written) with the bytes written to `slot`;
        returns `out`. A CPU `out` is filled directly; any other device through a CPU bounce buffer."""
        if not out.is_contiguous():
            raise ValueError("DiskFile.read needs a contiguous output tensor")
        n = out.nbytes
        off = self._check(slot, n)
        if self._lens[slot] != n:
            raise ValueError(f"slot {slot} holds {self._lens[slot]} bytes, out has {n}")
        return self._read_into(off, out)

    @property
    def is_packed(self) -> bool:
        """Whether consecutive slots are one byte range (no padding between them)."""
        return self.slot_stride == self.slot_bytes

    def read_slots(self, first: int, count: int, out: torch.Tensor) -> torch.Tensor:
        """Fill contiguous `out` with slots [first, first + count), each written whole, in one
        request (a span). Slots padded to whole pages (O_DIRECT, `is_packed` False) are read with
        their padding into this thread's staging buffer, then each slot's bytes copied out."""
        if not out.is_contiguous():
            raise ValueError("DiskFile.read_slots needs a contiguous output tensor")
        if count < 1:
            raise ValueError(f"cannot read {count} slots")
        off = self._check(first, 0)
        self._check(first + count - 1, 0)
        if out.nbytes != count * self.slot_bytes:
            raise ValueError(f"{count} slots hold {count * self.slot_bytes} bytes, out has {out.nbytes}")
        short = [s for s in range(first, first + count) if self._lens[s] != self.slot_bytes]
        if short:
            raise ValueError(f"slot {short[0]} holds {self._lens[short[0]]} bytes, not a whole {self.slot_bytes}")
        if count > 1 and not self.is_packed:  # one request over the padded slots
            stride = self.slot_stride
            buf = staging.get(count * stride)
            self._read_into(off, buf)
            byte_view(out).view(count, self.slot_bytes).copy_(buf.view(count, stride)[:, :self.slot_bytes])
            return out
        return self._read_into(off, out)

    def reads_in_flight(self) -> bool:  # read_ranges issues its requests all at once (O_DIRECT, native AIO)
        return self.direct_mode == "o_direct" and aio.available()

    def read_ranges(self, ranges: list[tuple[int, int]], out: torch.Tensor, at: list[int],
                    later: bool = False) -> "int | PendingRead | None":
        """Slot ranges (first, count) of a packed file into contiguous page-aligned CPU `out`, range k
        at byte at[k] (with O_DIRECT: multiples of 4096), checked once for all (a decode step issues
        thousands of small ones: per-request Python is what they cost); with O_DIRECT all in flight
        at once where native AIO is here (storage/aio.py), else one request each. Returns the bytes
        read; or, `later`, at once with a PendingRead (the reads in flight, from this thread: no
        reader thread) whose wait() finishes them, or None where they cannot be in flight (then
        read them without `later`)."""
        direct = self.direct_mode == "o_direct"
        if not (out.is_cpu and out.is_contiguous() and (is_aligned(out) or not direct)) or not self.is_packed:
            raise ValueError("DiskFile.read_ranges needs a packed file and a contiguous CPU tensor (page-aligned "
                             "for O_DIRECT)")
        sb, fd, size = self.slot_bytes, self._fd, out.nbytes
        if fd < 0:
            raise ValueError(f"{self.path} is closed")
        for (first, count), pos in zip(ranges, at):
            if count < 1 or first < 0 or first + count > self.num_slots or pos + count * sb > size:
                raise IndexError(f"slots [{first}, {first + count}) or byte {pos} out of range")
            if self.direct_mode == "fadvise":  # the page cache dropped first: the bytes come from the disk
                self._drop_cache(first * sb, count * sb)
        reqs = [(first * sb, pos, count * sb) for (first, count), pos in zip(ranges, at)]
        aio_reqs = [(out.data_ptr() + pos, n, off) for off, pos, n in reqs]
        if later:
            flight = aio.submit(fd, aio_reqs, keep=out) if self.reads_in_flight() else None
            return None if flight is None else PendingRead(self, reqs, out, flight)
        if len(reqs) > 1 and self.reads_in_flight():
            return self._finish(reqs, out, aio.read_many(fd, aio_reqs))
        return self._finish(reqs, out, [(i, 0) for i in range(len(reqs))])

    def _finish(self, reqs: list[tuple[int, int, int]], out: torch.Tensor, short: list[tuple[int, int]]) -> int:
        """The short (index, bytes read) of reqs (offset, byte in out, bytes) read to their end by
        positional reads (_pio: a signal, a huge range); returns (and counts) the bytes of reqs."""
        mv = np_bytes(out) if short else None  # a view made only where a read is left to finish
        for i, got in short:
            off, pos, n = reqs[i]
            _pio(os.preadv, self._fd, mv[pos + got:pos + n], off + got)
        total = sum(n for _, _, n in reqs)
        with self._lock:
            self.bytes_read += total
        return total

    def read_at(self, slot: int, start: int, out: torch.Tensor) -> torch.Tensor:
        """Fill contiguous `out` with bytes [start, start + out.nbytes) of `slot` (part of what was written
        there); with O_DIRECT, from any `start` (the pages around the bytes, through the staging buffer)."""
        if not out.is_contiguous():
            raise ValueError("DiskFile.read_at needs a contiguous output tensor")
        n = out.nbytes
        off = self._check(slot, 0) + start
        if start < 0 or start + n > self._lens[slot]:
            raise ValueError(f"bytes [{start}, {start + n}) are outside slot {slot}'s {self._lens[slot]}")
        if self.direct_mode == "o_direct" and start % ALIGN:
            buf, skip = staging.get(round_up(start % ALIGN + n)), start % ALIGN
            _pio(os.preadv, self._fd, memoryview(buf.numpy()), off - skip)
            byte_view(out).copy_(buf[skip:skip + n])
            with self._lock:
                self.bytes_read += buf.numel()
            return out
        return self._read_into(off, out)

    def _read_into(self, off: int, out: torch.Tensor) -> torch.Tensor:
        n = out.nbytes
        if n:
            self._drop_cache(off, n)
            if out.is_cpu and (self.direct_mode != "o_direct" or is_aligned(out)):
                _pio(os.preadv, self._fd, np_bytes(out), off)
            else:
                buf = staging.get(round_up(n))
                _pio(os.preadv, self._fd, memoryview(buf.numpy()), off)
                byte_view(out).copy_(buf[:n])
        with self._lock:
            self.bytes_read += n
        return out

    def read_new(self, slot: int, shape, dtype: torch.dtype) -> torch.Tensor:
        """Read `slot` into a fresh page-aligned CPU tensor of `shape`/`dtype`."""
        return self.read(slot, aligned_empty(tuple(shape), dtype))

    def sync(self) -> None:
        """Flush written data to the device (fsync)."""
        if self._fd >= 0:
            os.fsync(self._fd)

    def close(self) -> None:
        """Close the file descriptor and delete the file; safe to call twice."""
        with self._lock:
            fd, self._fd = self._fd, -1
        if fd < 0:
            return
        os.close(fd)
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    def __enter__(self) -> "DiskFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DiskFile({str(self.path)!r}, {self.num_slots}x{self.slot_bytes}B, {self.direct_mode})"


class PendingRead:
    """DiskFile.read_ranges(later=True)'s reads in flight: wait() finishes them (the short ones by
    positional reads) and returns the bytes read."""

    def __init__(self, file: DiskFile, reqs: list, out: torch.Tensor, flight: aio.InFlight):
        self._file, self._reqs, self._out, self._flight = file, reqs, out, flight

    def wait(self) -> int:
        return self._file._finish(self._reqs, self._out, self._flight.wait())
