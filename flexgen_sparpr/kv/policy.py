"""KV policies: which blocks of a layer's cache attention reads at a decode step.

A policy is a small class registered by name. The engine asks `plan` before the query is known
(so the blocks can be prefetched while the previous batch computes); a policy that needs the
query returns None there and answers `select` at compute time instead.
"""
from __future__ import annotations

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
    if name not in POLICIES:
        raise ValueError(f"unknown --kv-policy {name!r} (known: {', '.join(sorted(POLICIES))})")
    return POLICIES[name](**kwargs)


class KVPolicy:
    name = "base"

    def attach(self, table: BlockTable, layer: int) -> None:
        """Called once per new block table (hook `table.on_seal` here to keep block summaries)."""

    def plan(self, table: BlockTable, layer: int) -> list[int] | None:
        """Blocks to read, decided before the query exists; None means 'ask select'."""
        return list(range(table.num_blocks))

    def select(self, table: BlockTable, layer: int, q: torch.Tensor) -> list[int]:
        """Blocks to read for query q: [B, H, 1, D] (called only when plan returned None)."""
        return list(range(table.num_blocks))


@register("dense")
class Dense(KVPolicy):
    """Every block (full attention)."""
