"""SparPR: query-aware block selection under a measured budget, each span copied or recomputed.

Selection by key summaries, a dynamic budget with a floor from the measured costs, recovery of
each span of selected blocks by copy or checkpoint recompute, and a dense fallback."""
from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass

import torch

from ...runtime.costs import CostModel
from ..dkv.importance import hint_sealed_blocks
from ..block_table import BlockTable
from ..knobs import KnobError, at_least, in_unit, knob, knobs, one_of
from ..policy import Selection
from .base import masked_mean_keys
from .scoring import exact_block_mass
from .selection import BlockSelectionPolicy, Room, StepView, shared_pick
from .sparpr_int4 import PackedCodes, packed_nbytes, synced_codes
from .sparpr_lowrank import (KeyBasis, compiled_block_scores, encode, encode_into, fit_basis, kernel_scores,
                             lowrank_block_scores, rank_for, summary_share)
from .sparpr_mean import summary_scores
from .sparpr_plan import CostPlan
from .sparpr_stats import StepStats
from .sparpr_steps import StepModes


HEAD_SCORES = ("sum", "softmax")
SUMMARIES = ("auto", "lowrank", "mean", "exact")
SUMMARY_HOMES = ("compute", "cpu")


@dataclass(eq=False)
class SparPR(CostPlan, BlockSelectionPolicy):
    """SparPR, "Runtime KV-Cache Recovery for Resource-Constrained LLM Inference on Consumer
    Hardware" (arXiv 2610.18140, 2026). docs/sparpr.md has the design and its reasoning.

    Selection. Every sealed block keeps a summary of its keys (via `table.on_seal`), so scoring
    reads no offloaded block: by default ("lowrank") each key's coordinates on its KV head's
    D / 2 main directions in 4 bits (sparpr_lowrank.py: 1/16 of a float16 K+V cache; a query
    scores every key as attention would and a block gets its keys' share of each head's softmax,
    summed over heads: docs/sparpr.md, "The default summary"); or ("mean") the mean key per KV
    head of each run of `summary_tokens` tokens (0: one per block) over its valid tokens, in the
    cache's dtype (1/8 of K+V at 4 tokens), on the compute device or (`summaries_on` "cpu") in
    host memory, scored there ("auto", the default: lowrank, or mean on the host). A mean run's
    score for a sequence is the sum over query heads h of f_h(q_h . summary[g(h)]), g(h) = h //
    (H / Hkv); f_h is head h's softmax over the runs (`head_score` "softmax") or the identity
    ("sum"); a block scores its best run. Each sequence always reads its sink block (the first
    holding a valid token), the last `recent_blocks` sealed blocks and the open block, and takes its
    own top-k blocks while its valid tokens fit its budget (whole blocks; all KV heads read the same
    blocks, as in the paper). The engine moves each block for the sequences that chose it only (raw
    CPU / disk blocks are read per sequence; encoded ones move whole); each sequence's mask keeps it
    to its own blocks. `per_sequence=False` chooses one set for the batch (sequences take turns by rank).

    Study knobs: `summary` "exact" scores on the keys themselves, `per_head` lets each KV head
    pick its own blocks (docs/fidelity.md, "What bounds keep 0.1").

    Budget. A block's copy cost is codec.nbytes (K and V: the 2 is in it; the share of the
    sequences reading it, where the block is read per sequence) over the measured bandwidth of its
    home tier's link to compute; its recompute cost is its checkpoint's bytes over that bandwidth
    plus B * bs * hidden * 2 kv_dim * 2 FLOP over the measured matmul FLOP/s. rho = copy /
    recompute over the step's offloaded sealed blocks maps to the keep ratio keep_ratio **
    max(1, rho) (runtime/costs.py `keep_target`), bounded below by `min_keep` and above by
    `keep_ratio`. Costs come from runtime/probe.py, refreshed from the engine's timed disk reads.

    Recovery. Selected blocks merge into spans (adjacent ids, one home tier); each span is copied or
    rebuilt from its checkpoints (Selection.recompute), whichever costs less. When the sparse path
    costs more than `gamma` x the dense path (every block, copied), the step reads everything.
    `quest_only`: the selection alone (no dynamic budget, recompute or fallback); `stats()` reports every step.
    """

    name = "sparpr"
    # the paper's two settings are 0.5 and 0.1; 0.5 is the default ceiling (docs/sparpr.md, "Default keep")
    keep_ratio: float = knob(0.5, "KV budget: fraction of the context's tokens a decode step reads")
    min_keep: float = knob(0.1, "Minimum Keep Floor: the least fraction of the context the dynamic budget "
                           "keeps (--keep-ratio is the ceiling)")
    gamma: float = knob(0.9, "Dense Fallback Threshold: read everything when the sparse path costs more "
                        "than gamma x the dense path")
    recent_blocks: int = knob(1, "newest sealed blocks every step reads (besides the sink and the open block)")
    dynamic_budget: bool = knob(True, "ablation: always keep --keep-ratio (no cost-driven budget)")
    recompute: bool = knob(True, "ablation: copy every selected block (no checkpoint recompute)")
    fallback: bool = knob(True, "ablation: never fall back to dense")
    step_fallback: bool = knob(True, "ablation: no measured step fallback (by default sparse and dense decode "
                               "steps are timed and whole steps run dense while sparse ones cost more than "
                               "gamma x dense ones)")
    quest_only: bool = knob(False, "ablation: query-aware selection alone, copy only (no dynamic budget, "
                            "recompute or fallback)")
    head_score: str = knob("softmax", "how the query heads' q . summary add up to a block's score (block_scores)",
                           choices=HEAD_SCORES)
    summary: str = knob("auto", "what scores blocks: every key in 4 bits on its KV head's main directions "
                        "(lowrank) or a mean key per --summary-tokens tokens (mean); auto: lowrank, or mean "
                        "with --summaries-on cpu; exact (study: the keys themselves, every block read "
                        "to score: the ceiling of any summary)", choices=SUMMARIES)
    summary_rank: float = knob(0.5, "lowrank summaries: directions kept, as a share of the head dim "
                               "(the summaries are this / 4 / dtype bytes of the K+V cache: 1/16 at 0.5 in float16)")
    summary_tokens: int = knob(4, "mean summaries: tokens per mean key (per KV head); divides --block-size; "
                               "0: one per block")
    summaries_on: str = knob("compute", "where the mean summaries live and are scored: on the compute device, "
                             "or in host memory (cpu: none of the device's memory; each layer's query goes "
                             "to the host and its block scores come back)", choices=SUMMARY_HOMES)
    per_sequence: bool = knob(True, "one block set for the whole batch instead of each sequence its own top-k")
    per_head: bool = knob(False, "study: each KV head its own top-k blocks (the step moves their union: more "
                          "bytes than the budget); default one set for every head, as in the paper")
    checkpoints: str = knob("auto", "keep hidden-state checkpoints always, or (auto) only where the measured "
                            "costs say a rebuild can pay", choices=("auto", "always"))
    costs: CostModel | None = None  # None: measured by the start-up probe
    probe_dir: str | None = None  # folder whose disk bandwidth is probed (the offload dir)

    def __post_init__(self):
        super().__post_init__()
        in_unit(self, "min_keep")
        if self.min_keep > self.keep_ratio:  # the floor above the ceiling would be clamped: refuse it
            raise KnobError("min_keep", f"{self.min_keep} is above --keep-ratio {self.keep_ratio} (the budget's "
                            "floor above its ceiling)")
        in_unit(self, "gamma")
        one_of(self, "head_score", HEAD_SCORES)
        one_of(self, "summary", SUMMARIES)
        in_unit(self, "summary_rank")
        at_least(self, "summary_tokens", 0)
        one_of(self, "summaries_on", SUMMARY_HOMES)
        if self.summary == "auto":  # the low-rank keys where they can live; the means on the host
            self.summary = "lowrank" if self.summaries_on == "compute" else "mean"
        if self.lowrank and self.summaries_on != "compute":
            raise KnobError("summaries_on", "host summaries are the mean ones (--summary mean); the low-rank "
                            "codes stay on the compute device")
        one_of(self, "checkpoints", ("auto", "always"))
        if self.per_head and (not self.per_sequence or self.summary == "mean" or self.head_score != "softmax"):
            raise KnobError("per_head", "needs each sequence's own pick and the lowrank or exact summary's softmax")
        at_least(self, "recent_blocks", 0)
        if self.quest_only:  # the selection stage alone: the runtime decisions are off
            self.dynamic_budget = self.recompute = self.fallback = False
        if not self.fallback:  # --no-fallback: never dense, per layer or per step
            self.step_fallback = False
        self.needs_checkpoints = self.recompute
        self._init_plan()
        self.step_stats = StepStats()
        self.step_modes = StepModes(self.gamma)
        self._basis: weakref.WeakKeyDictionary[BlockTable, KeyBasis] = weakref.WeakKeyDictionary()
        self._packed: weakref.WeakKeyDictionary[BlockTable, PackedCodes] = weakref.WeakKeyDictionary()

    @property
    def lowrank(self) -> bool:  # "exact" keeps the default's low-rank codes too (its memory), scoring on the keys
        return self.summary in ("lowrank", "exact")

    @property
    def summary_axes(self) -> tuple[int, ...]:  # where each summary tensor keeps its block axis (empty_summaries)
        return (3,) if self.lowrank else (2, 1)

    # --- facts ---
    def check_block_size(self, block_size: int) -> None:
        if 0 < self.summary_tokens < block_size and block_size % self.summary_tokens:
            raise KnobError("summary_tokens", f"must be 0 or divide --block-size {block_size} "
                            f"(got {self.summary_tokens})")

    def _summary_share(self, block_size: int, dtype_bytes: int) -> float:
        """The summaries' bytes per raw K+V byte. lowrank: summary_rank / (4 dtype_bytes) (an upper
        bound: the rank rounds down; the basis is left out); mean: 1 / (2 summary_tokens)."""
        st = self.summary_tokens
        return summary_share(self.summary_rank, dtype_bytes) if self.lowrank else \
            (1 if not st or st >= block_size else block_size // st) / (2 * block_size)

    def resident_share(self, block_size: int, dtype_bytes: int, cold=None) -> float:
        """The summaries on the compute device (none with summaries_on "cpu"); with a cold codec,
        plus each cold block's exact rows kept there (a block left out is still attended on them)."""
        share = 0.0 if self.summaries_on == "cpu" else self._summary_share(block_size, dtype_bytes)
        return share + (cold.exact_rows_share(block_size) if cold is not None else 0.0)

    def host_share(self, block_size: int, dtype_bytes: int) -> float:
        return self._summary_share(block_size, dtype_bytes) if self.summaries_on == "cpu" else 0.0

    def for_machine(self, hardware=None, disk_dir: str | None = None) -> "SparPR":
        """Costs from the hardware file when given (replacing a probe folder), else the disk tier's
        folder for the start-up probe; knobs given explicitly win."""
        if hardware is not None and self.costs is None:
            return dataclasses.replace(self, costs=CostModel.from_hardware(hardware), probe_dir=None)
        if disk_dir is not None and self.costs is None and self.probe_dir is None:
            return dataclasses.replace(self, probe_dir=disk_dir)
        return self

    # --- what every step reads ---
    def floor(self, table: BlockTable) -> int:
        return table.bs * (1 + self.recent_blocks) + table.length % table.bs

    def mandatory(self, table: BlockTable, budget: int) -> tuple[int, int]:
        bs, length = table.bs, table.length
        pads = self.host_pads(table)
        first = min(min(bs - p % bs, length - p) for p in pads)  # the sink block's valid tokens
        last = min(self.recent_blocks * bs + length % bs, min(length - p for p in pads))
        return first, last

    # --- summaries, sequence-major (scoring a prefix of blocks reads a view). lowrank: codes [B, Hkv,
    # r / 2, num_blocks, bs] uint8, tokens innermost (+ the table's KeyBasis); mean: the mean key of each run of summary_tokens
    # valid tokens [B, Hkv, num_blocks, P, D] in the cache dtype, and which runs hold one, live [B, num_blocks, P]

    def attach(self, table: BlockTable, layer: int) -> None:
        if table not in self._sums:
            table.store.hold_exact_rows = True  # DKV cold blocks: their exact rows also stay on compute (select)
            if not self.quest_only:
                self.cost_model(table)  # start-up: probe (or read the cache) before the first step
        super().attach(table, layer)

    def empty_summaries(self, table: BlockTable) -> tuple[torch.Tensor, ...]:
        _, b, hkv, bs, d = table.block_shape
        parts, nb, dev = self.parts(table), table.capacity // bs, self.summary_device(table)
        if self.lowrank:
            return (torch.zeros(b, hkv, rank_for(d, self.summary_rank) // 2, nb, bs, dtype=torch.uint8, device=dev),)
        mean = torch.zeros(b, hkv, nb, parts, d, dtype=table.dtype, device=dev)  # the cache's dtype: half the bytes
        return mean, torch.zeros(b, nb, parts, dtype=torch.bool, device=dev)

    def summarise(self, table: BlockTable, keys: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.lowrank:  # keys: [B, Hkv, n, bs, D]; the basis from the first keys summarised unless fitted
            basis = self._basis.get(table)
            if basis is None:
                basis = self._basis[table] = fit_basis(keys.flatten(2, 3), valid.flatten(1, 2),
                                                       rank_for(keys.shape[-1], self.summary_rank))
            codes = encode(keys.flatten(2, 3), basis).unflatten(2, keys.shape[2:4])  # [B, Hkv, n, bs, r / 2]
            return (codes.permute(2, 0, 1, 4, 3),)  # codes: [n, B, Hkv, r / 2, bs] (tokens innermost)
        return masked_mean_keys(keys, valid, self.parts(table))  # mean: [n, B, Hkv, P, D]; live: [n, B, P]

    def seal_in_place(self, table: BlockTable, parts: tuple[torch.Tensor, ...], block: int, keys: torch.Tensor) -> bool:
        basis = self._basis.get(table) if self.lowrank else None  # no basis yet: summarise fits one
        return basis is not None and encode_into(parts[0], block, keys, basis)

    def on_prefill(self, table: BlockTable, layer: int, q, k, valid) -> None:
        if self.lowrank and table.length == k.shape[2]:  # a prefill into an empty table: fit on all of it
            self._basis[table] = fit_basis(k.float(), valid, rank_for(k.shape[-1], self.summary_rank))
        super().on_prefill(table, layer, q, k, valid)  # (re)summarises the prefill's blocks
        hint_sealed_blocks(table, q, k, valid)  # DKV cold blocks with a query-aware residual pick

    def summary_device(self, table: BlockTable) -> torch.device:
        """Where this table's summaries live and are scored (--summaries-on)."""
        return table.devices.compute if self.summaries_on == "compute" else torch.device("cpu")

    def parts(self, table: BlockTable) -> int:
        """Mean summaries per block: bs / summary_tokens (1 when summary_tokens is 0)."""
        if self.lowrank or not self.summary_tokens or self.summary_tokens >= table.bs:
            return 1
        if table.bs % self.summary_tokens:
            raise ValueError(f"summary_tokens {self.summary_tokens} does not divide the block size {table.bs}")
        return table.bs // self.summary_tokens

    # --- the step (plan: sparpr_plan.py) ---
    def own_blocks(self, table: BlockTable, counts: torch.Tensor) -> torch.Tensor:
        """[B, nb]: each sequence's sink block (the first holding a valid token) and the recent ones."""
        sealed = counts.shape[1]
        ids = torch.arange(sealed, device=counts.device)
        sink = ids[None, :] == (self.pads(table) // table.bs)[:, None]  # sink: [B, nb]
        return sink | (ids >= sealed - self.recent_blocks)[None, :]

    def pick(self, table: BlockTable, score: torch.Tensor, view: StepView, room: Room) -> torch.Tensor:
        """per_sequence: each its own best blocks while they fit (Quest's rule; picks_top). Else one set for
        the batch, taking turns by rank while every budget holds (an ablation: a host loop)."""
        return super().pick(table, score, view, room) if self.per_sequence else shared_pick(score, view, room)

    def picks_top(self) -> bool:
        return self.per_sequence and not self.per_head

    def block_scores(self, table: BlockTable, layer: int, q: torch.Tensor, view: StepView) -> torch.Tensor:
        """[B, nb] (per_head: [B, Hkv, nb]): each sealed block's score for each sequence."""
        if self.summary == "exact":
            return exact_block_mass(table, q, view.sealed, view.pad_bias, view.live, self.per_head)
        if not self.lowrank:
            return summary_scores(table, q, self.summaries(table, layer), self.head_score)
        whole = self.summaries(table, layer, whole=True)[0]  # whole: [B, Hkv, r / 2, nb, bs], every block's
        if not self.per_head and kernel_scores(q, whole, self.head_score):  # one compiled call reads them as they lie
            return compiled_block_scores(q, whole, view.sealed, table.bs, self._basis[table], view.pad_bias, view.live)
        codes = whole[:, :, :, :view.sealed].flatten(3)  # codes: [B, Hkv, r / 2, T], a view
        return lowrank_block_scores(q, codes, self._basis[table], table.bs, self.head_score, view.pad_bias, view.live,
                                    synced_codes(self._packed, table, codes), False, self.per_head)

    def summary_bytes(self, table: BlockTable, on_host: bool = False) -> int:
        """Bytes of the table's summaries (every block's) on the compute device, with the low-rank
        basis, or (on_host) in host memory under --summaries-on cpu; 0 where they are not."""
        if table not in self._sums or (self.summaries_on == "compute") == on_host:
            return 0
        basis = None if on_host else self._basis.get(table)
        return sum(t.numel() * t.element_size() for t in self._sums[table].parts) + (basis.nbytes if basis else 0) + \
            (0 if on_host else packed_nbytes(self._packed.get(table)))

    def host_summary_bytes(self, table: BlockTable) -> int:
        return self.summary_bytes(table, on_host=True)

    def speculate(self, table: BlockTable, layer: int, q: torch.Tensor) -> Selection:
        """select, leaving the per-step statistics to the exact selection that follows."""
        kept, self.step_stats = self.step_stats, StepStats()
        try:
            return self.select(table, layer, q)
        finally:
            self.step_stats = kept

    def stats(self) -> dict:
        """JSON-able: the knobs, the cost model, totals and one record per decode step."""
        config = {k.name: getattr(self, k.name) for k in knobs(type(self))}
        return {"policy": self.name, "config": config,
                "costs": self.costs.to_dict() if self.costs is not None else None,
                "checkpoint_tables": {"kept": self.ckpt_tables[0], "asked": self.ckpt_tables[1]},
                "step_fallback": self.step_modes.report(),
                **self.step_stats.report()}
