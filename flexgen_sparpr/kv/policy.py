"""KV policies: which blocks of a layer's cache attention reads at a decode step.

A policy is a dataclass whose fields are its knobs (kv/knobs.py), in its own file under
kv/policies/ (which registers it by name). The engine asks `plan` before the query is known (so
the blocks can be prefetched while the previous batch computes); a policy that needs the query
returns None there and answers `select` at compute time instead. What the engine, the CLI and
the placement need to know about a policy are methods here, never a test of its name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..storage.tiers import Tier
from .block_table import BlockTable


@dataclass
class Selection:
    """What one decode step of one layer reads: whole blocks (what the engine moves), and
    optionally a finer token mask over the gathered tokens, per sequence and KV head."""

    blocks: list[int]  # ascending block ids
    mask: torch.Tensor | None = None  # [B, Hkv, T] bool over the gathered tokens; None = all
    recompute: tuple[int, ...] = ()  # blocks (of `blocks`) rebuilt from hidden-state checkpoints
    # [B, len(blocks)] bool, a host tensor (the store branches on it): sequences that read each block; None = all
    seqs: torch.Tensor | None = None
    guess: bool = False  # chosen one layer early from the previous layer's input (engine/prefetch.py)
    # [B, T] cache positions each sequence reads, in its own row (a resident cache's batch: attention
    # then costs each sequence its own tokens, not the union's); mask is then aligned to rows, and
    # blocks / seqs still name the union (what the statistics count). None: the union layout.
    rows: torch.Tensor | None = None
    nseq: list[int] | None = None  # [n sealed picked blocks] sequences reading each, on the host (None: not counted)
    dense: bool = False  # every block, read as a dense step reads them (SparPR's measured step fallback)
    counted: tuple[int, int] | None = None  # (spans, tokens read), counted where the pick was made (fused_pick.py)
    # [1|B, T+1]: rows with the step's new token's position after them, where the pick made room for it
    # (fused_pick.py; rows is then a view of it): attention after the append reads it, nothing concatenated
    next_rows: torch.Tensor | None = None

    @staticmethod
    def all(table: BlockTable, dense: bool = False) -> "Selection":
        return Selection(list(range(table.num_blocks)), dense=dense)


ARENA_SLACK = 1.25  # an offloaded table's arena holds this x its largest selection (engine/recall.py)


class KVPolicy:
    """Hooks, all optional. The new token of a step is always attended; the gathered tokens are
    the blocks' tokens in block order (table.gather's order)."""

    name: ClassVar[str] = "base"  # --kv-policy NAME; a class with its own name under kv/policies/ is registered
    knob_prefix: ClassVar[str] = ""  # prefix of its knobs' flags (dkv: --dkv-rank)
    needs_checkpoints = False  # True: the engine keeps each block's K/V-projection input
    attends = False  # True: the policy computes decode attention itself (`attend`), e.g. DKV
    # False: its per-table state covers every cached token (H2O's scores), so a cache cut back to a
    # shared prefix (engine/prefix_cache.py) cannot go on under it: such prompts are prefilled whole
    reuses_prefix = True

    # --- facts the engine, the CLI and the placement search ask ---
    @classmethod
    def matrix_knobs(cls, keep: float) -> dict:
        """Knobs the test matrix (tests/kv/test_policies.py) runs this policy with on 2-layer tiny
        models so that it reads about `keep` of the context (keep 1: what dense attention reads)."""
        return {}

    def check_block_size(self, block_size: int) -> None:
        """Refuse (KnobError) knobs that do not fit the KV block size; checked once by the CLI."""

    def check_width(self, width: int) -> None:
        """Refuse (KnobError) knobs that do not fit a token's K|V row of `width` values; checked
        once the model is known."""

    def read_share(self) -> float:
        """Share of the cached tokens a decode step reads (the placement's estimate)."""
        return 1.0

    def arena_share(self, cold: "KVPolicy | None" = None) -> float:
        """Share of an offloaded cache's raw K+V (in the compute dtype) each table keeps on the
        compute device of what it read (engine/recall.py): a selective policy's, ARENA_SLACK x its
        read share, unless it observes what attention read (H2O), attends itself (DKV) or a cold
        codec stores the blocks (their exact rows are read in place)."""
        if self.reads_all or self.observes or self.attends or cold is not None:
            return 0.0
        return min(1.0, ARENA_SLACK * self.read_share())

    def resident_share(self, block_size: int, dtype_bytes: int, cold: "KVPolicy | None" = None) -> float:
        """What the policy keeps on the compute device per cached token, wherever the cache lives,
        as a share of the raw K+V (2 kv_dim values of dtype_bytes a token). cold: the policy whose
        codec stores the CPU and disk blocks (--cold-codec), if any."""
        return 0.0

    def host_share(self, block_size: int, dtype_bytes: int) -> float:
        """What the policy keeps in host memory per cached token besides the cache, as a share of
        the raw K+V (e.g. SparPR's summaries with --summaries-on cpu)."""
        return 0.0

    def exact_rows_share(self, block_size: int) -> float:
        """A codec policy: share of each encoded block's rows its codec keeps exact (those a
        selecting policy can attend on the compute device without moving the block)."""
        return 0.0

    @property
    def has_codec(self) -> bool:
        """Whether the policy stores blocks in its own form (`codec`)."""
        return type(self).codec is not KVPolicy.codec

    @property
    def is_full_attention(self) -> bool:
        """Plain attention over every raw cached token: nothing selected, attended or encoded
        by the policy (the default policy)."""
        return self.reads_all and not self.attends and not self.has_codec

    def for_machine(self, hardware=None, disk_dir: str | None = None) -> "KVPolicy":
        """This policy for a machine: a hardware file (runtime/hardware.py), else the folder of
        the disk tier a start-up probe may measure. Policies without a cost model ignore both."""
        return self

    def stats(self) -> dict | None:
        """JSON-able statistics of the decode steps (--output-json's kv_policy_stats), or None."""
        return None

    def wants_checkpoints(self, table: BlockTable, hidden: int) -> bool:
        """Whether the engine should keep this table's hidden-state checkpoints (hidden: their
        width); asked once per table, after `attach`."""
        return self.needs_checkpoints

    def raw_copies(self, layer: int) -> "Tier | None":
        """The tier on which the engine also keeps every block of a layer raw, besides the form
        `codec` stores (BlockTable.raw_copies: DKV's exact routed blocks), or None: no copies."""
        return None

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

    def reads_step_whole(self, table: BlockTable) -> bool:
        """Whether this decode step reads the table whole, as the dense policy does (a policy that
        gives some steps to dense: SparPR's measured step fallback); a resident cache is then
        attended where it lies, with no plan or selection asked."""
        return False

    def after_step(self, length: int, seconds: float) -> None:
        """A decode step at this context length (tokens cached before its input) took `seconds`."""

    def speculate(self, table: BlockTable, layer: int, q: torch.Tensor) -> Selection:
        """`select` for a guessed query (the engine's speculative prefetch): the same choice,
        with no side effects a policy keeps per step (statistics)."""
        return self.select(table, layer, q)

    def observe(self, table: BlockTable, layer: int, q: torch.Tensor, kv: torch.Tensor,
                pos: torch.Tensor, sel: Selection) -> None:
        """After decode attention. kv: [2, B, Hkv, T+1, D] read (new token last); pos: [T+1]."""

    @property
    def observes(self) -> bool:
        """True when the policy looks at what decode attention read (`observe`), e.g. H2O."""
        return type(self).observe is not KVPolicy.observe

    @property
    def reads_all(self) -> bool:
        """True when every step reads the whole cache (lets a resident cache skip gathering)."""
        return type(self).plan is KVPolicy.plan and type(self).select is KVPolicy.select

    @property
    def plans_ahead(self) -> bool:
        """True when what a decode step reads is a function of the cache alone (every block, as
        dense reads; no per-step state, no own attention): a read planned while one step ends then
        stands for the next step's first layers, so the disk need not idle between steps
        (engine/prefetch.py CacheReads.further)."""
        return self.reads_all and not self.attends and not self.observes
