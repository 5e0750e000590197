"""Pipeline stages' maths (runtime/stages.py) and the time model over stages
(runtime/stage_time.py): the split, the pipeline step, --policy auto with a world size."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from flexgen_sparpr.errors import ConfigError
from flexgen_sparpr.models.spec import opt_spec
from flexgen_sparpr.runtime.hardware import load_hardware
from flexgen_sparpr.runtime.placement import Workload, candidates
from flexgen_sparpr.runtime.stage_time import predict_pipeline, stage_trace
from flexgen_sparpr.runtime.stages import (StageSplit, activation_bytes, choose_stages, even_by_bytes,
                                           parse_stage_layers, pipeline_step_s, stage_micro_s, stage_params)
from flexgen_sparpr.runtime.timemodel import Calibration, predict
from flexgen_sparpr.runtime.trace import Placement, analytic_trace

HW_DIR = Path(__file__).parents[2] / "configs" / "hardware"
OPT = opt_spec("opt-125m")  # 12 layers


def test_even_split_by_bytes():
    s = even_by_bytes(OPT, 2)
    assert sum(s.counts) == 12 and s.num_stages == 2
    # the largest stage holds no more than any other split's largest
    best = min(max(stage_params(OPT, StageSplit((a, 12 - a)), i) for i in (0, 1)) for a in range(1, 12))
    assert max(stage_params(OPT, s, i) for i in (0, 1)) == best
    assert even_by_bytes(OPT, 12).counts == (1,) * 12
    assert list(StageSplit((5, 7)).layers(1)) == list(range(5, 12))


@pytest.mark.parametrize("text, msg", [("5,8", "sum to opt-125m's 12"), ("12", "1 stages for a world size of 2"),
                                       ("0,12", ">= 1 layer"), ("a,b", "comma-separated")])
def test_bad_stage_layers(text, msg):
    with pytest.raises(ConfigError, match=msg):
        parse_stage_layers(text, OPT, 2)


def test_more_stages_than_layers():
    with pytest.raises(ConfigError, match="13 pipeline stages for opt-125m's 12 layers"):
        even_by_bytes(OPT, 13)


def test_pipeline_step_is_the_slowest_stage_with_the_bubble():
    micro = stage_micro_s([4.0, 6.0], micro_batches=2, transfer_s=0.5)
    assert micro == [2.5, 3.0]  # the last stage sends nothing on
    assert pipeline_step_s(micro, 2) == 3.0 * (2 + 2 - 1)
    assert pipeline_step_s([1.0], 4) == 4.0  # one stage: no bubble
    assert activation_bytes(64, rows=4, new_tokens=3, dtype_bytes=4) == 4 * 3 * 64 * 4


def test_one_stage_prediction_is_the_single_process_one():
    hw, cal = load_hardware(HW_DIR / "t4-flexgen.yaml"), Calibration()
    pl = Placement.from_percent((50, 50, 0, 100, 100, 0), block_size=16, dtype_bytes=2)
    single = predict(analytic_trace(OPT, 8, 64, 4, pl), hw, "float16", cal)
    one = predict_pipeline([stage_trace(OPT, StageSplit((12,)), 0, 8, 64, 4, pl)], hw, "float16", cal, 1, OPT.hidden, 2)
    assert one["total_s"] == pytest.approx(single["total_s"])


def test_two_stages_split_the_work_and_a_slow_link_costs():
    hw, cal = load_hardware(HW_DIR / "t4-flexgen.yaml"), Calibration()
    pl = Placement.from_percent((0, 100, 0, 100, 100, 0), block_size=16, dtype_bytes=2)
    split = even_by_bytes(OPT, 2)
    traces = [stage_trace(OPT, split, s, 8, 64, 4, pl, micro_batches=4) for s in (0, 1)]
    two = predict_pipeline(traces, hw, "float16", cal, 4, OPT.hidden, 2)
    single = predict(analytic_trace(OPT, 8, 64, 4, pl), hw, "float16", cal)
    assert two["total_s"] < single["total_s"]
    assert all(0 < b <= 1 for b in two["stage_busy_fraction"])
    slow = dataclasses.replace(hw, interconnect_bw=1e6)  # 1 MB/s between the nodes
    assert predict_pipeline(traces, slow, "float16", cal, 4, OPT.hidden, 2)["total_s"] > two["total_s"] + 1.0


def test_auto_over_stages():
    hw = load_hardware(HW_DIR / "rtx3070ti-laptop-8gb.yaml")
    wl = Workload(opt_spec("opt-6.7b"), prompt_len=256, gen_len=16, batch_size=8, dtype="float16")
    one = choose_stages(wl, hw, 1, micro_batches=1, gpu_batch_size=8)
    # one stage: placement.py's fastest candidate at the same batch split
    assert one.total_s == pytest.approx(min(c["total_s"] for c in candidates(wl, hw, 5, (8, 1))), rel=1e-6)
    four = choose_stages(wl, hw, 4, micro_batches=4, gpu_batch_size=2)
    assert sum(four.split.counts) == 32 and len(four.percents) == 4
    assert four.total_s < one.total_s  # four GPUs hold more of the weights than one
    with pytest.raises(ValueError, match="micro-batches"):
        choose_stages(wl, hw, 2, micro_batches=3, gpu_batch_size=2)
