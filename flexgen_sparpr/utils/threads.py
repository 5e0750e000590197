"""Intra-op thread scopes: a stretch of many small CPU operations can run faster on one thread
than split across torch's pool (each split op pays a fork and a join that cost more than its
share of the work)."""
from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def intra_op_threads(n: int, device: torch.device | str):
    """torch's intra-op threads set to n inside the block, for a CPU device only (a GPU's kernels
    do not use them); n = 0 or a count at or above the current one leaves the setting alone. The
    previous count comes back however the block ends; the block gets it (`as before`), for
    threads_back."""
    before = torch.get_num_threads()
    if torch.device(device).type != "cpu" or n <= 0 or n >= before:
        yield before
        return
    torch.set_num_threads(n)
    try:
        yield before
    finally:
        torch.set_num_threads(before)


@contextmanager
def threads_back(n: int | None, device: torch.device | str):
    """Inside an intra_op_threads block, torch's count set back to n (the count outside it) for a
    stretch that does split well, e.g. one large fused kernel; None, or a device not the CPU,
    leaves the setting alone. The block's own count comes back however the stretch ends."""
    now = torch.get_num_threads()
    if n is None or torch.device(device).type != "cpu" or n == now:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(now)
