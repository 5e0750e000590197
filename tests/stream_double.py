"""A CPU stand-in for CUDA's streams and events (the `api` of storage/streams.py), with a checker:
PyTorch's CUDA sanitizer, run on the CPU.

    with StreamDouble() as cuda:
        with Engine(src, policy, cfg, stream_api=cuda) as eng:
            eng.generate(prompts, 4)
    assert cuda.problems == []

While installed, every torch op of every thread (each thread started meanwhile enters a dispatch
mode) is taken as launched on its thread's current stream (the default stream unless it entered
`cuda.stream(s)`, as in CUDA), except ops on host buffers only (told by `note_host`, `pin`), which
the host does at once. Ordering follows CUDA's rules as vector clocks: a stream runs its ops in
launch order after what its host thread knew had finished; `wait_stream`, events, `synchronize`
and host syncs (`.item()`, `.tolist()`, `torch.equal`, `nonzero`, boolean indexing) order the
rest; host threads pass on what they know at thread starts, executor submits and future results.
It records
- races: overlapping bytes, one access a write, on two timelines with no ordering between them;
- unrecorded uses: memory allocated on a side stream used on a stream it was not recorded on
  (`record_stream`), which the caching allocator could give out again meanwhile;
- syncs: each host sync, by call site (hot-loop checks).
Compute and host buffers are both CPU tensors here, told apart by `note_host`; `.cpu()` is a no-op,
so it is not seen as a sync.
"""
from __future__ import annotations

import itertools
import sys
import threading
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops after which the host holds a value computed on the stream (or a data-dependent shape)
SYNC_OPS = {"aten._local_scalar_dense.default", "aten.item.default", "aten.is_nonzero.default",
            "aten.equal.default", "aten.nonzero.default", "aten.masked_select.default",
            "aten.repeat_interleave.Tensor", "aten.repeat_interleave.self_Tensor", "aten.unique_dim.default",
            "aten._unique2.default", "aten.argwhere.default"}


class _Timeline:
    """A stream, or a host thread (whose ops finish at once): a vector clock over timelines."""

    def __init__(self, double: "StreamDouble", name: str):
        self.double, self.name, self.id = double, name, next(double._ids)
        self.clock: dict[int, int] = {self.id: 0}


class Stream(_Timeline):
    def wait_stream(self, other: "Stream") -> None:
        with self.double._lock:
            _join(self.clock, other.clock)

    def wait_event(self, ev: "Event") -> None:
        with self.double._lock:
            _join(self.clock, ev.clock)

    def synchronize(self) -> None:
        with self.double._lock:
            _join(self.double._host().clock, self.clock)

    def record_event(self, ev: "Event | None" = None) -> "Event":
        ev = ev or Event(self.double)
        ev.record(self)
        return ev

    def query(self) -> bool:
        return True

    def __repr__(self):
        return f"<{self.name}>"


class Event:
    def __init__(self, double: "StreamDouble"):
        self.double, self.clock = double, {}

    def record(self, stream: Stream | None = None) -> None:
        with self.double._lock:
            self.clock = dict((stream or self.double.current_stream()).clock)

    def wait(self, stream: Stream | None = None) -> None:
        (stream or self.double.current_stream()).wait_event(self)

    def synchronize(self) -> None:
        with self.double._lock:
            _join(self.double._host().clock, self.clock)

    def query(self) -> bool:
        return True


@dataclass
class _Access:
    lo: int
    hi: int
    tl: int
    tick: int
    write: bool
    what: str


