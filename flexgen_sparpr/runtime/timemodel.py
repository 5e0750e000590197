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
from dataclasses import asdict, dataclass, field

from ..models.spec import ModelSpec
from ..storage.tiers import block_homes, split_by_percent, Tier
from .hardware import Hardware

LINKS = ("disk->cpu", "cpu->compute", "compute->cpu", "cpu->disk")
OPS = ("attn_proj", "attn_scores", "mlp", "head", "kv_recompute")


@dataclass
class StepTrace:
    """One step of a run. kind: "prefill" | "decode"; context: tokens cached before the step;
    new_tokens: tokens computed per sequence; bytes: link -> bytes; flops: op -> FLOPs;
    measured_s: the step's wall seconds when it comes from a run."""

    kind: str
    context: int
    new_tokens: int
    batch: int
    num_layers: int
    bytes: dict[str, int] = field(default_factory=dict)
    flops: dict[str, float] = field(default_factory=dict)
    mem_bytes: float = 0.0  # bytes compute reads from its own memory (weights, attended KV)
    measured_s: float | None = None
    serial_bytes: dict[str, int] = field(default_factory=dict)  # of `bytes`: read inside the compute

    def to_dict(self) -> dict:
        return asdict(self)


# --- FLOPs, analytic from the spec ---
def layer_flops(spec: ModelSpec, batch: int, new_tokens: int, score_pairs: float,
                rebuilt_tokens: float = 0) -> dict[str, float]:
    """FLOPs of one decoder layer over a batch (a multiply-add counts 2).

    score_pairs: (query, key) pairs per sequence and head (decode: keys attended; a causal
    prefill of n tokens: n (n + 1) / 2). rebuilt_tokens: tokens per sequence whose K/V are
    recomputed from checkpoints (SparPR)."""
    h, kv, f = spec.hidden, spec.kv_dim, spec.ffn
    tok = batch * new_tokens
    mlp_mats = 2 if spec.arch == "opt" else 3  # OPT fc1/fc2; Llama gate/up/down
    return {
        "attn_proj": 2.0 * tok * (h * h + 2 * h * kv + h * h),  # q, k, v, out
        "attn_scores": 2.0 * 2 * batch * spec.num_heads * spec.head_dim * score_pairs,  # QK^T and PV
        "mlp": 2.0 * tok * mlp_mats * h * f,
        "kv_recompute": 2.0 * batch * rebuilt_tokens * h * 2 * kv,
    }


def head_flops(spec: ModelSpec, batch: int) -> float:
    """LM head on each sequence's last token (plus OPT-350m's projection out)."""
    proj = spec.hidden * spec.word_embed_dim if spec.word_embed_dim else 0
    return 2.0 * batch * (spec.vocab * spec.embed_dim + proj)


def step_flops(spec: ModelSpec, batch: int, new_tokens: int, score_pairs: float,
               rebuilt_tokens: float = 0) -> dict[str, float]:
    """FLOPs of one step over every layer and the head; per-layer arguments as `layer_flops`
    (averages over the layers when they differ)."""
    per = layer_flops(spec, batch, new_tokens, score_pairs, rebuilt_tokens)
    out = {op: v * spec.num_layers for op, v in per.items()}
    out["head"] = head_flops(spec, batch)
    return {op: out[op] for op in OPS}


def prefill_pairs(n: int) -> float:
    return n * (n + 1) / 2


def step_mem_bytes(spec: ModelSpec, batch: int, attended: float, dtype_bytes: int) -> float:
    """Bytes a step's compute reads from compute memory: every weight once (the roofline of a
    decode step, where each weight meets only B tokens) and the K/V of the attended tokens."""
    kv = 2 * batch * attended * spec.kv_dim * spec.num_layers
    return float(spec.num_params() + kv) * dtype_bytes


# --- bytes, analytic from the placement ---
@dataclass(frozen=True)
class Placement:
    """FlexGen's --percent as (compute, cpu, disk) shares, plus the engine facts bytes depend on."""

    weights: tuple[float, float, float] = (100, 0, 0)
    cache: tuple[float, float, float] = (100, 0, 0)
    block_size: int = 64
    dtype_bytes: int = 4
    kv_dtype_bytes: int = 2  # an offloaded KV block's element (--kv-dtype: auto stores float16)
    is_cuda: bool = False
    checkpoints: bool = False  # SparPR keeps hidden-state checkpoints beside the KV blocks
    act_cpu: bool = False  # activations parked on the CPU between layers (--percent ... 0 100)

    @classmethod
    def from_percent(cls, percent, **kw) -> "Placement":
        """From FlexGen's six --percent numbers (weights gpu/cpu, cache gpu/cpu, act gpu/cpu)."""
        wg, wc, cg, cc, ag = percent[:5]
        return cls(weights=(wg, wc, 100 - wg - wc), cache=(cg, cc, 100 - cg - cc), act_cpu=ag == 0, **kw)


