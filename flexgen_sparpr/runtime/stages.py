"""Pipeline stages: how a model's layers split over ranks, and what a pipeline step costs.

A split gives each stage a contiguous run of decoder layers; the first stage also holds the
embeddings and the last the LM head. By default the split is even by weight bytes (water-filling:
each layer goes to the stage holding the fewest bytes so far, which for identical layers is the
most even split there is). The time of a pipeline step (FlexGen's dist_flex_opt schedule, one
step drained before the next because the token ids of every sequence come back from the last
stage): with M micro-batches and S stages, each stage spends t_s on a micro-batch (its compute
and I/O, plus sending the micro-batch's hidden states on at the interconnect's bandwidth), and

    step = max_s t_s x (M + S - 1)

the slowest stage's whole batch (M x max t_s) times (M + S - 1) / M: the fill and drain bubble.
`--policy auto` with a world size (`choose_stages`) and the time model (`predict_pipeline`) use it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import ConfigError, NoPlacementFits
from ..models.spec import ModelSpec
from .hardware import Hardware
from .placement import DTYPE_BYTES, Workload, candidates
from .trace import layer_weight_bytes


@dataclass(frozen=True)
class StageSplit:
    """Decoder layers per stage, in order (stage s runs the next counts[s] layers)."""

    counts: tuple[int, ...]

    def __post_init__(self):
        if not self.counts or min(self.counts) < 1:
            raise ValueError(f"every stage needs at least one layer (got {self.counts})")

    @property
    def num_stages(self) -> int:
        return len(self.counts)

    def first_layer(self, stage: int) -> int:
        return sum(self.counts[:stage])

    def layers(self, stage: int) -> range:
        start = self.first_layer(stage)
        return range(start, start + self.counts[stage])

    def describe(self) -> str:
        return ",".join(map(str, self.counts))


def embed_params(spec: ModelSpec) -> int:
    """Parameters the first stage holds beside its layers: token (and OPT's position) embeddings."""
    n = spec.vocab * spec.embed_dim
    if spec.arch == "opt":
        n += (spec.max_pos + 2) * spec.hidden + (spec.hidden * spec.embed_dim if spec.word_embed_dim else 0)
    return n


def head_params(spec: ModelSpec) -> int:
    """Parameters the last stage holds beside its layers: the LM head (its own copy of a tied
    embedding when it is not the first stage) and the final norm."""
    return spec.vocab * spec.embed_dim + (spec.hidden * spec.embed_dim if spec.word_embed_dim else 0) + 2 * spec.hidden


def stage_params(spec: ModelSpec, split: StageSplit, stage: int) -> int:
    """Parameters stage `stage` holds."""
    n = split.counts[stage] * sum(layer_weight_bytes(spec, 1))
    n += embed_params(spec) if stage == 0 else 0
    return n + (head_params(spec) if stage == split.num_stages - 1 else 0)


def check_stages(spec: ModelSpec, stages: int) -> None:
    if stages < 1:
        raise ConfigError(f"a pipeline needs at least one stage (got {stages})")
    if stages > spec.num_layers:
        raise ConfigError(f"{stages} pipeline stages for {spec.name}'s {spec.num_layers} layers: every stage needs "
                          f"at least one layer (use a world size of at most {spec.num_layers})")


def even_by_bytes(spec: ModelSpec, stages: int) -> StageSplit:
    """The split whose largest stage holds the fewest weight bytes."""
    check_stages(spec, stages)
    per_layer = sum(layer_weight_bytes(spec, 1))
    extra = [0] * stages
    extra[0] += embed_params(spec)
    extra[-1] += head_params(spec)
    counts = [1] * stages
    for _ in range(spec.num_layers - stages):
        s = min(range(stages), key=lambda i: (extra[i] + counts[i] * per_layer, i))
        counts[s] += 1
    return StageSplit(tuple(counts))


def parse_stage_layers(text: str, spec: ModelSpec, stages: int) -> StageSplit:
    """--stage-layers a,b,...: decoder layers per stage, one number per rank, summing to the model's."""
    check_stages(spec, stages)
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--stage-layers takes comma-separated layer counts, one per rank (got {text!r})") from None
    if len(counts) != stages:
        raise ConfigError(f"--stage-layers gives {len(counts)} stages for a world size of {stages}")
    if min(counts) < 1 or sum(counts) != spec.num_layers:
        raise ConfigError(f"--stage-layers {text}: every stage needs >= 1 layer and they must sum to "
                          f"{spec.name}'s {spec.num_layers} layers")
    return StageSplit(counts)


def stage_spec(spec: ModelSpec, num_layers: int, first: bool = True, last: bool = True) -> ModelSpec:
    """The spec of what one stage holds, for the cost models and the capacity check (not for the
    engine): its layers, the embeddings only on the first stage and the head only on the last
    (a middle stage keeps a one-token vocabulary; a stage's tied table is counted once)."""
    if first and last:
        return dataclasses.replace(spec, num_layers=num_layers)
    return dataclasses.replace(spec, num_layers=num_layers, vocab=spec.vocab if first or last else 1,
                               tie_embeddings=True)


# --- time ---
def activation_bytes(hidden: int, rows: int, new_tokens: int, dtype_bytes: int) -> int:
    """Hidden states of one micro-batch (rows sequences, new_tokens each) crossing a stage boundary."""
    return rows * new_tokens * hidden * dtype_bytes


def pipeline_step_s(stage_micro_s: list[float], micro_batches: int) -> float:
    """One pipeline step: the slowest stage's time per micro-batch x (M + S - 1)."""
    return max(stage_micro_s) * (micro_batches + len(stage_micro_s) - 1)


def stage_micro_s(stage_step_s: list[float], micro_batches: int, transfer_s: float) -> list[float]:
    """Each stage's time per micro-batch: its whole-batch step time / M, plus (every stage but the
    last) sending the micro-batch's hidden states on."""
    last = len(stage_step_s) - 1
    return [t / micro_batches + (transfer_s if s < last else 0.0) for s, t in enumerate(stage_step_s)]


# --- --policy auto with a world size ---
@dataclass(frozen=True)
class StagePlan:
    """A chosen split and each stage's placement (--percent), with the predicted pipeline times
    (seconds); the batch split and the micro-batches are the run's."""

    split: StageSplit
    percents: tuple[tuple[int, ...], ...]
    gpu_batch_size: int
    num_gpu_batches: int
    micro_batches: int
    prefill_s: float
    decode_step_s: float
    total_s: float
    stage_decode_s: tuple[float, ...]  # each stage's time per micro-batch of a decode step
    bottleneck: str  # the slowest stage of a decode step and its slowest resource

    @property
    def percent(self) -> tuple[int, ...]:
        return self.percents[0]

    def per_token_s(self, gen_len: int) -> float:
        return self.total_s / gen_len

    def describe(self, gen_len: int) -> str:
        pct = "; ".join(f"stage {s}: {' '.join(map(str, p))}" for s, p in enumerate(self.percents))
        return (f"--stage-layers {self.split.describe()}, --percent per stage ({pct}), {self.micro_batches} "
                f"micro-batches; predicted {self.per_token_s(gen_len):.4f} s/token (prefill {self.prefill_s:.3f} s, "
                f"decode step {self.decode_step_s:.4f} s, bound by {self.bottleneck})")


def _best(plans: list[dict]) -> dict | None:
    """placement.choose's pick among one split's candidates."""
    def key(pl):
        pct = pl["percent"]
        return (round(pl["total_s"], 9), -(pct[0] + pct[2]), -(pct[1] + pct[3]), -pct[4])
    return min(plans, key=key) if plans else None


def choose_stages(wl: Workload, hw: Hardware, stages: int, micro_batches: int, gpu_batch_size: int,
                  step: int = 5, window: int = 3) -> StagePlan:
    """The split into `stages` and each stage's placement with the fastest predicted run, for the
    workload's whole batch in GPU batches of gpu_batch_size, run as `micro_batches` micro-batches.

    A stage is scored by placement.candidates on what it holds (stage_spec), streaming its
    offloaded weights once per micro-batch; its time per micro-batch is its whole-batch time / M
    plus sending a micro-batch's hidden states at hw's interconnect_GBps (not counted when the file
    gives none). The first and last stages' layer counts are searched within `window` of the even
    split by bytes, the middle stages share the rest evenly. NoPlacementFits when a stage fits nowhere."""
    spec, B, M = wl.spec, wl.batch_size, micro_batches
    check_stages(spec, stages)
    if B % gpu_batch_size or (B // gpu_batch_size) % M:
        raise ValueError(f"batch {B} is not {M} micro-batches of GPU batches of {gpu_batch_size}")
    split = (gpu_batch_size, B // gpu_batch_size)
    b = DTYPE_BYTES[wl.dtype]
    bw = hw.interconnect_bw
    xfer_pre = activation_bytes(spec.hidden, B // M, wl.prompt_len, b) / bw if bw > 0 else 0.0
    xfer_dec = activation_bytes(spec.hidden, B // M, 1, b) / bw if bw > 0 else 0.0
    scored: dict[tuple[int, bool, bool], dict | None] = {}

    def stage(n: int, first: bool, last: bool) -> dict | None:
        key = (n, first, last)
        if key not in scored:
            sw = dataclasses.replace(wl, spec=stage_spec(spec, n, first, last), weight_passes=M)
            scored[key] = _best(candidates(sw, hw, step, split))
        return scored[key]

    L, even = spec.num_layers, even_by_bytes(spec, stages).counts
    options = []
    firsts = range(max(1, even[0] - window), even[0] + window + 1)
    lasts = range(max(1, even[-1] - window), even[-1] + window + 1) if stages > 1 else [0]
    for n0 in firsts:
        for nl in lasts:
            rest, mid = L - n0 - nl, stages - 2
            if stages == 1:
                counts = (L,) if n0 == even[0] else None
            elif mid == 0:
                counts = (n0, nl) if rest == 0 else None
            else:
                counts = tuple([n0] + [rest // mid + (i < rest % mid) for i in range(mid)] + [nl]) \
                    if rest >= mid else None
            if counts is None:
                continue
            plans = [stage(n, s == 0, s == stages - 1) for s, n in enumerate(counts)]
            if any(p is None for p in plans):
                continue
            pre = stage_micro_s([p["prefill_s"] for p in plans], M, xfer_pre)
            dec = stage_micro_s([p["decode_step_s"] for p in plans], M, xfer_dec)
            pre_s, dec_s = pipeline_step_s(pre, M), pipeline_step_s(dec, M)
            total = pre_s + (wl.gen_len - 1) * dec_s
            spread = max(counts) - min(counts)
            options.append((round(total, 9), spread, counts, plans, pre_s, dec_s, dec))
    if not options:
        raise NoPlacementFits(f"no split of {spec.name} over {stages} stages fits {hw.name}'s memory and disk "
                              f"(batch {B}, {wl.prompt_len}+{wl.gen_len} tokens, {wl.dtype})")
    total, _, counts, plans, pre_s, dec_s, dec = min(options, key=lambda o: o[:2])
    slow = max(range(stages), key=lambda s: dec[s])
    return StagePlan(StageSplit(counts), tuple(tuple(p["percent"]) for p in plans), gpu_batch_size, split[1], M,
                     pre_s, dec_s, total, tuple(dec), f"stage {slow}'s {plans[slow]['bottleneck']}")
