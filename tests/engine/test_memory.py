"""Peak memory as reported (engine/memory.py) against independent measures: a known allocation
made inside the window, the process's RSS before it (psutil) and the kernel's lifetime peak
(ru_maxrss). A report that returned a constant, or missed the peak, fails here."""
from __future__ import annotations

import mmap
import resource
import time

import pytest
import torch

psutil = pytest.importorskip("psutil", reason="psutil is this file's independent RSS measure (not installed)")

from flexgen_sparpr.engine.memory import PeakMemory  # noqa: E402

MB = 1 << 20


def _hold(nbytes: int, seconds: float) -> None:
    # Fresh anonymous pages of our own: a torch.empty this large can be served from a free chunk
    # the allocator kept resident after earlier tests, so RSS would not grow (CI saw that once).
    region = mmap.mmap(-1, nbytes)
    t = torch.frombuffer(region, dtype=torch.uint8)  # t: [nbytes], a view of the mapping
    t.fill_(1)  # touch every page: untouched pages are not resident
    time.sleep(seconds)  # longer than the sampler's interval
    del t
    region.close()  # unmapped: the pages leave RSS


def test_peak_rss_sees_an_allocation_that_is_gone_by_the_end():
    before = psutil.Process().memory_info().rss
    with PeakMemory(torch.device("cpu")) as mem:
        _hold(256 * MB, 0.3)
    rep = mem.report()
    lifetime = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    slack = 8 * MB  # psutil's RSS and the kernel's high-water mark count a few pages differently
    assert rep["host_rss_peak_bytes"] >= before + 0.9 * 256 * MB  # the allocation, seen while it lived
    assert rep["host_rss_peak_bytes"] <= lifetime + slack  # no sample exceeds the kernel's own peak
    assert rep["host_rss_peak_bytes"] - slack <= rep["host_rss_lifetime_peak_bytes"] <= lifetime

def test_two_windows_report_their_own_peaks():
    with PeakMemory(torch.device("cpu")) as small:
        _hold(32 * MB, 0.1)
    with PeakMemory(torch.device("cpu")) as big:
        _hold(384 * MB, 0.3)
    s, b = small.report()["host_rss_peak_bytes"], big.report()["host_rss_peak_bytes"]
    base = psutil.Process().memory_info().rss
    assert b - base >= 0.9 * 384 * MB - 64 * MB and b - s >= 0.9 * (384 - 32) * MB - 64 * MB