def layer_weight_bytes(spec: ModelSpec, dtype_bytes: int) -> list[int]:
    """Bytes of each weight tensor of one decoder layer (the split unit of FlexGen's rule)."""
    h, kv, f = spec.hidden, spec.kv_dim, spec.ffn
    mats = [h * h, h * kv, h * kv, h * h] + ([h * f, f * h] if spec.arch == "opt" else [h * f, h * f, f * h])
    vecs = [h, kv, kv, h, f, h, 4 * h] if spec.arch == "opt" else [2 * h]
    return [n * dtype_bytes for n in mats + vecs]


def weight_link_bytes(spec: ModelSpec, pl: Placement) -> dict[str, int]:
    """Bytes of the layers' weights that cross a link at every step (not the embedding / head)."""
    sizes = layer_weight_bytes(spec, pl.dtype_bytes)
    tiers = split_by_percent(sizes, pl.weights)
    on = {t: sum(s for s, x in zip(sizes, tiers) if x == t) * spec.num_layers for t in Tier}
    out = dict.fromkeys(LINKS, 0)
    out["disk->cpu"] += on[Tier.DISK]
    if pl.is_cuda:
        out["cpu->compute"] += on[Tier.DISK] + on[Tier.CPU]
    return out


def kv_block_bytes(spec: ModelSpec, batch: int, pl: Placement) -> tuple[int, int]:
    """(K+V bytes of one block, checkpoint bytes of one block) for one GPU batch."""
    kvb = 2 * batch * spec.kv_dim * pl.block_size * pl.kv_dtype_bytes
    return kvb, batch * spec.hidden * pl.block_size * pl.kv_dtype_bytes


