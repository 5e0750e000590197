"""--policy auto's placement search (runtime/placement.py): memory caps, monotonicity, ties."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from flexgen_sparpr.models.spec import opt_spec
from flexgen_sparpr.runtime.hardware import GiB, load_hardware
from flexgen_sparpr.runtime.placement import NoPlacementFits, Workload, choose

from tests.runtime.test_hardware import gpu_box

HW_DIR = Path(__file__).parents[2] / "configs" / "hardware"
OPT67 = Workload(opt_spec("opt-6.7b"), prompt_len=512, gen_len=32, batch_size=4)


def test_8gb_gpu_never_holds_all_of_opt_6_7b():
    plan = choose(OPT67, load_hardware(HW_DIR / "rtx3070ti-laptop-8gb.yaml"))
    assert plan.percent[0] < 100 and plan.percent[0] + plan.percent[1] <= 100
    assert plan.memory["compute"] <= 7.5 * GiB
    assert plan.gpu_batch_size * plan.num_gpu_batches == 4


def test_a100_keeps_everything_on_the_gpu():
    plan = choose(OPT67, load_hardware(HW_DIR / "a100-80gb.yaml"))
    assert plan.percent == (100, 0, 100, 0, 100, 0)
    assert (plan.gpu_batch_size, plan.num_gpu_batches) == (4, 1)
    assert plan.bottleneck == "compute"


def test_fp32_on_a_20gib_cpu_box_spills_weights_to_disk():
    hw = gpu_box(compute="cpu", h2d_bw=0.0, d2h_bw=0.0, h2d_pageable_bw=0.0, d2h_pageable_bw=0.0,
                 compute_memory=20 * GiB, cpu_memory=20 * GiB)
    plan = choose(dataclasses.replace(OPT67, dtype="float32"), hw)  # 25 GiB of fp32 weights
    assert plan.percent[0] < 100 and plan.percent[1] == 0 and plan.percent[3] == 0  # no separate cpu tier
    assert plan.memory["disk"] > 0
    half = choose(dataclasses.replace(OPT67, dtype="bfloat16"), hw)  # 12.4 GiB: fits
    assert half.percent[0] == 100 and half.memory["disk"] == 0


@pytest.mark.parametrize("host_gib", [16, 64])
def test_more_gpu_memory_never_predicts_slower(host_gib):
    times = [choose(OPT67, gpu_box(compute_memory=g * GiB, cpu_memory=host_gib * GiB)).total_s
             for g in (2, 4, 6, 8, 12, 16, 24, 40)]
    assert all(a >= b for a, b in zip(times, times[1:]))
    assert times[0] > times[-1]


def test_faster_link_never_predicts_slower():
    slow = choose(OPT67, gpu_box(h2d_bw=4e9, d2h_bw=4e9))
    fast = choose(OPT67, gpu_box(h2d_bw=24e9, d2h_bw=24e9))
    assert fast.total_s <= slow.total_s


def test_plan_respects_every_tier():
    hw = gpu_box(compute_memory=6 * GiB, cpu_memory=8 * GiB, disk_free=40 * GiB)
    plan = choose(dataclasses.replace(OPT67, prompt_len=1920, gen_len=128), hw)
    assert plan.memory["compute"] <= hw.compute_memory
    assert plan.memory["cpu"] <= hw.cpu_memory
    assert 0 < plan.memory["disk"] <= hw.disk_free
    assert sum(plan.percent[:2]) < 100  # 6 + 8 GiB cannot hold 12.4 GiB of weights and the cache


def test_nothing_fits_says_so():
    with pytest.raises(NoPlacementFits, match="fits"):
        choose(OPT67, gpu_box(compute_memory=0.5 * GiB, cpu_memory=2 * GiB, disk_free=1 * GiB))


def test_overlap_off_sums_the_resources():
    hw = gpu_box()
    on = choose(OPT67, hw)
    off = choose(dataclasses.replace(OPT67, overlap=False), hw)
    assert off.total_s > on.total_s


def test_grid_step_is_checked():
    with pytest.raises(ValueError, match="divide 100"):
        choose(OPT67, gpu_box(), step=7)


@pytest.mark.parametrize("path", sorted((HW_DIR.parent / "policies").glob("opt-6.7b-*.yaml")), ids=lambda p: p.stem)
def test_shipped_policies_are_what_auto_picks(path):
    """The policy files say their percents come from --policy auto: keep them in step with the model."""
    from flexgen_sparpr.cli.parser import build_parser
    from flexgen_sparpr.config.options import resolve, workload_for

    run, pol, eng = resolve(build_parser().parse_args(["--config", str(path)]))
    hw = run.hardware
    dtype = eng.dtype if eng.dtype != "auto" else ("float16" if hw.is_cuda else "float32")
    plan = choose(workload_for(opt_spec("opt-6.7b"), run.prompt_len, run.gen_len, pol, eng, dtype), hw)
    assert plan.percent == run.percent
    assert (plan.gpu_batch_size, plan.num_gpu_batches) == (pol.gpu_batch_size, pol.num_gpu_batches)


def test_what_the_kv_policy_keeps_on_the_device_is_counted():
    """SparPR's summaries (and DKV's exact rows) sit on the compute device wherever the cache
    lives: the plan's device memory grows by exactly that share of the raw K+V."""
    hw = load_hardware(HW_DIR / "a100-80gb.yaml")
    wl = OPT67
    plain, with_share = choose(wl, hw), choose(dataclasses.replace(wl, resident_share=0.125), hw)
    assert plain.percent == with_share.percent
    s = wl.spec
    raw = wl.batch_size * (wl.prompt_len + wl.gen_len) * 2 * s.kv_dim * 2 * s.num_layers  # fp16 K+V
    assert with_share.memory["compute"] - plain.memory["compute"] == pytest.approx(0.125 * raw)
    with pytest.raises(ValueError, match="resident_share"):
        dataclasses.replace(wl, resident_share=-1)


