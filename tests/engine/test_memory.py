"""Peak memory as reported (engine/memory.py) against independent measures: a known allocation
made inside the window, the process's RSS before it (psutil) and the kernel's peak (ru_maxrss),
on both of its paths (the kernel's high-water mark, and the sampler where that cannot be reset),
and nested windows. A report that returned a constant, or missed the peak, fails here."""
from __future__ import annotations

import mmap
import resource
import time

import pytest
import torch

psutil = pytest.importorskip("psutil", reason="psutil is this file's independent RSS measure (not installed)")

from flexgen_sparpr.engine import memory  # noqa: E402
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


@pytest.fixture(params=["high-water", "sampled"])
def path(request, monkeypatch):
    """Each test on both ways of measuring: the sampled one where the mark cannot be reset."""
    if request.param == "sampled":
        monkeypatch.setattr(memory, "reset_rss_high_water", lambda: False)
    elif not memory.reset_rss_high_water():
        pytest.skip("this OS keeps no resettable RSS high-water mark (/proc/self/clear_refs): the sampled path serves")
    return request.param


def test_peak_rss_sees_an_allocation_that_is_gone_by_the_end(path):
    before = psutil.Process().memory_info().rss
    with PeakMemory(torch.device("cpu")) as mem:
        _hold(256 * MB, 0.3)
    assert mem.high_water == (path == "high-water")
    assert (mem._thread is None) == (path == "high-water")  # the high-water path wakes no thread
    rep = mem.report()
    since_reset = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the lifetime's, or since a reset
    slack = 8 * MB  # psutil's RSS and the kernel's high-water mark count a few pages differently
    assert rep["host_rss_peak_bytes"] >= before + 0.9 * 256 * MB  # the allocation, seen while it lived
    assert rep["host_rss_peak_bytes"] <= since_reset + slack  # no reading exceeds the kernel's own peak
    assert rep["host_rss_lifetime_peak_bytes"] >= max(since_reset, rep["host_rss_peak_bytes"] - slack)


def test_an_enclosing_window_keeps_its_peak_across_an_inner_reset(path):
    base = psutil.Process().memory_info().rss
    with PeakMemory(torch.device("cpu")) as outer:
        _hold(320 * MB, 0.1)  # gone before the inner window resets the mark
        with PeakMemory(torch.device("cpu")) as inner:
            _hold(32 * MB, 0.1)
    o, i = outer.report()["host_rss_peak_bytes"], inner.report()["host_rss_peak_bytes"]
    assert o >= base + 0.9 * 320 * MB
    assert i < base + 0.9 * 320 * MB - 64 * MB  # the inner window's own peak, not the outer's
    assert outer.report()["host_rss_lifetime_peak_bytes"] >= o - 8 * MB


def test_two_windows_report_their_own_peaks(path):
    with PeakMemory(torch.device("cpu")) as small:
        _hold(32 * MB, 0.1)
    with PeakMemory(torch.device("cpu")) as big:
        _hold(384 * MB, 0.3)
    s, b = small.report()["host_rss_peak_bytes"], big.report()["host_rss_peak_bytes"]
    base = psutil.Process().memory_info().rss
    assert b - base >= 0.9 * 384 * MB - 64 * MB and b - s >= 0.9 * (384 - 32) * MB - 64 * MB