class StreamDouble:
    def __init__(self, refuse_pin: bool = False):
        self._lock = threading.RLock()
        self._ids = itertools.count()
        self._tls = threading.local()
        self.default = Stream(self, "the default stream")
        self.problems: list[str] = []
        self.syncs: Counter = Counter()  # call site -> host syncs
        self.pinned: set[int] = set()  # storages page-locked now
        self.pin_calls = 0
        self.refuse_pin = refuse_pin
        self._names = {self.default.id: self.default.name}
        self._seen: set = set()
        self._records: dict[int, list[_Access]] = {}  # storage -> accesses not yet ordered out
        self._alloc: dict[int, tuple[int, set, str]] = {}  # storage -> (side stream, recorded on, where)
        self._host_keys: set[int] = set()
        self._literals: set[int] = set()  # tensors made from Python values (torch.tensor)
        self.installed = False

    # --- the stream API of storage/streams.py ---
    def Stream(self, device=None) -> Stream:  # noqa: N802 (torch.cuda's name)
        s = Stream(self, f"stream {len(self._names)}")
        self._names[s.id] = s.name
        return s

    def Event(self) -> Event:  # noqa: N802
        return Event(self)

    def current_stream(self, device=None) -> Stream:
        return getattr(self._tls, "stream", None) or self.default

    def default_stream(self, device=None) -> Stream:
        return self.default

    @contextmanager
    def stream(self, s: Stream):
        old, self._tls.stream = getattr(self._tls, "stream", None), s
        try:
            yield
        finally:
            self._tls.stream = old

    def record_stream(self, t: torch.Tensor, s: Stream) -> None:
        with self._lock:
            a = self._alloc.get(_key(t))
            if a is not None:
                a[1].add(s.id)

    def is_pinned(self, t: torch.Tensor) -> bool:
        return _key(t) in self.pinned

    def pin(self, t: torch.Tensor) -> bool:
        self.pin_calls += 1
        if self.refuse_pin:
            return False
        self.note_host(t)
        self.pinned.add(_key(t))
        return True

    def unpin(self, t: torch.Tensor) -> None:
        self.pinned.discard(_key(t))

    def note_host(self, t: torch.Tensor) -> None:
        """t is host memory, new: its ops that touch host memory only are the host's."""
        with self._lock:
            k = _key(t)
            self._host_keys.add(k)
            self._records[k] = []
            self._alloc.pop(k, None)

    # --- installing ---
    def __enter__(self) -> "StreamDouble":
        double = self
        self._saved = (threading.Thread.start, threading.Thread.run, ThreadPoolExecutor.submit,
                       Future.set_result, Future.result, torch.Tensor.tolist)
        start, run, submit, set_result, result, tolist = self._saved

        def start_(t, *a, **kw):
            t._double_clock = dict(double._host().clock)
            return start(t, *a, **kw)

        def run_(t):
            double._host(inherit=getattr(t, "_double_clock", None))
            with _Mode(double):
                return run(t)

        def submit_(ex, fn, *a, **kw):
            clock = dict(double._host().clock)

            def task():
                with double._lock:
                    _join(double._host().clock, clock)
                return fn(*a, **kw)
            return submit(ex, task)

        def set_result_(f, value):
            f._double_clock = dict(double._host().clock)
            return set_result(f, value)

        def result_(f, timeout=None):
            value = result(f, timeout)
            clock = getattr(f, "_double_clock", None)
            if clock is not None:
                with double._lock:
                    _join(double._host().clock, clock)
            return value

        def tolist_(t):
            double._op("tolist", [t], [], sync=True)
            return tolist(t)
        threading.Thread.start, threading.Thread.run, ThreadPoolExecutor.submit = start_, run_, submit_
        Future.set_result, Future.result, torch.Tensor.tolist = set_result_, result_, tolist_
        self._mode = _Mode(self)
        self._mode.__enter__()
        self.installed = True
        return self

    def __exit__(self, *exc) -> None:
        self.installed = False
        self._mode.__exit__(*exc)
        (threading.Thread.start, threading.Thread.run, ThreadPoolExecutor.submit,
         Future.set_result, Future.result, torch.Tensor.tolist) = self._saved

    # --- the checker ---
    def _host(self, inherit: dict | None = None) -> _Timeline:
        h = getattr(self._tls, "host", None)
        if h is None:
            h = self._tls.host = _Timeline(self, f"host thread {threading.current_thread().name}")
            self._names[h.id] = h.name
        if inherit:
            _join(h.clock, inherit)
        return h

    def _op(self, what: str, reads: list, writes: list, sync: bool = False) -> _Timeline:
        """One op: its accesses checked and recorded; a sync makes the host wait for its stream."""
        with self._lock:
            h = self._host()
            keys = [_key(t) for t in reads + writes if _extent(t) is not None]
            # host memory only (tensors made from Python values are made on the host too)
            host_only = any(k in self._host_keys for k in keys) and all(
                k in self._host_keys or k in self._literals for k in keys)
            tl = h if host_only else self.current_stream()
            if not host_only:
                _join(tl.clock, h.clock)
            tl.clock[tl.id] += 1
            where = _where()
            for ts, write in ((reads, False), (writes, True)):
                for t in ts:
                    ext = _extent(t)
                    if ext is not None:
                        self._check(ext, write, tl, dict(tl.clock), what, where)
            if sync and not host_only:
                _join(h.clock, tl.clock)
                self.syncs[f"{what} at {where}"] += 1
            return tl

    def _fresh(self, t: torch.Tensor, what: str, s: _Timeline) -> None:
        """t was just allocated by an op on timeline s: a host op's output is host memory; a
        tensor made from Python values (torch.tensor) is made by the host, and stays a "literal"
        (host or compute memory: torch.tensor(..., device=...) cannot be told apart here)."""
        if _extent(t) is None:
            return
        with self._lock:
            k, literal = _key(t), what.startswith("aten.lift_fresh")
            if literal:
                s = self._host()
            self._records[k] = [_Access(0, t.untyped_storage().nbytes(), s.id, s.clock[s.id], True,
                                        f"{what} (allocation) at {_where()}")]
            self.pinned.discard(k)
            (self._literals.add if literal else self._literals.discard)(k)
            (self._host_keys.add if not isinstance(s, Stream) and not literal else self._host_keys.discard)(k)
            if isinstance(s, Stream) and s is not self.default:
                self._alloc[k] = (s.id, set(), _where())
            else:
                self._alloc.pop(k, None)

    def _check(self, ext, write: bool, tl: _Timeline, clock: dict, what: str, where: str) -> None:
        k, lo, hi = ext
        a = self._alloc.get(k)
        if a is not None and isinstance(tl, Stream) and a[0] != tl.id and tl.id not in a[1]:
            a[1].add(tl.id)  # said once
            self._problem(f"unrecorded use: {what} at {where} on {tl.name} uses memory allocated on "
                          f"{self._names[a[0]]} at {a[2]}, not recorded on {tl.name} (record_stream)")
        recs = self._records.setdefault(k, [])
        for r in recs:
            if r.hi <= lo or r.lo >= hi or not (write or r.write) or r.tl == tl.id or clock.get(r.tl, 0) >= r.tick:
                continue
            self._problem(f"race: {what} at {where} on {tl.name} {'writes' if write else 'reads'} bytes "
                          f"[{lo}, {hi}) that {r.what} on {self._names[r.tl]} {'wrote' if r.write else 'read'} "
                          f"[{r.lo}, {r.hi}), with no ordering between them")
        if write:  # what it covers is now ordered before it, or reported
            recs[:] = [r for r in recs if not (lo <= r.lo and r.hi <= hi)]
        else:
            recs[:] = [r for r in recs if r.write or r.tl != tl.id or not (lo <= r.lo and r.hi <= hi)]
        recs.append(_Access(lo, hi, tl.id, clock[tl.id], write, f"{what} at {where}"))

    def _problem(self, msg: str) -> None:
        if msg not in self._seen and len(self.problems) < 50:
            self._seen.add(msg)
            self.problems.append(msg)


