"""Page-aligned host memory for O_DIRECT: the alignment, aligned tensors, byte views of tensors
and each thread's bounce buffer (storage/disk.py reads and writes through them)."""
from __future__ import annotations

import mmap
import threading

import numpy as np
import torch

ALIGN = 4096  # O_DIRECT needs offsets, lengths and buffers aligned to the block size


def round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def is_aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % ALIGN == 0 and t.nbytes % ALIGN == 0


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """Flat uint8 view [nbytes] of a contiguous tensor (any dtype, any device)."""
    return t.reshape(-1).view(torch.uint8)


def np_bytes(t: torch.Tensor) -> memoryview:
    """Writable memoryview over the bytes of a contiguous CPU tensor."""
    return memoryview(byte_view(t).numpy())


def aligned_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """Uninitialised CPU tensor whose data pointer is 4096-byte aligned (with O_DIRECT, reads into /
    writes from it skip the staging copy when its byte size is a multiple of 4096 too)."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip:skip + nbytes].view(dtype).view(shape)


class Staging(threading.local):
    """Per-thread page-aligned bounce buffer, grown on demand."""

    def get(self, n: int) -> torch.Tensor:
        buf = getattr(self, "buf", None)
        if buf is None or buf.numel() < n:
            # anonymous mmap: page aligned, kept alive by the view; outside inference mode (writes there)
            with torch.inference_mode(False):
                self.buf = torch.from_numpy(np.frombuffer(mmap.mmap(-1, round_up(n)), dtype=np.uint8))
        return self.buf[:n]


staging = Staging()
