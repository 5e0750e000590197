"""Where a whole-cache read of a partly offloaded table lies (engine/cell.py `resident_split`): its
sealed raw blocks homed on the compute tier (attended in place in the arena), its raw disk blocks
(read as stored into a landing buffer and attended there), and the rest (the open block and blocks
of other homes: gathered, or the open block read where it is filled). Worked out once per table and
block count, not per layer and step: the per-block Python had cost ~50 us a layer at 2k tokens."""
from __future__ import annotations

import weakref
from typing import NamedTuple

from ..kv.block_table import BlockTable
from ..storage.tiers import Tier


class SplitPlan(NamedTuple):
    resident: list[int]  # sealed raw blocks in the compute arena
    land: list[int]  # sealed raw disk blocks, landed as read
    rest: list[int]  # every other block, ascending


class SplitPlans:
    """Each table's SplitPlan for its current blocks, kept until a block seals or a rewind."""

    def __init__(self):
        self._plans: weakref.WeakKeyDictionary[BlockTable, tuple[tuple, SplitPlan]] = weakref.WeakKeyDictionary()

    def of(self, t: BlockTable) -> SplitPlan:
        key = (t.sealed, t.num_blocks, t.rewinds)
        got = self._plans.get(t)
        if got is None or got[0] != key:
            got = self._plans[t] = (key, _plan(t))
        return got[1]


def _plan(t: BlockTable) -> SplitPlan:
    store, sealed, homes = t.store, t.sealed, t.homes
    resident = [] if Tier.COMPUTE in store.coded else [b for b in range(sealed) if homes[b] == Tier.COMPUTE]
    land = [b for b in range(sealed) if homes[b] == Tier.DISK] if store.lands_disk() else []
    skip = set(resident) | set(land)
    return SplitPlan(resident, land, [b for b in range(t.num_blocks) if b not in skip])
