"""storage/host_memory.py on the CPU, through tests/stream_double.py's stand-in for CUDA's
host-memory calls: CPU-tier arenas are never pinned, CPU-homed weights are pinned once at their
exact size, strided copies go through the pinned staging ring (no pageable temporary), pinned
memory stays the ring whatever the number of copies, and a refused pin still copies right."""
from __future__ import annotations

import torch

from flexgen_sparpr.storage.host_memory import HostMemory
from flexgen_sparpr.storage.streams import Streams
from tests.stream_double import StreamDouble


def host(cuda, **kw) -> HostMemory:
    return HostMemory(Streams(torch.device("cpu"), cuda), **kw)


def test_arenas_are_pageable_and_weights_pinned_once_at_their_size():
    cuda = StreamDouble()
    hm = host(cuda)
    arenas = [hm.arena((2, 3, 4 + i, 8), torch.float32) for i in range(5)]  # one per generation
    assert cuda.pin_calls == 0 and not any(cuda.is_pinned(a) for a in arenas)
    w = torch.randn(1000)
    pinned = hm.pin(w)
    assert cuda.is_pinned(pinned) and torch.equal(pinned, w)
    assert hm.pinned_bytes == 4096  # 4000 bytes, rounded to whole pages (not to a power of two)
    hm.close()
    assert cuda.pinned == set() and hm.pinned_bytes == 0


def test_strided_copies_go_through_the_pinned_ring_without_a_race():
    with StreamDouble() as cuda:
        hm = host(cuda, staging_bytes=256, staging_buffers=2)
        arena = hm.arena((2, 4, 3, 16, 8), torch.float32)  # arena: [planes, B, H, T, D]
        hm.to_host(arena, torch.randn(arena.shape))  # from compute memory, as a store job writes it
        out = torch.empty(2, 4, 3, 8, 8)
        for _ in range(5):
            for s in (0, 8):
                hm.to_compute(out, arena[:, :, :, s:s + 8])  # strided: pieces of <= 256 bytes through the ring
                assert torch.equal(out, arena[:, :, :, s:s + 8])
                back = torch.randn(out.shape)
                hm.to_host(arena[:, :, :, s:s + 8], back)
                assert torch.equal(arena[:, :, :, s:s + 8], back)
        assert cuda.pin_calls == 2 and hm.pinned_bytes == 2 * 4096  # the ring only, made once
        assert cuda.problems == []
        hm.close()


def test_a_refused_pin_leaves_memory_pageable_and_copies_right():
    with StreamDouble(refuse_pin=True) as cuda:
        hm = host(cuda, staging_bytes=256, staging_buffers=2)
        w = torch.randn(64, 3)[:, 1]  # strided
        kept = hm.pin(w)
        assert hm.refused == 1 and not cuda.is_pinned(kept) and kept.is_contiguous() and torch.equal(kept, w)
        out = hm.to_compute_new(w)
        assert torch.equal(out, w) and hm.pinned_bytes == 0
        assert cuda.problems == []
        hm.close()
