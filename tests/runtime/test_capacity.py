"""An explicit --percent against this machine's free memory and disk (runtime/capacity.py): the
same per-tier bytes --policy auto plans with, refused past a tier's usable capacity with the
numbers and a placement that fits."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from flexgen_sparpr.errors import CapacityError
from flexgen_sparpr.runtime.capacity import Capacity, check_placement, host_available, live_capacity, suggest
from flexgen_sparpr.runtime.hardware import GiB, load_hardware
from flexgen_sparpr.runtime.placement import HOST_MARGIN, Workload, choose
from flexgen_sparpr.models.spec import opt_spec

HW_DIR = Path(__file__).resolve().parents[2] / "configs" / "hardware"
OPT13 = Workload(opt_spec("opt-13b"), prompt_len=512, gen_len=32, batch_size=4, dtype="float32", block_size=64)


def cpu_box(host_gib: float, disk_gib: float = 1000.0) -> Capacity:
    return Capacity(False, host_gib * GiB, host_gib * GiB, disk_gib * GiB, "/offload")


def test_weights_in_memory_are_refused_with_the_numbers_and_a_fitting_percent():
    weights = opt_spec("opt-13b").num_params() * 4  # counted here, not by the code under test
    with pytest.raises(CapacityError) as e:
        check_placement(OPT13, (100, 0, 100, 0, 100, 0), 4, cpu_box(20))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--percent 100 0 100 0 100 0 does not fit: host memory")
    assert f"weights {weights / GiB:.1f}" in msg and "20.0 GiB is free (18.0 usable)" in msg
    pct = tuple(int(x) for x in msg.split("try --percent ")[1].split(" (")[0].split())
    need = check_placement(OPT13, pct, 4, cpu_box(20))  # the suggestion itself fits
    assert need["compute"] <= 20 * GiB * (1 - HOST_MARGIN) and pct[1] == pct[3] == 0  # cpu-only: no CPU share
    better = (min(pct[0] + 5, 100), 0, pct[2], 0, 100, 0)
    if better != pct:  # and it keeps as much on the compute tier as fits (one grid step more does not)
        with pytest.raises(CapacityError):
            check_placement(OPT13, better, 4, cpu_box(20))


def test_the_limit_is_the_tier_capacity_less_the_margin():
    need = check_placement(OPT13, (10, 0, 100, 0, 100, 0), 4, cpu_box(1000))["compute"]
    just = need / (1 - HOST_MARGIN) / GiB
    check_placement(OPT13, (10, 0, 100, 0, 100, 0), 4, cpu_box(just * 1.001))
    with pytest.raises(CapacityError):
        check_placement(OPT13, (10, 0, 100, 0, 100, 0), 4, cpu_box(just * 0.999))


def test_a_full_disk_is_named():
    with pytest.raises(CapacityError, match="disk in /offload would need .* but 1.0 GiB is free"):
        check_placement(OPT13, (0, 0, 100, 0, 100, 0), 4, cpu_box(1000, disk_gib=1))


def test_nothing_fits_says_so():
    with pytest.raises(CapacityError, match="no placement fits this machine"):
        check_placement(OPT13, (100, 0, 100, 0, 100, 0), 4, cpu_box(2, disk_gib=2))
    assert suggest(OPT13, 4, False, cpu_box(2, disk_gib=2)) is None


@pytest.mark.parametrize("name", ["rtx3070ti-laptop-8gb", "t4-flexgen", "a100-80gb"])
def test_every_plan_of_policy_auto_passes_the_explicit_check(name):
    """One arithmetic: what --policy auto chooses for a hardware file, the explicit check accepts
    on a machine with that file's capacities (and a GPU tier over them is refused)."""
    hw = load_hardware(HW_DIR / f"{name}.yaml")
    wl = Workload(opt_spec("opt-6.7b"), prompt_len=1024, gen_len=32, batch_size=4)
    plan = choose(wl, hw)
    cap = Capacity(True, hw.compute_memory, hw.cpu_memory, hw.disk_free, "/offload")
    need = check_placement(wl, plan.percent, plan.gpu_batch_size, cap)
    assert need == pytest.approx(plan.memory)
    with pytest.raises(CapacityError, match="GPU memory would need"):
        check_placement(wl, (100, 0, 100, 0, 100, 0), plan.gpu_batch_size, dataclasses.replace(
            cap, compute_memory=plan.memory["compute"] / 2))


def test_blocks_are_allocated_whole():
    """--block-size 4096 with a 544-token run allocates 4096 tokens per sequence and layer."""
    small = dataclasses.replace(OPT13, block_size=64)
    big = dataclasses.replace(OPT13, block_size=4096)
    a = check_placement(small, (0, 0, 100, 0, 100, 0), 4, cpu_box(1000))
    b = check_placement(big, (0, 0, 100, 0, 100, 0), 4, cpu_box(1000))
    s = OPT13.spec
    kv_tok = 2 * 4 * s.num_layers * s.kv_dim * 4  # K+V, batch 4, every layer, float32
    open_blocks = s.num_layers * 4 * (4096 - 64) * 2 * s.kv_dim * 4
    assert b["compute"] - a["compute"] >= (4096 - 576) * kv_tok + open_blocks


def test_live_capacity_reads_this_machine(tmp_path):
    import psutil
    import shutil
    cap = live_capacity(torch.device("cpu"), tmp_path / "not" / "made")
    assert not cap.is_cuda and cap.disk_dir == str(tmp_path)
    assert abs(cap.cpu_memory - psutil.virtual_memory().available) < 2 * GiB
    assert abs(cap.disk_free - shutil.disk_usage(tmp_path).free) < 1 * GiB
    assert not (tmp_path / "not").exists()
    assert 0 < host_available() <= psutil.virtual_memory().total
