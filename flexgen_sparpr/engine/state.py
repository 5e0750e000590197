"""Where a generation stands: what decode needs to go on, what it returns, and a snapshot
that lets one prefill serve several decodes."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from .sampling import Sampler


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated ids per sequence (prompt excluded)
    step_times: list[float]  # wall seconds per generated token; [0] is prefill
    logits: list[torch.Tensor] = field(default_factory=list)  # per step [B, V], if kept
    step_parts: list[dict] = field(default_factory=list)  # per step: seconds per part (engine/step_clock.py)


@dataclass
class GenState:
    """Where a generation stands: everything decode needs to go on."""

    plen: int
    max_new: int
    pads: torch.Tensor  # [B] left-pad counts
    sampler: Sampler
    keep_logits: bool
    done: torch.Tensor  # [B] bool
    tokens: list[torch.Tensor] = field(default_factory=list)  # per step [B]
    step_times: list[float] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    step_parts: list[dict] = field(default_factory=list)

    def result(self) -> GenerationResult:
        return GenerationResult(tokens=torch.stack(self.tokens, dim=1).tolist(), step_times=list(self.step_times),
                                logits=list(self.logits), step_parts=list(self.step_parts))


@dataclass
class Snapshot:
    """A state and its tables' marks (e.g. right after prefill): several decodes start from it."""

    state: GenState
    tables: dict

    @classmethod
    @torch.inference_mode()
    def take(cls, st: GenState, tables: dict) -> "Snapshot":
        return cls(copy.deepcopy(st), {key: t.mark() for key, t in tables.items()})

    @torch.inference_mode()
    def restore(self, tables: dict) -> GenState:
        """Rewind the tables to the marks; a fresh copy of the state."""
        for key, t in tables.items():
            t.rewind(self.tables[key])
        return copy.deepcopy(self.state)
