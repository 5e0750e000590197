"""The time model (runtime/timemodel.py): FLOPs by hand, the overlap maths, calibration, and
traces of real tiny engine runs against the engine's LinkCounters and the analytic trace."""
from __future__ import annotations

import math

import pytest
import torch

from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.models.spec import ModelSpec, opt_spec
from flexgen_sparpr.runtime.costs import CostModel
from flexgen_sparpr.runtime.hardware import Hardware
from flexgen_sparpr.runtime.placement import device_bytes_needed
from flexgen_sparpr.runtime.timemodel import Calibration, calibrate, predict, predict_step, step_parts
from flexgen_sparpr.runtime.trace import (LINKS, Placement, StepTrace, TraceRecorder, analytic_trace,
                                          layer_weight_bytes, step_flops, weight_link_bytes)
from flexgen_sparpr.weights.resolve import resolve_source

TINY = ModelSpec(arch="opt", name="tiny", num_layers=2, hidden=8, num_heads=2, num_kv_heads=2, head_dim=4,
                 ffn=32, vocab=10, max_pos=64)


def hw(**kw) -> Hardware:
    base = dict(name="t", compute="cuda", compute_memory=8e9, cpu_memory=16e9, disk_free=1e12, h2d_bw=10e9,
                d2h_bw=10e9, h2d_pageable_bw=5e9, d2h_pageable_bw=5e9, disk_read_bw=2e9, disk_write_bw=1e9,
                flops={"float32": 1e12}, cpu_flops={"float32": 1e11}, source="test")
    return Hardware(**{**base, **kw})


def test_decode_flops_equal_hand_count():
    # batch 2, one new token, 6 keys attended (5 cached + the new one), 3 tokens rebuilt
    f = step_flops(TINY, batch=2, new_tokens=1, score_pairs=6, rebuilt_tokens=3)
    # per layer: q, k, v, out are 8x8 each -> 4 * 64 MACs per token, 2 tokens, 2 FLOPs per MAC
    assert f["attn_proj"] == 2 * (2 * 2 * 4 * 64)
    # QK^T and PV: 2 heads x 4 dims x 6 keys MACs each, 2 sequences
    assert f["attn_scores"] == 2 * (2 * 2 * 2 * 2 * 4 * 6)
    # fc1 8->32 and fc2 32->8
    assert f["mlp"] == 2 * (2 * 2 * 2 * 8 * 32)
    # K and V projections (8x8 each) for 3 tokens per sequence
    assert f["kv_recompute"] == 2 * (2 * 2 * 3 * 2 * 64)
    assert f["head"] == 2 * 2 * 10 * 8  # only the last token meets the head, once per step


def test_prefill_scores_are_causal_pairs():
    f = step_flops(TINY, batch=1, new_tokens=4, score_pairs=4 * 5 / 2)
    assert f["attn_scores"] == 2 * 2 * 2 * 2 * 4 * 10  # 10 (query, key) pairs under the causal mask


def test_layer_weight_bytes_match_the_spec_accounting():
    for spec in (TINY, opt_spec("opt-1.3b")):
        emb = spec.vocab * spec.embed_dim + (spec.max_pos + 2) * spec.hidden + 2 * spec.hidden
        assert sum(layer_weight_bytes(spec, 2)) * spec.num_layers == (spec.num_params() - emb) * 2


def test_weight_link_bytes_follow_the_placement():
    layer = sum(layer_weight_bytes(TINY, 2)) * TINY.num_layers
    on_cpu = weight_link_bytes(TINY, Placement(weights=(0, 100, 0), dtype_bytes=2, is_cuda=True))
    assert on_cpu == {"disk->cpu": 0, "cpu->compute": layer, "compute->cpu": 0, "cpu->disk": 0}
    on_disk = weight_link_bytes(TINY, Placement(weights=(0, 0, 100), dtype_bytes=2, is_cuda=False))
    assert on_disk["disk->cpu"] == layer and on_disk["cpu->compute"] == 0  # CPU box: cpu is compute


def test_parked_activations_cross_around_every_layer_on_cuda():
    pl = Placement.from_percent((100, 0, 100, 0, 0, 100), dtype_bytes=2, is_cuda=True)
    assert pl.act_cpu and pl.weights == (100, 0, 0) and pl.cache == (100, 0, 0)
    step = analytic_trace(TINY, 2, 5, 2, pl)[1]  # one decode token
    n = (2 * TINY.num_layers + 1) * 2 * 1 * TINY.hidden * 2  # embed, attn and mlp apart, head
    assert step.bytes == {"disk->cpu": 0, "cpu->compute": n, "compute->cpu": n, "cpu->disk": 0}
    cpu_box = analytic_trace(TINY, 2, 5, 2, Placement.from_percent((100, 0, 100, 0, 0, 100), is_cuda=False))
    assert sum(cpu_box[1].bytes.values()) == 0


