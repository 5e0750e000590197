"""Page-aligned host buffers (storage/aligned.py): from HUGE_MIN bytes on, aligned_empty maps its
buffer on its own 2 MiB-aligned map advised for transparent huge pages (an O_DIRECT read pins
fewer pages there), and a landing ring's buffer does at any size; usable in and out of inference
mode, and unmapped with its last view."""
import gc
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from flexgen_sparpr.engine.recovery import GatherRing
from flexgen_sparpr.storage import aio, aligned
from flexgen_sparpr.storage.aligned import HUGE_MIN, HUGE_PAGE, aligned_empty

LINUX = sys.platform.startswith("linux")
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapping(addr: int) -> tuple[int, int, int] | None:
    """(start, end, AnonHugePages kB) of this process's map holding addr, from /proc/self/smaps."""
    found = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            found = (lo, hi) if lo <= addr < hi else None
        elif found and line.startswith("AnonHugePages:"):
            return (*found, int(line.split()[1]))
    return None


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16, torch.float32])
def test_a_large_buffer_starts_on_a_huge_page_and_holds_what_is_written(dtype):
    n = (3 * HUGE_MIN) // torch.empty((), dtype=dtype).element_size() + 5  # not a whole number of pages
    for mode in (True, False):
        with torch.inference_mode(mode):
            t = aligned_empty((n,), dtype)
            assert t.shape == (n,) and t.dtype == dtype and not t.is_inference()
            if aligned._MADV_HUGEPAGE is not None:
                assert t.data_ptr() % HUGE_PAGE == 0
            t.copy_(torch.arange(n).to(dtype))  # written in either mode
            t[-1] = 7
        assert torch.equal(t[:100], torch.arange(100).to(dtype)) and t[-1].item() == 7


def test_a_small_buffer_stays_on_the_allocator_page_aligned():
    t = aligned_empty((HUGE_MIN // 2 - 1,), torch.uint8)
    assert t.data_ptr() % 4096 == 0 and t.numel() == HUGE_MIN // 2 - 1


@pytest.mark.skipif(not LINUX or not THP.exists() or "[never]" in THP.read_text(),
                    reason="needs Linux with transparent huge pages not set to never")
def test_the_buffer_is_backed_by_huge_pages_and_unmapped_when_dropped():
    t = aligned_empty((4 * HUGE_PAGE,), torch.uint8)
    t.fill_(1)  # touched: the kernel faults it in, in huge pages where it can
    addr = t.data_ptr()
    lo, hi, huge_kb = _mapping(addr)
    assert hi - lo >= 4 * HUGE_PAGE
    assert huge_kb > 0, "no huge page backs an advised, touched, 2 MiB-aligned 8 MiB buffer"
    del t
    gc.collect()
    got = _mapping(addr)
    assert got is None or got[:2] != (lo, hi), "the buffer's map outlived its tensor"


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16])
def test_a_landing_buffer_of_any_size_starts_on_a_huge_page(dtype):
    """The landing ring's buffers take O_DIRECT reads step after step: below HUGE_MIN too (2k tokens,
    half the KV on disk: under 1 MiB a layer) each read would pin 4 KiB pages one by one."""
    n = HUGE_MIN // 4 + 3
    t = aligned_empty((n,), dtype, huge_from=0)
    assert t.shape == (n,) and t.dtype == dtype and t.data_ptr() % 4096 == 0
    if aligned._MADV_HUGEPAGE is not None:
        assert t.data_ptr() % HUGE_PAGE == 0
    t.copy_(torch.arange(n).to(dtype))
    assert torch.equal(t[:100], torch.arange(100).to(dtype))
    ring = GatherRing(2, aligned=True)
    buf = ring.take((2, 5, 7), dtype, torch.device("cpu"))
    assert buf.shape == (2, 5, 7) and buf.data_ptr() % 4096 == 0
    if aligned._MADV_HUGEPAGE is not None:
        assert buf.data_ptr() % HUGE_PAGE == 0


@pytest.mark.skipif(not LINUX or not aio.available(), reason="native AIO is Linux's")
def test_an_o_direct_read_lands_in_a_huge_buffer():
    d = Path(tempfile.mkdtemp(prefix="fgsp-huge-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None))
    p = d / "f.bin"
    data = os.urandom(3 * HUGE_MIN)
    p.write_bytes(data)
    try:
        try:
            fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            pytest.skip("this filesystem refuses O_DIRECT")
        try:
            out = aligned_empty((len(data),), torch.uint8)
            assert aio.read_many(fd, [(out.data_ptr(), len(data), 0)]) == []
            assert bytes(out.numpy()) == data
        finally:
            os.close(fd)
    finally:
        p.unlink()
        d.rmdir()
