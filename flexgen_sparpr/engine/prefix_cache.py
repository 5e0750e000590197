"""Prefix reuse, the bookkeeping: finished one-sequence generations kept with their KV tables and
found again by the content hash of whole blocks of their tokens (vLLM's automatic prefix caching,
at this engine's grain: a kept generation's tables are taken whole, cut back to the prefix they
share with the new prompt, and the prompt's rest is prefilled onto them; engine/reuse.py).

Block j's hash covers every token of blocks 0..j (a chain), so equal hashes mean equal prefixes.
The tables stay on whichever tiers their blocks live (disk included). Kept bytes are bounded per
tier (`limit_bytes` on each of compute, CPU and disk); past the bound the least recently used
generation is closed (its memory and offload files freed). Pure bookkeeping: no tensor math.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from ..storage.tiers import Tier


def block_hashes(ids: list[int], block_size: int) -> list[bytes]:
    """The chain hash of each whole block of ids (a partial last block has none)."""
    out, h = [], b""
    for j in range(len(ids) // block_size):
        h = hashlib.blake2b(h + array("q", ids[j * block_size:(j + 1) * block_size]).tobytes(),
                            digest_size=16).digest()
        out.append(h)
    return out


@dataclass(eq=False)
class Kept:
    """One kept generation: the tokens its cache holds, in order, and its tables (one sequence)."""

    ids: list[int]
    tables: dict  # {(layer, batch): BlockTable}
    policy: object  # the KV policy attached to them (its per-table state goes with them)
    run_policy: object  # the placement they were made under (a batch of one)
    capacity: int  # tokens they hold at most
    held: dict = field(default_factory=dict)  # Tier -> bytes
    hashes: list[bytes] = field(default_factory=list)

    def close(self) -> None:
        for t in self.tables.values():
            t.close()
        self.tables = {}


@dataclass
class Hit:
    kept: Kept
    tokens: int  # prompt tokens already in its cache


@dataclass
class PrefixStats:
    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0  # prompt tokens not computed again
    computed_tokens: int = 0  # prompt tokens computed (misses and the rest of a hit)
    evictions: int = 0
    reuse_read_bytes: int = 0  # bytes moved off the CPU and disk tiers while prefilling onto a kept cache


class PrefixCache:
    """limit_bytes: bytes kept per tier (None: no bound; 0: keep nothing)."""

    def __init__(self, block_size: int, limit_bytes: int | None):
        self.bs, self.limit = block_size, limit_bytes
        self._kept: OrderedDict[int, Kept] = OrderedDict()  # least recently used first
        self._index: dict[bytes, set[int]] = {}
        self.stats = PrefixStats()

    @property
    def enabled(self) -> bool:
        return self.limit is None or self.limit > 0

    def __len__(self) -> int:
        return len(self._kept)

    def kept(self) -> list[Kept]:
        """The kept generations, least recently used first."""
        return list(self._kept.values())

    def held(self) -> dict[Tier, int]:
        out = dict.fromkeys(Tier, 0)
        for k in self._kept.values():
            for tier, n in k.held.items():
                out[tier] += n
        return out

    def lookup(self, ids: list[int], policy, need: int, count: bool = True) -> Hit | None:
        """The kept generation under `policy` sharing the longest prefix with ids (found by whole
        blocks, then matched on token by token), at most len(ids) - 1 tokens (the last prompt token is computed: its logits give the first
        answer token), whose tables hold `need` tokens; None when none shares a block. count: add it
        to the stats (False: a scheduler's look ahead)."""
        self.stats.lookups += count
        best, best_n, alive = None, 0, None
        for j, h in enumerate(block_hashes(ids[:len(ids) - 1], self.bs)):
            here = {i for i in self._index.get(h, ()) if self._usable(i, policy, need)}
            alive = here if alive is None else alive & here
            if not alive:
                break
            best, best_n = next(iter(alive)), j + 1
        if best is None:
            return None
        kept, n = self._kept[best], best_n * self.bs
        end = min(len(ids) - 1, len(kept.ids))
        while n < end and kept.ids[n] == ids[n]:  # on into the next block, token by token
            n += 1
        return Hit(kept, n)

    def _usable(self, key: int, policy, need: int) -> bool:
        k = self._kept[key]
        return k.policy is policy and k.capacity >= need

    def take(self, kept: Kept) -> Kept:
        """Remove a kept generation to run on (it comes back through put when done)."""
        key = id(kept)
        del self._kept[key]
        for h in kept.hashes:
            self._index[h].discard(key)
            if not self._index[h]:
                del self._index[h]
        return kept

    def put(self, kept: Kept) -> None:
        """Keep a finished generation (closed at once when the cache is off or it alone is past the
        bound), then close the least recently used ones until every tier is within the bound."""
        if not self.enabled or (self.limit is not None and any(n > self.limit for n in kept.held.values())):
            kept.close()
            return
        kept.hashes = block_hashes(kept.ids, self.bs)
        key = id(kept)
        self._kept[key] = kept
        for h in kept.hashes:
            self._index.setdefault(h, set()).add(key)
        self.put_bound()

    def put_bound(self) -> None:
        """Close the least recently used kept generations until every tier is within the bound."""
        while self._kept and self.limit is not None and any(n > self.limit for n in self.held().values()):
            self._evict(next(iter(self._kept.values())))

    def drop_on(self, tier: Tier) -> None:
        """Close every kept generation holding bytes on a tier (the compute device's memory is the
        running batch's first)."""
        for kept in [k for k in self._kept.values() if k.held.get(tier)]:
            self._evict(kept)

    def _evict(self, kept: Kept) -> None:
        self.take(kept).close()
        self.stats.evictions += 1

    def close(self) -> None:
        for kept in list(self._kept.values()):
            self.take(kept).close()
