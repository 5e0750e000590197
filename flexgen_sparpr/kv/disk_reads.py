"""How a TierStore's disk blocks come in: a batch of read requests lands in one page-aligned host
buffer (O_DIRECT reads land in place, no bounce copy), the requests split over the disk store's
read depth in shares that each reader takes in turn (a thread hand-off per small request cost
more than the read), the link's bandwidth timed over the reads. Two ways to place what was read:
each request's sink copies its bytes out (long runs), or all short runs are placed at once by one
indexed copy (a selection's scattered blocks: thousands of runs a step, one read call each and no
tensor op per run)."""
from __future__ import annotations

import itertools
import threading
import time

import torch

from ..storage.disk import ALIGN, aligned_empty

_READ_BUFFERS = threading.local()  # per thread: the host buffer its CPU-only disk reads land in


def read_disk(store, jobs: list) -> None:
    """Disk requests (first slot, slots, sink) of a TierStore: read, then each request's bytes
    handed to its sink on compute, on the reader's thread after its share's reads (a sink's copy
    never waits on a read)."""
    dev, piece = store.devices, store.disk_file.slot_bytes
    sizes = [count * piece for _, count, _ in jobs]
    host = read_buffer(dev, sum(sizes)).split(sizes)
    reqs = [(slot, count, h, sink) for (slot, count, sink), h in zip(jobs, host)]

    def read(share: list) -> None:
        for slot, count, h, _ in share:
            store.disk_file.read_slots(slot, count, h)
        for _, _, h, sink in share:
            sink(dev.host.to_compute_new(h))
    # the readers copy on the caller's stream, in its inference mode (storage/streams.py, rule 4)
    _in_shares(store, dev.streams.carry(read), reqs, sum(sizes))


def read_raw_disk(store, runs: list, out: torch.Tensor) -> None:
    """Short raw disk runs (first slot, slots, first row, first block of out) read as ranges, then
    placed in out ([planes, B, Hkv, T, D], its blocks bs-aligned) by one indexed copy, converting
    from the stored dtype."""
    dev, piece, bs = store.devices, store.disk_file.slot_bytes, store.bs
    planes, b_all, h, _, d = store.block_shape
    at = list(itertools.accumulate((c * piece for _, c, _, _ in runs), initial=0))
    host = read_buffer(dev, at[-1])
    reqs = [((slot, c), a) for (slot, c, _, _), a in zip(runs, at)]
    _in_shares(store, lambda share: store.disk_file.read_ranges([r for r, _ in share], host, [a for _, a in share]),
               reqs, at[-1], batched=True)
    data = dev.host.to_compute_new(host).view(store.store_dtype)
    nb = max(b0 + c for _, c, _, b0 in runs)
    out6 = out[:, :, :, :nb * bs].unflatten(3, (nb, bs))  # out6: [planes, B, Hkv, nb, bs, D]
    blk = torch.tensor([b0 + x for _, c, _, b0 in runs for x in range(c)], device=out.device)
    if store.seq_disk:  # a unit: one sequence's share of a block, [planes, Hkv, bs, D]
        row = torch.tensor([r for _, c, r, _ in runs for _ in range(c)], device=out.device)
        out6[:, row, :, blk] = data.view(len(blk), planes, h, bs, d).to(out.dtype)  # [U, planes, Hkv, bs, D]
    else:  # a unit: a whole block, [B, planes, Hkv, bs, D]
        out6[:, :, :, blk] = data.view(len(blk), b_all, planes, h, bs, d).permute(2, 1, 3, 0, 4, 5).to(out.dtype)


def read_landed(store, ranges: list, out: torch.Tensor) -> None:
    """Raw disk runs ((first slot, slots), byte offset in out) of a TierStore's packed file read into
    page-aligned CPU out, where they stay (attended there: TierReads.land)."""
    _in_shares(store, lambda share: store.disk_file.read_ranges([r for r, _ in share], out, [a for _, a in share]),
               ranges, _ranges_bytes(store, ranges), batched=True)


class LandingReads:
    """read_landed's reads put in flight from the calling thread (`landed_later`); wait() blocks
    until they are in out and counts them on the disk link (their bytes and requests, not their
    time: the compute that ran meanwhile is not the disk's)."""

    def __init__(self, store, pending, nbytes: int, requests: int):
        self._store, self._pending, self._nbytes, self._requests = store, pending, nbytes, requests

    def wait(self) -> None:
        self._pending.wait()
        self._store.devices.counters.add("disk", "cpu", self._nbytes, requests=self._requests)

    def drop(self) -> None:
        """Reap reads whose bytes will not be used; still counted on the disk link: the disk read them."""
        try:
            self.wait()
        except OSError:  # a failed read nobody uses
            pass


def landed_later(store, ranges: list, out: torch.Tensor) -> LandingReads | None:
    """read_landed, returning at once with its reads in flight (native AIO on an O_DIRECT file: the
    disk works while this thread computes, and no reader thread takes the GIL or a core from it);
    None where the reads cannot be in flight (then read_landed)."""
    pending = store.disk_file.read_ranges([r for r, _ in ranges], out, [a for _, a in ranges], later=True)
    if pending is None:
        return None
    return LandingReads(store, pending, _ranges_bytes(store, ranges), len(ranges))


def _ranges_bytes(store, ranges: list) -> int:
    """The bytes of raw disk runs ((first slot, slots), byte offset)."""
    return sum(c for (_, c), _ in ranges) * store.disk_file.slot_bytes


def _in_shares(store, read, reqs: list, nbytes: int, batched: bool = False) -> None:
    """read(share) for the requests cut into the read depth's shares, in parallel; or, `batched`
    (read issues a share's requests all at once) where the file reads through native AIO
    (storage/aio.py), read(reqs) on this thread: every request in flight, no reader thread woken.
    The bytes and their time counted on the disk link (and the host link on CUDA)."""
    dev, depth = store.devices, min(store.disk_store.read_depth, len(reqs))
    if batched and store.disk_file.reads_in_flight():
        depth = 1
    t0 = time.perf_counter()
    store.disk_store.map(read, [reqs[k::depth] for k in range(depth)])
    dt = time.perf_counter() - t0
    dev.counters.add("disk", "cpu", nbytes, dt, requests=len(reqs))
    if dev.is_cuda:
        dev.counters.add("cpu", "compute", nbytes, requests=len(reqs))


def read_buffer(dev, nbytes: int) -> torch.Tensor:
    """A page-aligned host buffer for one batch of disk reads: fresh and pinned when a device copy
    will read it (the copy records it), else this thread's, reused (its sinks copy out before the
    batch returns; fresh pages would fault in on every read)."""
    if dev.streams.active:
        raw = dev.empty_host((nbytes + ALIGN,), torch.uint8)
        skip = (-raw.data_ptr()) % ALIGN
        return raw[skip:skip + nbytes]
    buf = getattr(_READ_BUFFERS, "buf", None)
    if buf is None or buf.numel() < nbytes:
        with torch.inference_mode(False):  # written outside inference mode too
            buf = _READ_BUFFERS.buf = aligned_empty((nbytes,), torch.uint8)
    return buf[:nbytes]