class _Mode(TorchDispatchMode):
    """Sends each op of its thread through the double."""

    def __init__(self, double: StreamDouble):
        super().__init__()
        self.double = double

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.double.installed:
            return func(*args, **kwargs)
        name = str(func)
        reads, writes = _accesses(func, name, args, kwargs)
        sync = name in SYNC_OPS or (name.startswith(("aten.index.", "aten.index_put")) and any(
            t.dtype in (torch.bool, torch.uint8) for t in _flat(args[1])))
        tl = self.double._op(name, reads, writes, sync=sync)
        out = func(*args, **kwargs)
        rets = func._schema.returns
        outs = out if len(rets) > 1 else (out,)
        for r, v in zip(rets, outs):
            if r.alias_info is None or name.startswith("aten.lift_fresh"):
                for t in _flat(v):
                    self.double._fresh(t, name, tl)
        return out


def _accesses(func, name: str, args, kwargs) -> tuple[list, list]:
    """(tensors the op reads, tensors it writes), from its schema: an aliased argument that is not
    written is a view taken, not bytes read; a _like or new_ op reads no bytes."""
    if "_like" in name or name.startswith(("aten.new_", "aten.lift_fresh")):  # shape and dtype only
        return [], []
    reads, writes = [], []
    for i, a in enumerate(func._schema.arguments):
        v = kwargs.get(a.name) if a.kwarg_only or i >= len(args) else args[i]
        ts = list(_flat(v))
        if not ts:
            continue
        if a.alias_info is not None and a.alias_info.is_write:
            writes += ts
        elif a.alias_info is None:
            reads += ts
    return reads, writes


def _flat(v):
    if torch.is_tensor(v):
        yield v
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from _flat(x)


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _extent(t: torch.Tensor):
    """(storage, first byte, end byte) of what t spans in its storage; None for no bytes."""
    try:
        if t.numel() == 0 or t.untyped_storage().nbytes() == 0:
            return None
        es = t.element_size()
        span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        lo = t.storage_offset() * es
        return _key(t), lo, lo + span * es
    except (RuntimeError, NotImplementedError):
        return None


def _join(into: dict, other: dict) -> None:
    for k, v in other.items():
        if into.get(k, -1) < v:
            into[k] = v


def _where() -> str:
    """The innermost call site in the package (else the innermost outside torch and this file)."""
    f, fallback = sys._getframe(2), None
    while f is not None:
        name = f.f_code.co_filename
        if "flexgen_sparpr" in name:
            return f"{name.split('flexgen_sparpr/')[-1]}:{f.f_lineno}"
        if fallback is None and "torch" not in name and "stream_double" not in name:
            fallback = f"{name.rsplit('/', 1)[-1]}:{f.f_lineno}"
        f = f.f_back
    return fallback or "?"


class Preloaded:
    """A weight source read whole before the double is installed (safetensors cannot read
    under a dispatch mode)."""

    def __init__(self, source, names):
        self.spec, self._t = source.spec, {n: source.get(n) for n in names}

    def get(self, name: str) -> torch.Tensor:
        return self._t[name].clone()

    def shape_of(self, name: str):
        return tuple(self._t[name].shape)
