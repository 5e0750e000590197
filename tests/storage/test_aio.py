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
