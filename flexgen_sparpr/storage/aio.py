"""Many positional reads of one file in flight at once, from the calling thread: Linux native AIO
(io_submit / io_getevents through libc's `syscall`, by ctypes; no library).

Why: a decode step's disk reads are many small requests (a selection's scattered 12 KiB blocks,
or a dense layer's runs of slots). Handed to reader threads, each costs a thread wake-up and a
GIL hand-off, and the readers' wake-ups take a core from the matmuls' thread team; read one after
the other, each waits out the disk's latency alone. With O_DIRECT, io_submit queues them all in
the kernel at once and io_getevents waits for them in one call (the GIL released: ctypes drops it
around foreign calls). Buffered files gain nothing (the kernel reads them inside io_submit), so
DiskFile uses this for O_DIRECT files only.

One AIO context per thread (made on first use, destroyed with the thread), since a thread reaps
only its own requests. Where the syscalls are missing (not Linux, another architecture, a
sandbox refusing them), `available()` is False and callers read as before.
"""
from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys
import threading

# (io_setup, io_destroy, io_getevents, io_submit) per architecture (asm/unistd_64.h, asm-generic)
_SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}
_EVENTS = 256  # requests in flight per context; more are submitted in rounds
_PREAD = 0  # IOCB_CMD_PREAD


class _Iocb(ctypes.Structure):
    _fields_ = [("aio_data", ctypes.c_uint64), ("aio_key", ctypes.c_uint32), ("aio_rw_flags", ctypes.c_uint32),
                ("aio_lio_opcode", ctypes.c_uint16), ("aio_reqprio", ctypes.c_int16),
                ("aio_fildes", ctypes.c_uint32), ("aio_buf", ctypes.c_uint64), ("aio_nbytes", ctypes.c_uint64),
                ("aio_offset", ctypes.c_int64), ("aio_reserved2", ctypes.c_uint64), ("aio_flags", ctypes.c_uint32),
                ("aio_resfd", ctypes.c_uint32)]


class _Event(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64), ("res", ctypes.c_int64),
                ("res2", ctypes.c_int64)]