def test_overlap_model_takes_the_slower_side_plus_head_and_overhead():
    h = hw()
    cal = Calibration(prefill_eff=0.5, decode_eff=0.25, io_eff=0.5, layer_overhead_s=1e-3)
    io_bound = StepTrace("decode", 10, 1, 4, 8, bytes={"disk->cpu": 2e9, "cpu->compute": 1e9},
                         flops={"mlp": 1e11, "head": 5e10})
    p = step_parts(io_bound, h, "float32", cal)
    assert p["io_s"] == pytest.approx((2e9 / 2e9 + 1e9 / 10e9) / 0.5)  # 2.2 s, the links one after the other
    assert p["compute_s"] == pytest.approx(1e11 / 0.25e12) and p["head_s"] == pytest.approx(5e10 / 0.25e12)
    assert predict_step(io_bound, h, "float32", cal) == pytest.approx(2.2 + 0.2 + 8e-3)
    compute_bound = StepTrace("prefill", 0, 64, 4, 8, bytes={"cpu->disk": 1e8}, flops={"mlp": 2e12})
    assert predict_step(compute_bound, h, "float32", cal) == pytest.approx(2e12 / 0.5e12 + 8e-3)


def test_serial_reads_add_to_the_step_instead_of_hiding_behind_compute():
    h, cal = hw(), Calibration(decode_eff=0.25, io_eff=0.5)
    kw = dict(bytes={"disk->cpu": 1e9}, flops={"mlp": 1e12})  # compute 4 s, I/O 1 s
    hidden = StepTrace("decode", 10, 1, 4, 8, **kw)
    serial = StepTrace("decode", 10, 1, 4, 8, **kw, serial_bytes={"disk->cpu": 4e8})  # 0.4 s of it serial
    assert predict_step(hidden, h, "float32", cal) == pytest.approx(4.0)
    assert predict_step(serial, h, "float32", cal) == pytest.approx(4.0 + 0.4)
    io_bound = StepTrace("decode", 10, 1, 4, 8, bytes={"disk->cpu": 4e9}, flops={"mlp": 1e11},
                         serial_bytes={"disk->cpu": 1e9})  # I/O 4 s (1 s serial), compute 0.4 s
    assert predict_step(io_bound, h, "float32", cal) == pytest.approx(3.0 + 1.0)


def test_decode_compute_is_a_roofline_with_memory_bandwidth():
    h = hw(compute_memory_bw=100e9)
    step = StepTrace("decode", 10, 1, 4, 1, flops={"mlp": 1e9}, mem_bytes=50e9)
    assert step_parts(step, h, "float32", Calibration())["compute_s"] == pytest.approx(0.5)  # not 1 ms
    assert step_parts(step, hw(), "float32", Calibration())["compute_s"] == pytest.approx(1e-3)  # no bandwidth known


def test_calibrate_recovers_known_constants():
    h, true = hw(), Calibration(prefill_eff=0.3, decode_eff=10 ** (-6 / 20), io_eff=10 ** (-10 / 20),
                                layer_overhead_s=2e-3)
    trace = []
    for i, (nbytes, flops) in enumerate([(4e9, 1e10), (1e9, 1e10), (2e8, 4e11), (3e9, 2e11), (5e8, 1e11)]):
        s = StepTrace("decode", 100 + i, 1, 4, 12, bytes={"disk->cpu": nbytes}, flops={"mlp": flops})
        s.measured_s = predict_step(s, h, "float32", true)
        trace.append(s)
    pre = StepTrace("prefill", 0, 100, 4, 12, flops={"mlp": 3e12})
    pre.measured_s = predict_step(pre, h, "float32", true)
    cal = calibrate([[pre] + trace], h, "float32")
    assert cal.decode_eff == pytest.approx(true.decode_eff, rel=1e-6)
    assert cal.io_eff == pytest.approx(true.io_eff, rel=1e-6)
    assert cal.layer_overhead_s == pytest.approx(true.layer_overhead_s, rel=1e-3)
    assert cal.prefill_eff == pytest.approx(true.prefill_eff, rel=0.02)  # the prefill pays the overhead too
    with pytest.raises(ValueError):
        calibrate([trace], h, "float32")


def test_calibrate_separates_prefill_gemms_from_attention_scores():
    h, true = hw(), Calibration(prefill_eff=0.4, scores_eff=0.8)
    pre = []
    for n in (256, 1024, 4096):
        f = step_flops(opt_spec("opt-125m"), 4, n, n * (n + 1) / 2)
        s = StepTrace("prefill", 0, n, 4, 12, flops=f)
        s.measured_s = predict_step(s, h, "float32", true)
        pre.append(s)
    dec = StepTrace("decode", 10, 1, 4, 12, bytes={"disk->cpu": 1e8}, flops={"mlp": 1e9}, measured_s=0.2)
    cal = calibrate([pre + [dec]], h, "float32")
    assert cal.prefill_eff == pytest.approx(0.4, rel=1e-6) and cal.scores_eff == pytest.approx(0.8, rel=1e-6)
    one = calibrate([pre[:1] + [dec]], h, "float32")  # one length cannot tell them apart: one efficiency
    assert one.prefill_eff == one.scores_eff


