"""A time model for FlexGen's overlapped schedule, driven by a per-step trace of a run.

A trace is one `StepTrace` per generated token (the prefill is step 0): the bytes that crossed
each link and the FLOPs of each op. It comes either from a real run (`TraceRecorder`: the
engine's LinkCounters, snapshotted after every step through `Engine.on_step`, plus FLOPs
counted from the ModelSpec and what each step read) or analytically (`analytic_trace`: bytes
from the placement and the context, FLOPs from the spec) for models too big to run here.

`predict` turns a trace and a `Hardware` into seconds. Per layer FlexGen's schedule loads
layer j+1 (weights, KV blocks) and stores layer j-1's sealed blocks while layer j computes, so
a layer costs max(compute, I/O); with every layer alike a step costs
    L x max(compute/L, io/L) + head = max(compute_layers, io) + head + L x overhead
except for reads made inside a layer's compute (`serial_bytes`: a query-aware policy such as
SparPR with one GPU batch selects only once the layer's query exists, so its reads cannot be
prefetched), which add to the step instead of hiding behind compute:
    max(compute_layers, io - io_serial) + io_serial + head + L x overhead
where compute = FLOPs / (device FLOP/s x efficiency of the phase), io = sum over links of
bytes / link bandwidth (one I/O queue: the hops of a block run one after the other) and
overhead is a fixed per-layer cost (kernel launches, Python). Efficiencies and overhead are
`Calibration` constants, fitted once per machine (`calibrate`) and then frozen.

Not counted: layer norms, softmax and element-wise ops (O(hidden) per token, < 1 % of the
FLOPs here), SparPR's block scoring (one [Hkv, D] x [D, blocks] product per layer); the analytic
trace assumes one GPU batch per step and FlexGen's sep_layer for activation traffic.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .hardware import Hardware
from .trace import LINKS, StepTrace

# --- the time model ---
@dataclass(frozen=True)
class Calibration:
    """Constants fitted once per machine (`calibrate`), then frozen: the share of the hardware
    file's nominal FLOP/s that prefill and decode reach, the share of its link bandwidths the
    engine's block transfers reach (they pay staging copies and per-block calls on top of the
    raw transfer), and a fixed cost per layer and step (launches, Python, I/O hand-offs)."""

    prefill_eff: float = 1.0
    scores_eff: float = 1.0  # the prefill's attention scores (SDPA), apart from its GEMMs
    decode_eff: float = 1.0
    io_eff: float = 1.0
    layer_overhead_s: float = 0.0
    source: str = "ideal: the hardware file's numbers, no overhead"

    def __post_init__(self):
        if not (self.prefill_eff > 0 and self.scores_eff > 0 and self.decode_eff > 0 and self.io_eff > 0 and self.layer_overhead_s >= 0):
            raise ValueError(f"calibration constants must be positive (got {self})")

    def to_dict(self) -> dict:
        return asdict(self)


def link_bandwidth(hw: Hardware, link: str) -> float:
    """Bytes/s of a link on hw (inf where nothing crosses, e.g. cpu<->compute on a CPU box)."""
    bw = {"disk->cpu": hw.disk_read_bw, "cpu->disk": hw.disk_write_bw,
          "cpu->compute": hw.h2d_bw, "compute->cpu": hw.d2h_bw}[link]
    return bw if bw > 0 else math.inf


def step_parts(step: StepTrace, hw: Hardware, dtype: str, cal: Calibration) -> dict[str, float]:
    """Seconds of a step's parts: compute of the layers and of the head (a roofline: FLOPs at
    the phase's efficiency, or the bytes read from compute memory, whichever is slower), I/O
    (every link's bytes, one queue) and the fixed overhead."""
    peak, total = hw.compute_flops(dtype), sum(step.flops.values()) or 1.0
    if step.kind == "prefill":
        scores = step.flops.get("attn_scores", 0)
        flop_s = (total - scores) / (peak * cal.prefill_eff) + scores / (peak * cal.scores_eff)
    else:
        flop_s = total / (peak * cal.decode_eff)
    membw = getattr(hw, "compute_memory_bw", 0.0)
    mem_s = step.mem_bytes / membw if membw > 0 else 0.0
    comp = max(flop_s, mem_s)
    head = comp * step.flops.get("head", 0) / total
    io = sum(step.bytes.get(link, 0) / link_bandwidth(hw, link) for link in LINKS) / cal.io_eff
    serial = sum(step.serial_bytes.get(link, 0) / link_bandwidth(hw, link) for link in LINKS) / cal.io_eff
    return {"compute_s": comp - head, "head_s": head, "io_s": io, "io_serial_s": min(io, serial),
            "overhead_s": step.num_layers * cal.layer_overhead_s}


def _step_s(p: dict[str, float]) -> float:
    """FlexGen's overlap: the prefetched I/O hides behind compute, the serial reads do not."""
    return max(p["compute_s"], p["io_s"] - p["io_serial_s"]) + p["io_serial_s"] + p["head_s"] + p["overhead_s"]


def predict_step(step: StepTrace, hw: Hardware, dtype: str, cal: Calibration) -> float:
    """max(compute, prefetched I/O) over the layers, plus the serial reads, the head and the
    fixed overhead."""
    return _step_s(step_parts(step, hw, dtype, cal))


def predict(trace: list[StepTrace], hw: Hardware, dtype: str, cal: Calibration) -> dict:
    """Predicted prefill, decode and end-to-end seconds of a trace, the summed parts, and which
    side bound the decode steps."""
    parts = [step_parts(s, hw, dtype, cal) for s in trace]
    secs = [_step_s(p) for p in parts]
    pre = sum(t for t, s in zip(secs, trace) if s.kind == "prefill")
    io_bound = sum(1 for p, s in zip(parts, trace)
                   if s.kind == "decode" and p["io_s"] - p["io_serial_s"] >= p["compute_s"])
    return {"prefill_s": pre, "decode_s": sum(secs) - pre, "total_s": sum(secs),
            "io_s": sum(p["io_s"] for p in parts), "compute_s": sum(p["compute_s"] + p["head_s"] for p in parts),
            "decode_io_bound_steps": io_bound, "decode_steps": sum(1 for s in trace if s.kind == "decode")}


def calibrate(traces: list[list[StepTrace]], hw: Hardware, dtype: str, source: str = "") -> Calibration:
    """Fit the constants to measured runs (use runs that are not validated against later).

    prefill: measured seconds = GEMM FLOPs / (peak x prefill_eff) + score FLOPs / (peak x
    scores_eff), least squares over the prefills (one efficiency for both when the prefills
    cannot tell them apart, e.g. one context length). decode: a grid over
    (decode_eff, io_eff), the per-layer overhead by least squares at each point (it enters
    linearly), minimising the squared relative error of the decode steps."""
    steps = [s for t in traces for s in t if s.measured_s]
    pre = [s for s in steps if s.kind == "prefill"]
    dec = [s for s in steps if s.kind == "decode"]
    if not pre or not dec:
        raise ValueError("calibration needs measured prefill and decode steps")
    peak = hw.compute_flops(dtype)
    xs = [((sum(s.flops.values()) - s.flops.get("attn_scores", 0)) / peak, s.flops.get("attn_scores", 0) / peak)
          for s in pre]
    a, b = _lstsq2(xs, [s.measured_s for s in pre])
    if a <= 0 or b <= 0 or len({s.context + s.new_tokens for s in pre}) < 2:
        a = b = sum(s.measured_s for s in pre) / sum(x + y for x, y in xs)
    grid = [10 ** (k / 20) for k in range(-50, 31)]  # 10^-2.5 .. 10^1.5
    best = None
    for de in grid:
        for ie in grid:
            cal = Calibration(decode_eff=de, io_eff=ie)
            base = [predict_step(s, hw, dtype, cal) for s in dec]
            # minimise sum ((base + L o - t) / t)^2 over o >= 0 (closed form)
            num = sum((s.measured_s - b) * s.num_layers / s.measured_s ** 2 for s, b in zip(dec, base))
            den = sum((s.num_layers / s.measured_s) ** 2 for s in dec)
            o = max(0.0, num / den)
            err = sum(((b + s.num_layers * o - s.measured_s) / s.measured_s) ** 2 for s, b in zip(dec, base))
            if best is None or err < best[0]:
                best = (err, de, ie, o)
    _, de, ie, o = best
    return Calibration(prefill_eff=1 / a, scores_eff=1 / b, decode_eff=de, io_eff=ie, layer_overhead_s=o,
                       source=source or f"fitted on {len(pre)} prefills and {len(dec)} decode steps")



def _lstsq2(xs: list[tuple[float, float]], ys: list[float]) -> tuple[float, float]:
    """Least squares y ~ a x0 + b x1 without an intercept; b = 0 when the columns are degenerate."""
    s00 = sum(u * u for u, _ in xs)
    s01 = sum(u * v for u, v in xs)
    s11 = sum(v * v for _, v in xs)
    y0 = sum(u * y for (u, _), y in zip(xs, ys))
    y1 = sum(v * y for (_, v), y in zip(xs, ys))
    det = s00 * s11 - s01 * s01
    if det <= 1e-9 * s00 * s11 or s11 == 0:
        return (y0 / s00 if s00 else 0.0), 0.0
    return (y0 * s11 - y1 * s01) / det, (s00 * y1 - s01 * y0) / det
