"""Native AIO reads (storage/aio.py): every request in flight from the calling thread, the bytes
exactly what positional reads give, errors raised, and DiskFile.read_ranges equal either way."""
import os
import platform
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import torch

from flexgen_sparpr.storage import aio, disk
from flexgen_sparpr.storage.disk import DiskFile, aligned_empty

LINUX = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64")
needs_aio = pytest.mark.skipif(not LINUX, reason="native AIO is Linux's (x86_64, aarch64)")


@pytest.fixture
def direct_file():
    """A 1 MiB file of random bytes on a disk-backed filesystem, opened with O_DIRECT (skipped
    where the filesystem refuses O_DIRECT: then DiskFile never reads through AIO)."""
    d = Path(tempfile.mkdtemp(prefix="fgsp-aio-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None))
    p = d / "f.bin"
    data = os.urandom(1 << 20)
    p.write_bytes(data)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        pytest.skip("this filesystem refuses O_DIRECT")
    yield fd, data
    os.close(fd)
    p.unlink()
    d.rmdir()


@needs_aio
def test_many_reads_in_flight_return_the_files_bytes(direct_file):
    fd, data = direct_file
    assert aio.available()
    gen = torch.Generator().manual_seed(0)
    for n in (2, 7, 300):  # 300: more than one round of 256
        pages = torch.randint(0, 254, (n,), generator=gen).tolist()
        sizes = torch.randint(1, 3, (n,), generator=gen).tolist()
        out = aligned_empty((n * 2 * 4096,), torch.uint8)
        reqs = [(out.data_ptr() + i * 8192, s * 4096, p * 4096) for i, (p, s) in enumerate(zip(pages, sizes))]
        assert aio.read_many(fd, reqs) == []
        for i, (p, s) in enumerate(zip(pages, sizes)):
            assert bytes(out[i * 8192:i * 8192 + s * 4096].numpy()) == data[p * 4096:(p + s) * 4096]


@needs_aio
def test_a_read_past_the_end_comes_back_short_and_a_bad_descriptor_raises(direct_file):
    fd, data = direct_file
    out = aligned_empty((8192,), torch.uint8)
    # the second request starts at the file's last page: half of it is there
    assert aio.read_many(fd, [(out.data_ptr(), 4096, 0), (out.data_ptr() + 4096, 8192 - 4096, len(data) - 4096)]) \
        == []
    short = aio.read_many(fd, [(out.data_ptr(), 8192, len(data) - 4096), (out.data_ptr(), 4096, 0)])
    assert short == [(0, 4096)]
    with pytest.raises(OSError):
        aio.read_many(10 ** 6, [(out.data_ptr(), 4096, 0), (out.data_ptr() + 4096, 4096, 4096)])


@needs_aio
def test_each_thread_reads_through_its_own_context(direct_file):
    fd, data = direct_file
    errors = []

    def reader(k):
        try:
            out = aligned_empty((3 * 4096,), torch.uint8)
            reqs = [(out.data_ptr() + i * 4096, 4096, (k * 3 + i) * 4096) for i in range(3)]
            for _ in range(50):
                assert aio.read_many(fd, reqs) == []
                assert bytes(out.numpy()) == data[k * 3 * 4096:(k + 1) * 3 * 4096]
        except Exception as e:  # reported to the test's thread
            errors.append(e)
    threads = [threading.Thread(target=reader, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


@pytest.mark.parametrize("native", [True, False], ids=["aio", "preadv"])
def test_read_ranges_gives_the_same_bytes_through_aio_or_one_read_at_a_time(native, monkeypatch):
    if native and not LINUX:
        pytest.skip("native AIO is Linux's (x86_64, aarch64)")
    if not native:
        monkeypatch.setattr(aio, "available", lambda: False)
    d = Path(tempfile.mkdtemp(prefix="fgsp-aio-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None))
    f = DiskFile(d / "k.bin", num_slots=40, slot_bytes=4096 * 3, direct=True, packed=True)
    try:
        if f.direct_mode != "o_direct":
            pytest.skip("this filesystem refuses O_DIRECT: read_ranges reads one request at a time")
        slots = [torch.randint(0, 255, (4096 * 3,), dtype=torch.uint8) for _ in range(40)]
        for s, t in enumerate(slots):
            f.write(s, t)
        assert f.reads_in_flight() == native
        ranges = [(3, 2), (10, 1), (0, 1), (30, 5), (39, 1)]
        at, pos = [], 0
        for _, c in ranges:
            at.append(pos)
            pos += c * 4096 * 3
        out = aligned_empty((pos,), torch.uint8)
        assert f.read_ranges(ranges, out, at) == pos
        for (first, c), a in zip(ranges, at):
            assert torch.equal(out[a:a + c * 4096 * 3], torch.cat(slots[first:first + c]))
    finally:
        f.close()
        for p in d.iterdir():
            p.unlink()
        d.rmdir()
    assert disk.aio is aio


@needs_aio
def test_a_forked_child_reads_through_a_context_of_its_own(direct_file):
    fd, data = direct_file
    out = aligned_empty((8192,), torch.uint8)
    assert aio.read_many(fd, [(out.data_ptr(), 4096, 0), (out.data_ptr() + 4096, 4096, 4096)]) == []  # the parent's
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if its reads are right
        ok = aio.read_many(fd, [(out.data_ptr(), 4096, 8192), (out.data_ptr() + 4096, 4096, 12288)]) == [] and \
            bytes(out.numpy()) == data[8192:16384]
        os._exit(0 if ok else 1)
    assert os.waitpid(pid, 0)[1] == 0


@needs_aio
def test_batches_in_flight_at_once_are_each_reaped_by_their_own_wait(direct_file):
    """submit returns with the reads in flight; three batches at once, waited in another order
    (one from another thread), each holding exactly its own bytes; past 256 requests the rest come
    back from wait as unsent."""
    fd, data = direct_file
    outs = [aligned_empty((300 * 4096,), torch.uint8) for _ in range(3)]
    sizes = (3, 300, 1)
    flights = [aio.submit(fd, [(o.data_ptr() + i * 4096, 4096, ((k * 7 + i) % 256) * 4096) for i in range(n)], keep=o)
               for k, (o, n) in enumerate(zip(outs, sizes))]
    assert all(f is not None for f in flights)
    assert flights[2].wait() == []
    assert flights[1].wait() == [(i, 0) for i in range(256, 300)]  # not sent: the caller's to read
    got = []
    th = threading.Thread(target=lambda: got.append(flights[0].wait()))
    th.start()
    th.join()
    assert got == [[]]
    for k, (o, n) in enumerate(zip(outs, sizes)):
        for i in range(min(n, 256)):
            p = (k * 7 + i) % 256
            assert bytes(o[i * 4096:(i + 1) * 4096].numpy()) == data[p * 4096:(p + 1) * 4096]
    with pytest.raises(RuntimeError):
        flights[0].wait()  # reaped once only


@needs_aio
def test_reads_dropped_unreaped_are_reaped_before_their_memory_goes(direct_file):
    fd, data = direct_file
    out = aligned_empty((2 * 4096,), torch.uint8)
    f = aio.submit(fd, [(out.data_ptr(), 4096, 0), (out.data_ptr() + 4096, 4096, 4096)], keep=out)
    ctx = f._ctx
    del f  # an error between submit and wait: __del__ waits them out and frees the context for the next
    assert ctx in aio._idle
    assert bytes(out.numpy()) == data[:8192]


def test_read_ranges_later_waits_for_the_same_bytes_or_says_none_without_o_direct(tmp_path):
    d = Path(tempfile.mkdtemp(prefix="fgsp-aio-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None))
    files = [DiskFile(d / "k.bin", num_slots=8, slot_bytes=4096 * 2, direct=True, packed=True),
             DiskFile(tmp_path / "b.bin", num_slots=8, slot_bytes=4096 * 2, direct=False, packed=True)]
    try:
        for f in files:
            slots = [torch.randint(0, 255, (8192,), dtype=torch.uint8) for _ in range(8)]
            for s, t in enumerate(slots):
                f.write(s, t)
            out = aligned_empty((3 * 8192,), torch.uint8)
            pending = f.read_ranges([(5, 1), (1, 2)], out, [0, 8192], later=True)
            if not f.reads_in_flight():  # buffered (or no native AIO): nothing can be in flight
                assert pending is None
                continue
            assert pending.wait() == 3 * 8192
            assert torch.equal(out, torch.cat([slots[5], slots[1], slots[2]]))
    finally:
        for f in files:
            f.close()
        d.rmdir()