def test_device_bytes_needed_adds_weights_kv_and_activations():
    spec = opt_spec("opt-6.7b")
    need = device_bytes_needed(spec, 4, 1024, 2)
    assert need["weights"] == spec.model_bytes(torch.float16)
    assert need["kv"] == spec.cache_bytes(4, 1024, torch.float16)
    assert need["total"] == need["weights"] + need["kv"] + need["activations"] > 8 * 2 ** 30


def _run(model_dir, tmp_path, kv_policy="dense", policy_args=None, prompt=11, gen=6, bs=4, ngb=1):
    src = resolve_source(str(model_dir), "")
    cfg = EngineConfig(device="cpu", dtype="float32", block_size=bs, offload_dir=str(tmp_path),
                       kv_policy=kv_policy, policy_args=policy_args or {})
    prompts = [[(7 * i + j) % 250 + 4 for j in range(prompt)] for i in range(2)]
    policy = Policy(gpu_batch_size=2 // ngb, num_gpu_batches=ngb, cache_gpu_percent=0, cache_cpu_percent=0)
    with Engine(src, policy, cfg) as eng:
        rec = TraceRecorder(eng)
        st = eng.prefill(prompts, gen)
        eng.decode(st)
        return src.spec, rec.trace(), eng.devices.counters.snapshot()


def test_recorded_trace_bytes_match_the_counters_and_the_analytic_trace(tiny_opt_dir, tmp_path):
    spec, trace, counters = _run(tiny_opt_dir, tmp_path)
    assert [s.kind for s in trace] == ["prefill"] + ["decode"] * 5
    assert [s.context for s in trace] == [0, 11, 12, 13, 14, 15]
    for link in LINKS:
        assert sum(s.bytes.get(link, 0) for s in trace) == counters.get(link, 0)
    assert counters["disk->cpu"] > 0 and counters["cpu->disk"] > 0
    an = analytic_trace(spec, 2, 11, 6, Placement(cache=(0, 0, 100), block_size=4, dtype_bytes=4))
    for rec, model in zip(trace, an):
        assert rec.bytes == model.bytes, rec.context
        assert rec.flops == model.flops and rec.mem_bytes == model.mem_bytes
        assert rec.measured_s > 0 and model.measured_s is None
    t = predict(trace, hw(compute="cpu", h2d_bw=0, d2h_bw=0), "float32", Calibration())
    assert t["total_s"] == pytest.approx(t["prefill_s"] + t["decode_s"]) and t["decode_steps"] == 5


def test_trace_marks_the_reads_made_inside_the_compute(tiny_opt_dir, tmp_path):
    """SparPR with one GPU batch reads its blocks inside each layer's compute (serial_bytes =
    every decode read); dense prefetches them, and so does SparPR with two GPU batches."""
    costs = CostModel(disk_read_Bps=1e9, matmul_flops={"float32": 1e10}, live=False)
    args = dict(keep_ratio=0.5, min_keep_tokens=0, costs=costs, fallback=False)
    _, one, _ = _run(tiny_opt_dir, tmp_path / "1", "sparpr", args, prompt=40, gen=4)
    _, two, _ = _run(tiny_opt_dir, tmp_path / "2", "sparpr", args, prompt=40, gen=4, ngb=2)
    _, dense, _ = _run(tiny_opt_dir, tmp_path / "d", prompt=40, gen=4)
    for s in one[1:]:
        assert s.serial_bytes == {"disk->cpu": s.bytes["disk->cpu"]} and s.bytes["disk->cpu"] > 0
    assert all(not s.serial_bytes for s in one[:1] + two + dense)


def test_sparpr_trace_counts_what_the_policy_read(tiny_opt_dir, tmp_path):
    costs = CostModel(disk_read_Bps=1e9, matmul_flops={"float32": 1e10}, matmul_latency_s={"float32": 1e-5},
                      live=False)
    args = dict(keep_ratio=0.25, min_keep_tokens=0, min_keep=0.1, costs=costs, fallback=False, checkpoints="always")
    _, sparse, counters = _run(tiny_opt_dir, tmp_path / "s", "sparpr", args, prompt=40, gen=4)
    _, dense, _ = _run(tiny_opt_dir, tmp_path / "d", prompt=40, gen=4)
    for link in LINKS:
        assert sum(s.bytes.get(link, 0) for s in sparse) == counters.get(link, 0)
    for s, d in zip(sparse[1:], dense[1:]):
        assert s.bytes["disk->cpu"] < d.bytes["disk->cpu"]
        assert s.flops["attn_scores"] < d.flops["attn_scores"]
        assert s.flops["mlp"] == d.flops["mlp"] and not math.isnan(s.flops["attn_scores"])
    # checkpoints are stored beside the blocks: 1.5x the dense writes for OPT (hidden = kv_dim)
    assert sum(s.bytes["cpu->disk"] for s in sparse) == 1.5 * sum(d.bytes["cpu->disk"] for d in dense)
    # auto: matmuls at 10 GFLOP/s against a 1 GB/s disk make a rebuild dearer than 2 copies: none written
    _, auto, _ = _run(tiny_opt_dir, tmp_path / "a", "sparpr", args | dict(checkpoints="auto"), prompt=40, gen=4)
    assert sum(s.bytes["cpu->disk"] for s in auto) == sum(d.bytes["cpu->disk"] for d in dense)
