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

from ..errors import ConfigError
from ..models.spec import ModelSpec
from .timemodel import layer_weight_bytes


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


def stage_spec(spec: ModelSpec, num_layers: int) -> ModelSpec:
    """The spec of a stage's slice, for per-stage cost models (embeddings and head still counted:
    the cost models spread them over the layers, a small overcount for the middle stages)."""
    return dataclasses.replace(spec, num_layers=num_layers)


# --- time ---
def activation_bytes(spec: ModelSpec, rows: int, new_tokens: int, dtype_bytes: int) -> int:
    """Hidden states of one micro-batch crossing a stage boundary."""
    return rows * new_tokens * spec.hidden * dtype_bytes


def pipeline_step_s(stage_micro_s: list[float], micro_batches: int) -> float:
    """One pipeline step: the slowest stage's time per micro-batch x (M + S - 1)."""
    return max(stage_micro_s) * (micro_batches + len(stage_micro_s) - 1)


def stage_micro_s(stage_step_s: list[float], micro_batches: int, transfer_s: float) -> list[float]:
    """Each stage's time per micro-batch: its whole-batch step time / M, plus (every stage but the
    last) sending the micro-batch's hidden states on."""
    last = len(stage_step_s) - 1
    return [t / micro_batches + (transfer_s if s < last else 0.0) for s, t in enumerate(stage_step_s)]
