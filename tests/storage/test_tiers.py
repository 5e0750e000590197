"""Tiers: FlexGen's midpoint placement rule, KV block homes, CPU folding, link counters."""
from __future__ import annotations

import threading

import pytest
import torch

from flexgen_sparpr.storage.tiers import Devices, LinkCounters, Tier, block_homes, split_by_percent

C, P, D = Tier.COMPUTE, Tier.CPU, Tier.DISK


def flexgen_get_choice(sizes, percents):
    """FlexGen's own rule (flexgen/utils.py get_choice + init_weight_list), written out."""
    cum = [percents[0], percents[0] + percents[1], 100]
    total, acc, out = sum(sizes), 0, []
    for s in sizes:
        acc += s
        mid = (acc - s / 2) / total * 100
        out.append(next((t for t, c in zip((C, P, D), cum) if mid < c), D))
    return out


# --- split_by_percent ---------------------------------------------------------------------
@pytest.mark.parametrize("sizes, percents, expected", [
    ([1, 1, 1, 1], (50, 25, 25), [C, C, P, D]),  # midpoints 12.5, 37.5, 62.5, 87.5
    ([1, 1], (25, 75, 0), [P, P]),  # midpoint 25 is not < 25: the boundary belongs to the next tier
    ([1, 1], (25.001, 74.999, 0), [C, P]),
    ([10, 1, 1], (50, 50, 0), [C, P, P]),  # the big tensor's midpoint (5/12) decides, not its start
    ([1, 1, 10], (50, 0, 50), [C, C, D]),
    ([3, 3, 3], (100, 0, 0), [C, C, C]),
    ([3, 3, 3], (0, 100, 0), [P, P, P]),
    ([3, 3, 3], (0, 0, 100), [D, D, D]),
    ([5], (40, 20, 40), [P]),  # one tensor: midpoint 50 lies in the CPU range [40, 60)
])
def test_split_by_percent_midpoint_rule(sizes, percents, expected):
    assert split_by_percent(sizes, percents) == expected


def test_split_by_percent_matches_flexgen_rule_on_random_layers():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 12, (1,), generator=g))
        sizes = torch.randint(1, 1000, (n,), generator=g).tolist()
        a, b = sorted(torch.randint(0, 101, (2,), generator=g).tolist())
        percents = (a, b - a, 100 - b)
        assert split_by_percent(sizes, percents) == flexgen_get_choice(sizes, percents)


def test_split_by_percent_empty_and_zero_sizes():
    assert split_by_percent([], (30, 30, 40)) == []
    assert split_by_percent([0, 0], (30, 30, 40)) == [C, C]  # no bytes: nothing to move


# --- block_homes --------------------------------------------------------------------------
@pytest.mark.parametrize("n, percents", [
    (10, (30, 30, 40)), (7, (100, 0, 0)), (7, (0, 100, 0)), (7, (0, 0, 100)), (9, (50, 0, 50)),
    (64, (20, 30, 50)), (3, (34, 33, 33)), (1, (0, 0, 100)), (1, (100, 0, 0)),
])
def test_block_homes_recency_order_and_proportions(n, percents):
    homes = block_homes(n, percents)
    assert len(homes) == n
    # recency order: oldest blocks on disk, then CPU, then the newest on compute
    rank = {D: 0, P: 1, C: 2}
    assert [rank[h] for h in homes] == sorted(rank[h] for h in homes)
    for tier, pct in zip((C, P, D), percents):
        assert abs(homes.count(tier) - n * pct / 100) <= 1, (tier, homes)


def test_block_homes_examples():
    assert block_homes(10, (30, 30, 40)) == [D] * 4 + [P] * 3 + [C] * 3
    assert block_homes(4, (50, 0, 50)) == [D, D, C, C]
    assert block_homes(0, (30, 30, 40)) == []


@pytest.mark.parametrize("n", [1, 5, 9])
def test_block_homes_zero_percent_tier_gets_no_block(n):
    homes = block_homes(n, (0, 50, 50))
    assert C not in homes  # FlexGen: len_gpu = int(len * cache_gpu_percent / 100) = 0


# --- Devices ------------------------------------------------------------------------------
def test_devices_fold_cpu_into_compute_on_a_cpu_machine():
    d = Devices(torch.device("cpu"))
    assert not d.is_cuda
    assert d.effective(Tier.CPU) == Tier.COMPUTE
    assert d.effective(Tier.COMPUTE) == Tier.COMPUTE
    assert d.effective(Tier.DISK) == Tier.DISK
    assert d.device_of(Tier.CPU) == torch.device("cpu")
    assert d.device_of(Tier.DISK) == torch.device("cpu")
    assert not d.empty_host((4,), torch.float32).is_pinned()  # no CUDA link, no pinning


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_devices_keep_cpu_tier_on_cuda():
    d = Devices(torch.device("cuda"))
    assert d.effective(Tier.CPU) == Tier.CPU
    assert d.device_of(Tier.CPU) == torch.device("cpu")
    assert d.empty_host((4,), torch.float32).is_pinned()


# --- LinkCounters -------------------------------------------------------------------------
def test_link_counters_add_snapshot_reset_total():
    c = LinkCounters()
    c.add("disk", "cpu", 10)
    c.add("disk", "cpu", 5)
    c.add("cpu", "compute", 7)
    snap = c.snapshot()
    assert snap == {"disk->cpu": 15, "cpu->compute": 7}
    c.add("disk", "cpu", 1)
    assert snap["disk->cpu"] == 15  # a snapshot is a copy
    assert c.total() == 23
    c.reset()
    assert c.snapshot() == {} and c.total() == 0


def test_link_counters_thread_safe():
    c = LinkCounters()

    def work():
        for _ in range(2000):
            c.add("a", "b", 1)

    ts = [threading.Thread(target=work) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert c.snapshot() == {"a->b": 8000}


def test_link_counters_tag_counts_this_threads_bytes_only():
    import threading
    from flexgen_sparpr.storage.tiers import LinkCounters
    c = LinkCounters()
    c.add("disk", "cpu", 5)
    with c.tag("serial"):
        c.add("disk", "cpu", 7)
        t = threading.Thread(target=c.add, args=("disk", "cpu", 100))  # another thread: untagged
        t.start()
        t.join()
    c.add("cpu", "disk", 3)
    assert c.snapshot() == {"disk->cpu": 112, "cpu->disk": 3}
    assert c.tagged("serial") == {"disk->cpu": 7} and c.tagged("other") == {}
    c.reset()
    assert c.tagged("serial") == {}