def test_what_the_kv_policy_keeps_in_host_memory_is_counted_there():
    """SparPR's summaries with --summaries-on cpu: host memory grows by their share, the device's not."""
    from flexgen_sparpr.runtime.placement import tier_use
    wl = OPT67
    s = wl.spec
    raw = wl.batch_size * wl.kv_tokens * 2 * s.kv_dim * 2 * s.num_layers  # fp16 K+V
    args = (True, 0.5, 0.3, 0.0, 0.9, wl.batch_size, False)
    plain, host = tier_use(wl, *args), tier_use(dataclasses.replace(wl, host_share=0.125), *args)
    assert host["cpu"]["working"] - plain["cpu"]["working"] == pytest.approx(0.125 * raw)
    assert host["compute"] == plain["compute"]
    with pytest.raises(ValueError, match="host_share"):
        dataclasses.replace(wl, host_share=-1)


def test_resident_share_of_each_kv_policy():
    from flexgen_sparpr.cli.parser import build_parser
    from flexgen_sparpr.config.options import resolve

    def share(*argv, dtype_bytes=2):
        eng = resolve(build_parser().parse_args(list(argv)))[2]
        return eng.make_kv_policy().resident_share(eng.block_size, dtype_bytes, eng.make_cold_codec())
    assert share("--kv-policy", "dense") == 0.0
    assert share("--kv-policy", "sparpr") == 1 / 16  # D / 2 directions of every key in 4 bits (fp16 cache)
    assert share("--kv-policy", "sparpr", dtype_bytes=4) == 1 / 32
    assert share("--kv-policy", "sparpr", "--cold-codec", "dkv") == 1 / 16 + 16 / 256
    mean = ("--kv-policy", "sparpr", "--summary", "mean")
    assert share(*mean) == 1 / 8  # a mean key per 4 tokens, K only
    assert share(*mean, "--summary-tokens", "8") == 1 / 16
    assert share(*mean, "--summary-tokens", "0") == 1 / 32  # one per 16-token block (the default)
    assert share("--kv-policy", "sparpr", "--summaries-on", "cpu") == 0.0  # auto: the means, on the host
    assert share("--kv-policy", "sparpr", "--summary-rank", "0.1875") == 3 / 128
    assert share("--kv-policy", "sparpr", "--summary-rank", "0.25") == 1 / 32
    assert share("--kv-policy", "quest") == 4 / (16 * 2)  # float32 min and max keys of a 16-token block (the default)


def test_reading_less_of_the_cache_never_predicts_slower():
    """kv_read_share (a sparse policy's keep): a decode step reads and attends that share of the
    cache, so the best plan is never slower, and on the 8 GB laptop strictly faster."""
    hw = load_hardware(HW_DIR / "rtx3070ti-laptop-8gb.yaml")
    wl = dataclasses.replace(OPT67, prompt_len=1920, gen_len=128)
    times = [choose(dataclasses.replace(wl, kv_read_share=k), hw).total_s for k in (1.0, 0.5, 0.25, 0.1)]
    assert all(a >= b for a, b in zip(times, times[1:])) and times[0] > times[-1]
    with pytest.raises(ValueError, match="kv_read_share"):
        dataclasses.replace(wl, kv_read_share=0)
