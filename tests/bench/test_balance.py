"""bench/balance.py: the disk cap that gives this machine another machine's FLOP-per-byte balance."""
from __future__ import annotations

import dataclasses

import pytest

from flexgen_sparpr.bench.balance import balanced_read, kv_bytes_ratio, kv_link_Bps
from flexgen_sparpr.runtime.hardware import load_hardware
from tests.scripts.runner import REPO

LAPTOP = load_hardware(REPO / "configs/hardware/rtx3070ti-laptop-8gb.yaml")
HERE = load_hardware(REPO / "results/latency_hardware_this_machine.yaml")


def test_link_is_the_harmonic_mix_of_the_cache_homes():
    assert kv_link_Bps(LAPTOP, (0, 100, 0)) == pytest.approx(LAPTOP.h2d_bw)
    disk = 1 / (1 / LAPTOP.disk_read_bw + 1 / LAPTOP.h2d_bw)  # disk -> CPU -> device, one after the other
    assert kv_link_Bps(LAPTOP, (0, 0, 100)) == pytest.approx(disk)
    # 95 % CPU, 5 % disk: a byte costs .95 / h2d + .05 / disk-path
    assert kv_link_Bps(LAPTOP, (0, 95, 5)) == pytest.approx(1 / (0.95 / LAPTOP.h2d_bw + 0.05 / disk))
    assert kv_link_Bps(LAPTOP, (50, 50, 0)) == pytest.approx(LAPTOP.h2d_bw)  # the device's share crosses nothing
    assert kv_link_Bps(HERE, (0, 0, 100)) == pytest.approx(HERE.disk_read_bw)  # a CPU box: the disk read only
    with pytest.raises(ValueError):
        kv_link_Bps(LAPTOP, (100, 0, 0))


def test_balanced_cap_keeps_the_flop_per_byte_ratio():
    b = balanced_read(HERE, LAPTOP, (0, 95, 5), dtype_bytes_ratio=2.0)
    there = LAPTOP.compute_flops("float16") / kv_link_Bps(LAPTOP, (0, 95, 5))
    # with the KV twice the bytes here, twice the bandwidth keeps I/O time / compute time equal
    assert HERE.compute_flops("float32") / (b.read_Bps / 2) == pytest.approx(there)
    # by default the engine's own offloaded KV dtype: float16 on a CPU, as the laptop's
    assert kv_bytes_ratio() == 1.0
    assert balanced_read(HERE, LAPTOP, (0, 95, 5)).read_Bps == pytest.approx(b.read_Bps / 2)
    fast = dataclasses.replace(HERE, flops={"float32": 2 * HERE.compute_flops("float32")})
    assert balanced_read(fast, LAPTOP, (0, 95, 5), dtype_bytes_ratio=2.0).read_Bps == pytest.approx(2 * b.read_Bps)
    assert 50 < b.read_mbps < 500 and b.to_dict()["read_mbps"] == b.read_mbps
