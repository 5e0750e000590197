"""A run's trace for the time model (runtime/timemodel.py): one `StepTrace` per generated token (the
prefill is step 0), the bytes that crossed each link and the FLOPs of each op, either recorded
from a real run (`TraceRecorder`: the engine's link counters after every step, FLOPs counted from
the ModelSpec and what each step read) or built analytically from a `Placement` (`analytic_trace`)
for models too big to run here."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..models.spec import ModelSpec
from ..storage.tiers import Tier, block_homes, split_by_percent

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
