"""intra_op_threads: one thread inside the block on a CPU, the count restored however it ends."""
from __future__ import annotations

import pytest
import torch

from flexgen_sparpr.utils.threads import intra_op_threads


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_cpu_block_runs_on_n_threads_and_restores(two_threads):
    with intra_op_threads(1, "cpu"):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError), intra_op_threads(1, torch.device("cpu")):
        raise RuntimeError("boom")
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("n, device", [(0, "cpu"), (2, "cpu"), (8, "cpu"), (1, "cuda"), (1, "meta")])
def test_zero_more_or_not_cpu_leaves_the_setting(two_threads, n, device):
    with intra_op_threads(n, device):
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == 2
