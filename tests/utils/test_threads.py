"""intra_op_threads: one thread inside the block on a CPU, the count restored however it ends;
threads_back: the count outside such a block, for one stretch inside it."""
from __future__ import annotations

import pytest
import torch

from flexgen_sparpr.utils.threads import intra_op_threads, threads_back


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


def test_block_gets_the_count_outside_and_threads_back_restores_it(two_threads):
    with intra_op_threads(1, "cpu") as outside:
        assert outside == 2 and torch.get_num_threads() == 1
        with threads_back(outside, "cpu"):
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
        with pytest.raises(RuntimeError), threads_back(outside, "cpu"):
            raise RuntimeError("boom")
        assert torch.get_num_threads() == 1
        for n, device in ((None, "cpu"), (outside, "meta")):
            with threads_back(n, device):
                assert torch.get_num_threads() == 1
    with intra_op_threads(1, "meta") as outside:
        assert outside == 2 and torch.get_num_threads() == 2
