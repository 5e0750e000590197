"""KV policies: which blocks of a layer's cache attention reads at a decode step.

A policy is a small class registered by name. The engine asks `plan` before the query is known
(so the blocks can be prefetched while the previous batch computes); a policy that needs the
query returns None there and answers `select` at compute time instead.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .block_table import BlockTable

POLICIES: dict[str, type["KVPolicy"]] = {}


def register(name: str):
    def deco(cls):
        cls.name = name
        POLICIES[name] = cls
        return cls
    return deco


def make_policy(name: str, **kwargs) -> "KVPolicy":
    from . import policies  # noqa: F401  (registers the built-in policies)
    if name not in POLICIES:
        raise ValueError(f"unknown --kv-policy {name!r} (known: {', '.join(sorted(POLICIES))})")
    return POLICIES[name](**kwargs)


@dataclass
class Selection:
    """What one decode step of one layer reads: whole blocks (what the engine moves), and
    optionally a finer token mask over the gathered tokens, per sequence and KV head."""

    blocks: list[int]  # ascending block ids
    mask: torch.Tensor | None = None  # [B, Hkv, T] bool over the gathered tokens; None = all
    recompute: tuple[int, ...] = ()  # blocks (of `blocks`) rebuilt from hidden-state checkpoints
    seqs: torch.Tensor | None = None  # [B, len(blocks)] bool: sequences that read each block; None = all
    guess: bool = False  # chosen one layer early from the previous layer's input (engine/prefetch.py)

    @staticmethod
    def all(table: BlockTable) -> "Selection":
        return Selection(list(range(table.num_blocks)))


class KVPolicy:
    """Hooks, all optional. The new token of a step is always attended; the gathered tokens are
    the blocks' tokens in block order (table.gather's order)."""

    name = "base"
    needs_checkpoints = False  # True: the engine keeps each block's K/V-projection input
    attends = False  # True: the policy computes decode attention itself (`attend`), e.g. DKV

    def wants_checkpoints(self, table: BlockTable, hidden: int) -> bool:
        """Whether the engine should keep this table's hidden-state checkpoints (hidden: their
        width); asked once per table, after `attach`."""
        return self.needs_checkpoints

    def codec(self, block_shape: tuple[int, ...], dtype: torch.dtype, layer: int):
        """How the engine stores this policy's sealed blocks of a layer on every tier; None: the
        engine's choice (raw, or --compress-cache / --cold-codec)."""
        return None

    def prefill(self, table: BlockTable, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                valid: torch.Tensor | None) -> torch.Tensor | None:
        """Prefill attention computed by the policy (e.g. block-sparse), o: [B, H, S, D]; None:
        the engine's dense causal attention. q: [B, H, S, D]; k, v: [B, Hkv, S, D]; valid: [B, S]."""
        return None

    def attend(self, table: BlockTable, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               pads: torch.Tensor | None):
        """Only when `attends`: append the new token k, v: [B, Hkv, 1, D] and attend q: [B, H, 1, D]
        over the whole cache; returns (o: [B, H, 1, D], store jobs). pads: [B] left pads or None."""
        raise NotImplementedError

    def attach(self, table: BlockTable, layer: int) -> None:
        """Called once per new block table (hook `table.on_seal` here to keep block summaries)."""

    def on_prefill(self, table: BlockTable, layer: int, q: torch.Tensor, k: torch.Tensor,
                   valid: torch.Tensor) -> None:
        """After prefill attention. q: [B, H, S, D]; k: [B, Hkv, S, D]; valid: [B, S]."""

    def plan(self, table: BlockTable, layer: int) -> Selection | None:
        """What to read, decided before the query exists (so it can be prefetched);
        None means 'ask select once the query is known'."""
        return Selection.all(table)

    def select(self, table: BlockTable, layer: int, q: torch.Tensor) -> Selection:
        """What to read for query q: [B, H, 1, D] (called only when plan returned None)."""
        return Selection.all(table)

    def speculate(self, table: BlockTable, layer: int, q: torch.Tensor) -> Selection:
        """`select` for a guessed query (the engine's speculative prefetch): the same choice,
        with no side effects a policy keeps per step (statistics)."""
        return self.select(table, layer, q)

    def observe(self, table: BlockTable, layer: int, q: torch.Tensor, kv: torch.Tensor,
                pos: torch.Tensor, sel: Selection) -> None:
        """After decode attention. kv: [2, B, Hkv, T+1, D] read (new token last); pos: [T+1]."""

    @property
    def reads_all(self) -> bool:
        """True when every step reads the whole cache (lets a resident cache skip gathering)."""
        return type(self).plan is KVPolicy.plan and type(self).select is KVPolicy.select


@register("dense")
class Dense(KVPolicy):
    """Every block (full attention)."""
