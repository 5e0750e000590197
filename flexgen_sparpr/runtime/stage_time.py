"""The time model (runtime/timemodel.py) over pipeline stages (runtime/stages.py).

Each stage gets a trace of its own: analytic (`stage_trace`: its layers' bytes and FLOPs, the head
only on the last stage, its offloaded weights streamed once per micro-batch), or a rank's recorded
trace with the FLOPs cut to its layers (`restage`: the bytes are that rank's own). `predict_pipeline`
turns the stages' traces into a run: per step, each stage's predicted whole-batch time / M plus
sending a micro-batch's hidden states on at the hardware's interconnect bandwidth, and the pipeline
step = the slowest stage x (M + S - 1) (runtime/stages.py `pipeline_step_s`).
"""
from __future__ import annotations

import dataclasses

from ..models.spec import ModelSpec
from .hardware import Hardware
from .stages import StageSplit, activation_bytes, pipeline_step_s, stage_micro_s, stage_params, stage_spec
from .timemodel import Calibration, predict_step
from .trace import LINKS, OPS, Placement, StepTrace, analytic_trace, weight_link_bytes


def stage_trace(spec: ModelSpec, split: StageSplit, stage: int, batch: int, prompt_len: int, gen_len: int,
                pl: Placement, micro_batches: int = 1, keep: float = 1.0, rebuilt_blocks: float = 0,
                serial_kv: bool = False) -> list[StepTrace]:
    """The analytic trace of one stage over the whole batch (timemodel.analytic_trace's arguments)."""
    first, last = stage == 0, stage == split.num_stages - 1
    sspec = stage_spec(spec, split.counts[stage], first, last)
    trace = analytic_trace(sspec, batch, prompt_len, gen_len, pl, keep, rebuilt_blocks, serial_kv)
    extra = {k: v * (micro_batches - 1) for k, v in weight_link_bytes(sspec, pl).items()}  # reloads
    out = []
    for st in trace:
        flops = dict(st.flops, head=st.flops["head"] if last else 0.0)
        moved = {k: st.bytes.get(k, 0) + int(extra.get(k, 0)) for k in LINKS}
        out.append(dataclasses.replace(st, bytes=moved, flops=flops))
    return out


def restage(trace: list[StepTrace], spec: ModelSpec, split: StageSplit, stage: int) -> list[StepTrace]:
    """A rank's recorded trace (TraceRecorder counts FLOPs for the whole model) cut to its stage:
    its layers' share of the layer FLOPs and compute-memory bytes, the head only on the last."""
    n, last = split.counts[stage], stage == split.num_stages - 1
    share = n / spec.num_layers
    params = stage_params(spec, split, stage) / max(1, sum(stage_params(spec, split, s)
                                                          for s in range(split.num_stages)))
    out = []
    for st in trace:
        flops = {op: (st.flops.get(op, 0.0) * share if op != "head" else (st.flops.get(op, 0.0) if last else 0.0))
                 for op in OPS}
        out.append(dataclasses.replace(st, num_layers=n, flops=flops, mem_bytes=st.mem_bytes * params))
    return out


def predict_pipeline(stage_traces: list[list[StepTrace]], hw: Hardware, dtype: str, cal: Calibration,
                     micro_batches: int, hidden: int, dtype_bytes: int) -> dict:
    """Predicted prefill, decode and total seconds of a pipelined run from each stage's trace (all
    of the same steps, over the whole batch), with each stage's predicted busy share of the run."""
    steps = len(stage_traces[0])
    bw = hw.interconnect_bw
    secs, busy = [], [0.0] * len(stage_traces)
    for i in range(steps):
        first = stage_traces[0][i]
        rows = first.batch // micro_batches
        xfer = activation_bytes(hidden, rows, first.new_tokens, dtype_bytes) / bw if bw > 0 else 0.0
        whole = [predict_step(t[i], hw, dtype, cal) for t in stage_traces]
        micro = stage_micro_s(whole, micro_batches, xfer)
        secs.append(pipeline_step_s(micro, micro_batches))
        for s, t in enumerate(whole):
            busy[s] += t
    pre = sum(s for s, st in zip(secs, stage_traces[0]) if st.kind == "prefill")
    total = sum(secs)
    return {"prefill_s": pre, "decode_s": total - pre, "total_s": total, "step_s": secs,
            "stage_busy_fraction": [b / total if total > 0 else None for b in busy]}