def _homes(max_len: int, pl: Placement) -> list[Tier]:
    homes = block_homes(-(-max_len // pl.block_size), pl.cache)
    return [Tier.COMPUTE if (t == Tier.CPU and not pl.is_cuda) else t for t in homes]


def kv_link_bytes(spec: ModelSpec, batch: int, pl: Placement, max_len: int, context: int, new_tokens: int,
                  keep: float = 1.0, rebuilt_blocks: float = 0) -> dict[str, float]:
    """KV bytes per link of one step, over every layer: the sealed offloaded blocks read (a
    `keep` share of them, of which `rebuilt_blocks` per layer come as checkpoints instead), and
    the blocks this step seals stored to their homes (with their checkpoints, if kept)."""
    kvb, ckb = kv_block_bytes(spec, batch, pl)
    homes, bs = _homes(max_len, pl), pl.block_size
    out = dict.fromkeys(LINKS, 0.0)
    sealed = context // bs if new_tokens == 1 else 0  # prefill reads nothing
    off = [homes[i] for i in range(sealed) if homes[i] != Tier.COMPUTE]
    n_disk, n_cpu = off.count(Tier.DISK) * keep, off.count(Tier.CPU) * keep
    rb_disk = min(rebuilt_blocks * (n_disk / max(n_disk + n_cpu, 1e-9)), n_disk)
    rb_cpu = min(rebuilt_blocks - rb_disk, n_cpu)
    disk_read = (n_disk - rb_disk) * kvb + rb_disk * ckb
    cpu_read = (n_cpu - rb_cpu) * kvb + rb_cpu * ckb
    out["disk->cpu"] += disk_read
    if pl.is_cuda:
        out["cpu->compute"] += disk_read + cpu_read
    newly = range(context // bs, (context + new_tokens) // bs)  # blocks this step seals
    per = kvb + (ckb if pl.checkpoints else 0)
    for b in newly:
        if homes[b] == Tier.DISK:
            out["cpu->disk"] += per
        if homes[b] != Tier.COMPUTE and pl.is_cuda:
            out["compute->cpu"] += per
    return {k: v * spec.num_layers for k, v in out.items()}


def act_link_bytes(spec: ModelSpec, batch: int, pl: Placement, new_tokens: int) -> dict[str, int]:
    """Activations parked on the CPU cross both ways around every layer (embed, attention and
    MLP apart: FlexGen's sep_layer, and the head), only where the CPU is not compute."""
    out = dict.fromkeys(LINKS, 0)
    if pl.act_cpu and pl.is_cuda:
        n = (2 * spec.num_layers + 1) * batch * new_tokens * spec.hidden * pl.dtype_bytes
        out["compute->cpu"] = out["cpu->compute"] = n
    return out


def analytic_trace(spec: ModelSpec, batch: int, prompt_len: int, gen_len: int, pl: Placement,
                   keep: float = 1.0, rebuilt_blocks: float = 0, serial_kv: bool = False) -> list[StepTrace]:
    """The trace a run would produce, without running it: step 0 the prefill, then gen_len - 1
    decode steps. keep: share of the sealed offloaded blocks each decode step reads (1: dense;
    SparPR: its effective keep ratio); its attention reads keep x context tokens plus the new one.
    serial_kv: the decode steps' KV reads happen inside the compute (SparPR with one GPU batch)."""
    max_len, out = prompt_len + gen_len, []
    wb = weight_link_bytes(spec, pl)
    for i in range(gen_len):
        ctx, n = (0, prompt_len) if i == 0 else (prompt_len + i - 1, 1)
        kvb = kv_link_bytes(spec, batch, pl, max_len, ctx, n, keep if i else 1.0, rebuilt_blocks if i else 0)
        act = act_link_bytes(spec, batch, pl, n)
        pairs = prefill_pairs(n) if i == 0 else _read_tokens(ctx, keep, pl.block_size) + 1
        rebuilt = rebuilt_blocks * pl.block_size if i else 0
        attended = n if i == 0 else pairs
        serial = {k: int(round(kvb[k])) for k in ("disk->cpu", "cpu->compute")} if serial_kv and i else {}
        out.append(StepTrace("prefill" if i == 0 else "decode", ctx, n, batch, spec.num_layers,
                             bytes={k: int(round(wb[k] + kvb[k] + act[k])) for k in LINKS},
                             flops=step_flops(spec, batch, n, pairs, rebuilt),
                             mem_bytes=step_mem_bytes(spec, batch, attended, pl.dtype_bytes), serial_bytes=serial))
    return out


def _read_tokens(context: int, keep: float, bs: int) -> float:
    """Tokens attended of a context: the partial open block always, a keep share of the rest."""
    sealed = context // bs * bs
    return keep * sealed + (context - sealed)


# --- the trace of a real run ---
class TraceRecorder:
    """Records an engine's per-step trace: `rec = TraceRecorder(engine)` before prefill, then
    `rec.trace()` after decode. Bytes are the LinkCounters' per-step differences; FLOPs are
    counted from the spec and what each step read (a selecting policy's `stats()` steps:
    tokens_read, blocks_recomputed; otherwise the whole context)."""

    def __init__(self, engine):
        self.engine = engine
        self.spec, self.batch = engine.spec, engine.policy.batch_size
        self._raw: list[tuple[bool, int, int, dict[str, int], float, dict[str, int]]] = []
        c = engine.devices.counters
        self._last, self._last_serial = c.snapshot(), c.tagged("serial")
        engine.on_step.append(self._on_step)

    def _on_step(self, prefill: bool, st) -> None:
        c = self.engine.devices.counters
        now, serial = c.snapshot(), c.tagged("serial")
        moved = {k: now.get(k, 0) - self._last.get(k, 0) for k in LINKS}
        inside = {k: serial.get(k, 0) - self._last_serial.get(k, 0) for k in LINKS if serial.get(k, 0)}
        self._last, self._last_serial = now, serial
        i = len(st.tokens) - 1
        ctx, n = (0, st.plen) if prefill else (st.plen + i - 1, 1)
        self._raw.append((prefill, ctx, n, moved, st.step_times[-1], inside))

    def trace(self) -> list[StepTrace]:
        pol = self.engine.kv_policy
        stats = pol.stats() if hasattr(pol, "stats") else None
        by_ctx = {s["context"]: s for s in stats["steps"]} if stats else {}
        bs, out = self.engine.cfg.block_size, []
        for prefill, ctx, n, moved, secs, inside in self._raw:
            if prefill:
                pairs, rebuilt = prefill_pairs(n), 0.0
            elif ctx in by_ctx:  # per layer and sequence: the policy sums over calls and sequences
                s = by_ctx[ctx]
                per = max(1, s["calls"]) * self.engine.policy.gpu_batch_size
                pairs = s["tokens_read"] / per + 1
                rebuilt = s["blocks_recomputed"] * bs / max(1, s["calls"])
            else:
                pairs, rebuilt = ctx + 1, 0.0
            out.append(StepTrace("prefill" if prefill else "decode", ctx, n, self.batch, self.spec.num_layers,
                                 bytes=moved, flops=step_flops(self.spec, self.batch, n, pairs, rebuilt),
                                 mem_bytes=step_mem_bytes(self.spec, self.batch, n if prefill else pairs,
                                                          self.engine.dtype.itemsize), measured_s=secs,
                                 serial_bytes=inside))
        return out


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
