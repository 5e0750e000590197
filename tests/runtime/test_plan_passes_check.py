"""`--policy auto` never picks a placement its own memory check refuses: one model of the bytes
per tier (placement.tier_use, placement.within) answers both, over a grid of OPT sizes, machines
(the shipped hardware files and CPU-only boxes of several sizes), contexts and KV block sizes;
and where nothing fits, the check finds nothing either. In process, nothing loaded."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from flexgen_sparpr.errors import CapacityError, NoPlacementFits
from flexgen_sparpr.models.spec import opt_spec
from flexgen_sparpr.runtime.capacity import Capacity, check_placement, planning_hardware, suggest
from flexgen_sparpr.runtime.hardware import GiB, load_hardware
from flexgen_sparpr.runtime.placement import Workload, choose

HW_DIR = Path(__file__).resolve().parents[2] / "configs" / "hardware"
MODELS = ("opt-125m", "opt-1.3b", "opt-6.7b", "opt-13b", "opt-30b")
CONTEXTS = ((64, 8), (512, 32), (1920, 128))


def _machines():
    files = [(p.stem, load_hardware(p)) for p in sorted(HW_DIR.glob("*.yaml"))]
    cpu = load_hardware(HW_DIR / "cpu-only.yaml")
    # CPU-only boxes like this project's 23 GB VM (20.5 GiB usable when 22.7 are free), smaller and larger
    boxes = [(f"cpu-{g}g", dataclasses.replace(cpu, compute_memory=g * GiB, cpu_memory=g * GiB))
             for g in (6, 12, 22.7, 64)]
    return files + boxes


MACHINES = _machines()


def _capacity(hw) -> Capacity:
    return Capacity(hw.is_cuda, hw.compute_memory, hw.cpu_memory, hw.disk_free, "/offload")


@pytest.mark.parametrize("name,hw", MACHINES, ids=[m[0] for m in MACHINES])
def test_every_plan_passes_the_check(name, hw):
    dtype = "float16" if hw.is_cuda else "float32"
    cap = _capacity(hw)
    planned = refused = 0
    for model in MODELS:
        for (p, g) in CONTEXTS:
            for block in (16, 256):
                wl = Workload(opt_spec(model), p, g, batch_size=4, dtype=dtype, block_size=block)
                try:
                    plan = choose(wl, hw, step=10 if hw.is_cuda else 5)
                except NoPlacementFits:
                    refused += 1
                    for gbs in (1, 2, 4):  # the check has nothing to offer either
                        assert suggest(wl, gbs, False, cap) is None and suggest(wl, gbs, True, cap) is None
                    continue
                planned += 1
                need = check_placement(wl, plan.percent, plan.gpu_batch_size, cap)  # raises if refused
                assert need == pytest.approx(plan.memory)
    assert planned > 0  # the grid is not all refusals (every machine runs OPT-125M)


def test_the_plan_is_made_within_what_is_free_now():
    """A hardware file recorded with more free memory than this machine has now plans within now."""
    hw = load_hardware(HW_DIR / "cpu-only.yaml")  # 20.18 GiB free when it was measured
    now = Capacity(False, 12 * GiB, 12 * GiB, hw.disk_free, "/offload")
    wl = Workload(opt_spec("opt-6.7b"), 512, 32, batch_size=4, dtype="float32", block_size=16)
    stale = choose(wl, hw)
    with pytest.raises(CapacityError, match="does not fit"):  # planned for the file's 20 GiB
        check_placement(wl, stale.percent, stale.gpu_batch_size, now)
    plan = choose(wl, planning_hardware(hw, now))
    check_placement(wl, plan.percent, plan.gpu_batch_size, now)
    # a file for another kind of machine plans for that machine
    a100 = load_hardware(HW_DIR / "a100-80gb.yaml")
    assert planning_hardware(a100, now) == a100