class _Context:
    """One thread's AIO context and its request buffers."""

    def __init__(self, libc, calls):
        self.libc, (self.setup, self.destroy, self.getevents, self.submit) = libc, calls
        self.pid = os.getpid()  # a forked child cannot use its parent's context: it makes its own
        self.ctx = ctypes.c_ulong(0)
        if libc.syscall(self.setup, _EVENTS, ctypes.byref(self.ctx)) != 0:
            raise OSError(ctypes.get_errno(), "io_setup")
        self.cbs = (_Iocb * _EVENTS)()
        self.ptrs = (ctypes.POINTER(_Iocb) * _EVENTS)(*[ctypes.pointer(c) for c in self.cbs])
        self.events = (_Event * _EVENTS)()

    def read(self, fd: int, reqs: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
        """Up to _EVENTS (address, nbytes, offset) reads, all in flight; returns the (index, bytes
        read) of those that came back short (an error raises)."""
        return self.reap(reqs, self.submit_reads(fd, reqs))

    def submit_reads(self, fd: int, reqs: list[tuple[int, int, int]]) -> int:
        """Put up to _EVENTS reads in flight; returns how many the kernel took (the first ones)."""
        for i, (addr, n, off) in enumerate(reqs):
            c = self.cbs[i]
            c.aio_data, c.aio_lio_opcode, c.aio_fildes = i, _PREAD, fd
            c.aio_buf, c.aio_nbytes, c.aio_offset = addr, n, off
        sent = 0
        while sent < len(reqs):  # io_submit may take fewer than asked (EAGAIN: the queue is full)
            first = ctypes.byref(self.ptrs, sent * ctypes.sizeof(ctypes.c_void_p))
            r = self.libc.syscall(self.submit, self.ctx, len(reqs) - sent, first)
            if r < 0:
                e = ctypes.get_errno()
                if e == errno.EAGAIN and sent:
                    break  # reap what is in flight; the unsent come back as short, for the caller to read
                raise OSError(e, "io_submit")
            sent += r
        return sent

    def reap(self, reqs: list[tuple[int, int, int]], sent: int) -> list[tuple[int, int]]:
        """Wait for the first `sent` of reqs (submit_reads'); the (index, bytes read) of the short
        ones and of those never sent (an error raises, once all are reaped)."""
        got, short = 0, []
        while got < sent:
            r = self.libc.syscall(self.getevents, self.ctx, sent - got, sent - got,
                                  ctypes.byref(self.events, got * ctypes.sizeof(_Event)), None)
            if r < 0:
                e = ctypes.get_errno()
                if e == errno.EINTR:
                    continue
                raise OSError(e, "io_getevents")
            got += r
        for ev in self.events[:sent]:
            if ev.res < 0:
                raise OSError(-ev.res, os.strerror(-ev.res))
            if ev.res != reqs[ev.data][1]:
                short.append((ev.data, ev.res))
        if sent < len(reqs):
            short += [(i, 0) for i in range(sent, len(reqs))]  # not sent: the caller reads them
        return short

    def __del__(self):
        try:
            if self.pid == os.getpid():
                self.libc.syscall(self.destroy, self.ctx)
        except Exception:  # interpreter shutdown: the kernel frees it with the process
            pass


class _PerThread(threading.local):
    ctx: _Context | None = None
    failed: bool = False


_local = _PerThread()
_LIBC = None
_CALLS = _SYSCALLS.get(platform.machine()) if sys.platform.startswith("linux") else None


def _context() -> _Context | None:
    if _CALLS is None or _local.failed:
        return None
    if _local.ctx is None or _local.ctx.pid != os.getpid():
        _local.ctx = _new_context()
        _local.failed = _local.ctx is None
    return _local.ctx


def _new_context() -> _Context | None:
    """A fresh AIO context, or None: no syscall(), or io_setup refused (ENOSYS, EAGAIN: aio-max-nr)."""
    global _LIBC
    try:
        _LIBC = _LIBC or ctypes.CDLL(None, use_errno=True)
        return _Context(_LIBC, _CALLS)
    except (OSError, AttributeError):
        return None


def available() -> bool:
    """Whether this thread can read through native AIO."""
    return _context() is not None


def read_many(fd: int, reqs: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """Read every (address, nbytes, offset) of fd into memory at address, all in flight at once (in
    rounds of 256). Returns the requests that came back short, as (index, bytes read), for the
    caller to finish; raises OSError on a failed read. Needs available()."""
    ctx = _context()
    assert ctx is not None, "native AIO is not available here (check available() first)"
    short = []
    for k in range(0, len(reqs), _EVENTS):
        short += [(k + i, n) for i, n in ctx.read(fd, reqs[k:k + _EVENTS])]
    return short


class InFlight:
    """Reads put in flight by `submit` on an AIO context of their own, reaped by `wait` (from any
    thread). Holds `keep` (what the reads land in) until they are reaped; dropped unreaped (an
    error between submit and wait), it reaps them first, so no read lands in freed memory."""

    def __init__(self, ctx: _Context, reqs: list, sent: int, keep):
        self._ctx, self._reqs, self._sent, self._keep = ctx, reqs, sent, keep

    def wait(self) -> list[tuple[int, int]]:
        """Block until every read is back: the (index, bytes read) of the short ones and of any the
        kernel did not take, for the caller to finish; OSError for a failed read."""
        ctx, self._ctx = self._ctx, None
        if ctx is None:
            raise RuntimeError("these reads were reaped already")
        try:
            return ctx.reap(self._reqs, self._sent)
        except OSError as e:
            if e.strerror == "io_getevents":  # reads may still be landing: their memory and context are never freed
                _lost.append((ctx, self._keep))
                ctx = None
            raise
        finally:
            self._keep = None
            if ctx is not None:  # every request reaped (a failed read too): the context serves the next batch
                with _idle_lock:
                    _idle.append(ctx)

    def __del__(self):
        if getattr(self, "_ctx", None) is not None and self._ctx.pid == os.getpid():
            try:
                self.wait()
            except Exception:  # an unreaped read that failed: nothing is waiting for it
                pass


_idle: list[_Context] = []  # contexts free for `submit` (a context per batch in flight)
_idle_lock = threading.Lock()
_lost: list = []  # (context, memory) of reads that could not be reaped (io_getevents failed)


def submit(fd: int, reqs: list[tuple[int, int, int]], keep=None) -> InFlight | None:
    """Put up to 256 (address, nbytes, offset) reads of fd in flight and return at once; InFlight.wait
    reaps them (more than 256: the rest come back from wait as unsent). keep: the object owning the
    memory the reads land in, held until they are reaped. None where no context can be had (native
    AIO missing, or the kernel's aio-max-nr reached): then read another way."""
    if _CALLS is None or _local.failed:
        return None
    with _idle_lock:
        while _idle and _idle[-1].pid != os.getpid():  # a forked child: its parent's contexts are not its own
            _idle.pop()
        ctx = _idle.pop() if _idle else None
    if ctx is None and (ctx := _new_context()) is None:
        return None
    try:
        sent = ctx.submit_reads(fd, reqs[:_EVENTS])
    except BaseException:
        with _idle_lock:
            _idle.append(ctx)
        raise
    return InFlight(ctx, reqs, sent, keep)
