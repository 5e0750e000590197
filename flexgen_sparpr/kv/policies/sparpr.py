"""SparPR: query-aware key-block selection, a measured dynamic budget with a floor, recovery of
each span of selected blocks by copy or checkpoint recompute, and a dense fallback."""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

from ...runtime.costs import (CostModel, cost_ratio, dtype_name, keep_target, kv_rebuild_flops,
                              merge_spans, plan_recovery, should_fall_back)
from ...storage.tiers import Tier
from ..dkv.codec import DKVCodec
from ..dkv.exact_rows import with_exact_rows
from ..dkv.importance import hint_sealed_blocks
from ..block_table import BlockTable
from ..policy import Selection, register
from .base import BudgetPolicy, masked_mean_keys, selection_from_tokens, token_budget
from .sparpr_stats import StepStats, readers


@dataclass(eq=False)
class _Summaries:
    # sequence-major, so that scoring a prefix of blocks reads a view, not a copy
    mean: torch.Tensor  # [B, Hkv, num_blocks, P, D] cache dtype: mean key of each part of a sealed block
    live: torch.Tensor  # [B, num_blocks, P] bool: the part holds a valid token
    known: list[bool]
    pads: torch.Tensor | None = None  # [B] left pads, once the prefill was seen

    def put(self, ids, mean: torch.Tensor, live: torch.Tensor) -> None:
        """Blocks `ids` (a slice or list) from masked_mean_keys' mean [n, B, Hkv, P, D], live [n, B, P]."""
        self.mean[:, :, ids] = mean.permute(1, 2, 0, 3, 4).to(self.mean.dtype)
        self.live[:, ids] = live.permute(1, 0, 2)


CKPT_MARGIN = 2.0  # keep checkpoints while a rebuild costs < this x a copy (at start-up costs)


HEAD_SCORES = ("sum", "softmax")


def block_scores(q: torch.Tensor, summ: torch.Tensor, live: torch.Tensor, head_score: str = "sum") -> torch.Tensor:
    """q: [B, H, 1, D]; summ: [B, Hkv, nb, P, D]; live: [B, nb, P] -> [B, nb] (-inf: no valid token).

    A part's score is the sum over query heads h of f_h(q_h . summ[g(h)]), g(h) = h // (H / Hkv);
    a block scores its best part (P = 1: the block's own mean). "sum": f is the identity.
    "softmax": f_h is head h's softmax over all parts (logits scaled by 1/sqrt(D), as attention's
    are), so each head adds one unit of mass and a head with large logits cannot outvote the
    others; still a sum over heads of a monotone function of each head's inner products."""
    b, h, _, d = q.shape
    _, hkv, nb, parts, _ = summ.shape
    live = live.reshape(b, nb * parts)  # live: [B, nb * P]
    summ = summ.reshape(b, hkv, nb * parts, d)  # summ: [B, Hkv, nb * P, D] (a view of a block prefix)
    qs = q.to(summ.dtype)  # products in the summaries' dtype, summed in float32 (no copy of them)
    if head_score == "sum":  # sum_h q_h . s_g(h) = sum_g (sum of g's query heads) . s_g
        qg = qs.view(b, hkv, h // hkv, d).sum(dim=2)  # qg: [B, Hkv, D]
        part = torch.einsum("bgd,bgnd->bn", qg, summ).float()  # part: [B, nb * P]
    else:
        per = torch.einsum("bgjd,bgnd->bgjn", qs.view(b, hkv, h // hkv, d), summ).float()  # [B, Hkv, G, nb * P]
        per = (per / math.sqrt(d)).masked_fill(~live[:, None, None], -math.inf)
        part = per.softmax(dim=-1).sum(dim=(1, 2))  # part: [B, nb * P]
    return part.masked_fill(~live, -math.inf).view(b, nb, parts).amax(dim=-1)  # [B, nb]


@register("sparpr")
@dataclass(eq=False)
class SparPR(BudgetPolicy):
    """SparPR, "Runtime KV-Cache Recovery for Resource-Constrained LLM Inference on Consumer
    Hardware" (arXiv 2610.18140, 2026). docs/sparpr.md has the design and its reasoning.

    Selection. Every sealed block keeps the mean key per KV head of each run of `summary_tokens`
    tokens (default 4; 0: one mean per block) over its valid tokens, on the compute device (via
    `table.on_seal`), so scoring reads no offloaded block. A run's score for a sequence is the sum
    over query heads h of f_h(q_h . summary[g(h)]), g(h) = h // (H / Hkv) (under GQA each query
    head meets its own KV head's summary); f_h is head h's softmax over the runs (`head_score`
    "softmax", default) or the identity ("sum"); a block scores its best run. Each sequence always
    reads its sink block (the first holding a valid token), the last `recent_blocks` sealed blocks
    and the open block, and takes its own top-k blocks while its valid tokens fit its budget
    (whole blocks; all KV heads read the same blocks, as in the paper). The engine moves each
    block for the sequences that chose it only (raw CPU / disk blocks are read per sequence;
    encoded ones move whole); each sequence's mask keeps it to its own blocks. `per_sequence=False`
    chooses one set for the batch instead (the sequences take turns by rank).

    Budget. A block's copy cost is codec.nbytes (K and V: the 2 is in it; the share of the
    sequences reading it, where the block is read per sequence) over the measured
    bandwidth of its home tier's link to compute; its recompute cost is its checkpoint's bytes
    over that bandwidth plus B * bs * hidden * 2 kv_dim * 2 FLOP over the measured matmul FLOP/s.
    rho = copy / recompute over the step's offloaded sealed blocks maps to the keep ratio
    keep_ratio ** max(1, rho) (runtime/costs.py `keep_target`), bounded below by `min_keep` and
    above by `keep_ratio`. Costs come from runtime/probe.py, refreshed from the engine's own
    timed disk reads.

    Recovery. Selected blocks merge into spans (adjacent ids, one home tier); each span is
    copied or rebuilt from its checkpoints (Selection.recompute), whichever costs less. When the
    sparse path's cost exceeds `gamma` x the dense path's (every block, copied), the step reads
    everything. `quest_only` keeps the selection alone (no dynamic budget, recompute or
    fallback); `stats()` reports every decode step.
    """

    min_keep: float = 0.1
    gamma: float = 0.9
    recent_blocks: int = 1
    dynamic_budget: bool = True
    recompute: bool = True
    fallback: bool = True
    quest_only: bool = False
    head_score: str = "softmax"  # how heads' q . summary add up (block_scores)
    summary_tokens: int = 4  # tokens per summary (divides the block size); 0 or >= block size: one per block
    per_sequence: bool = True  # each sequence its own top-k (the union moves); False: one set per batch
    checkpoints: str = "auto"  # auto: only where a rebuild can pay (CKPT_MARGIN); always
    costs: CostModel | None = None  # None: measured by the start-up probe
    probe_dir: str | None = None  # folder whose disk bandwidth is probed (the offload dir)

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.min_keep <= 1:
            raise ValueError(f"min_keep must be in (0, 1] (got {self.min_keep})")
        if not 0 < self.gamma <= 1:
            raise ValueError(f"gamma must be in (0, 1] (got {self.gamma})")
        if self.head_score not in HEAD_SCORES:
            raise ValueError(f"head_score must be one of {', '.join(HEAD_SCORES)} (got {self.head_score!r})")
        if self.summary_tokens < 0:
            raise ValueError(f"summary_tokens must be >= 0 (got {self.summary_tokens})")
        if self.checkpoints not in ("auto", "always"):
            raise ValueError(f"checkpoints must be auto or always (got {self.checkpoints!r})")
        if self.recent_blocks < 0:
            raise ValueError(f"recent_blocks must be >= 0 (got {self.recent_blocks})")
        if self.quest_only:  # the selection stage alone: the three runtime decisions are off
            self.dynamic_budget = self.recompute = self.fallback = False
        self.needs_checkpoints = self.recompute
        self._probed = False
        self._sums: weakref.WeakKeyDictionary[BlockTable, _Summaries] = weakref.WeakKeyDictionary()
        self.step_stats = StepStats()
        self.ckpt_tables = [0, 0]  # auto: tables that kept checkpoints, tables asked

    # --- what every step reads ---
    def floor(self, table: BlockTable) -> int:
        return table.bs * (1 + self.recent_blocks) + table.length % table.bs

    def mandatory(self, table: BlockTable, budget: int) -> tuple[int, int]:
        bs, length = table.bs, table.length
        pads = self.pads(table).tolist()
        first = min(min(bs - p % bs, length - p) for p in pads)  # the sink block's valid tokens
        last = min(self.recent_blocks * bs + length % bs, min(length - p for p in pads))
        return first, last

    # --- costs ---
    def cost_model(self, table: BlockTable) -> CostModel:
        """The given cost model, else the start-up probe's (measured once per machine, cached)."""
        if self.costs is None or (self._probed and dtype_name(table.dtype) not in self.costs.matmul_flops):
            from ...runtime.probe import probe
            from ...weights.prepare import default_cache_dir
            disk_dir = self.probe_dir or default_cache_dir()
            data = probe(table.devices.compute, [table.dtype], disk_dir)
            self.costs, self._probed = CostModel.from_probe(data, disk_dir), True
        return self.costs

    def block_costs(self, table: BlockTable, hidden: int) -> dict[Tier, tuple[float, float]]:
        """Per home tier: (copy seconds, recompute seconds) of one sealed block."""
        cm, ck = self.cost_model(table), table.checkpoints
        _, b, hkv, bs, d = table.block_shape
        ckpt_bytes = ck.codec.nbytes if ck is not None else b * bs * hidden * table.dtype.itemsize
        flops = kv_rebuild_flops(b, bs, hidden, hkv * d)
        return {t: (cm.copy_s(table.codec.nbytes, t, table.devices),
                    cm.recompute_s(ckpt_bytes, flops, t, table.devices, table.dtype)) for t in set(table.homes)}

    def wants_checkpoints(self, table: BlockTable, hidden: int) -> bool:
        """Keep this table's checkpoints only if a rebuild can pay: for some offloaded home tier,
        rebuilding a block costs less than CKPT_MARGIN x copying it at the start-up costs (the
        margin leaves room for the live bandwidth to fall below the probe's). Otherwise every
        prefill would write them (+50 % prefill writes for OPT) for nothing."""
        if not self.needs_checkpoints:
            return False
        self.ckpt_tables[1] += 1
        keep = self.checkpoints == "always" or any(
            rec < CKPT_MARGIN * copy for tier, (copy, rec) in self.block_costs(table, hidden).items()
            if tier != Tier.COMPUTE)
        self.ckpt_tables[0] += keep
        return keep

    # --- summaries ---
    def attach(self, table: BlockTable, layer: int) -> None:
        if table in self._sums:  # attached twice (engine policy and observer): one hook
            return
        table.keep_exact_rows = True  # DKV cold blocks: their exact rows also stay on compute (select)
        if isinstance(table.codec, DKVCodec):  # the sink block, read at every step, stays exact too
            table.exact_first = max(table.exact_first, 1)
        if not self.quest_only:
            self.cost_model(table)  # start-up: probe (or read the cache) before the first step
        _, b, hkv, bs, d = table.block_shape
        parts, nb, dev = self.parts(table), table.capacity // bs, table.devices.compute
        mean = torch.zeros(b, hkv, nb, parts, d, dtype=table.dtype, device=dev)  # the cache's dtype: half the bytes
        sums = self._sums[table] = _Summaries(mean,
                                              torch.zeros(b, nb, parts, dtype=torch.bool, device=dev), [False] * nb)
        ref = weakref.ref(sums)  # the table holds the hook; the hook must not hold the table

        def on_seal(block: int, kv: torch.Tensor) -> None:
            s = ref()
            if s is None:
                return
            keys = kv[0].float()[:, :, None]  # keys: [B, Hkv, 1, bs, D]
            if s.pads is None:  # mid-prefill: on_prefill redoes these blocks with the padding known
                valid = torch.ones(b, 1, bs, dtype=torch.bool, device=keys.device)
            else:
                pos = block * bs + torch.arange(bs, device=keys.device)
                valid = (pos[None, :] >= s.pads[:, None])[:, None]  # valid: [B, 1, bs]
            mean, live = masked_mean_keys(keys, valid, parts)
            s.put(slice(block, block + 1), mean, live)
            s.known[block] = True
        table.on_seal.append(on_seal)

    def on_prefill(self, table: BlockTable, layer: int, q, k, valid) -> None:
        super().on_prefill(table, layer, q, k, valid)
        hint_sealed_blocks(table, q, k, valid)  # DKV cold blocks with a query-aware residual pick
        if table not in self._sums:
            self.attach(table, layer)
        s, bs = self._sums[table], table.bs
        s.pads = self.pads(table)
        sealed = table.length // bs
        if sealed and table.length == k.shape[2]:  # a prefill into an empty table: exact means
            keys = k[:, :, :sealed * bs].float().unflatten(2, (sealed, bs))  # keys: [B, Hkv, n, bs, D]
            s.put(slice(0, sealed), *masked_mean_keys(
                keys, valid[:, :sealed * bs].unflatten(1, (sealed, bs)), self.parts(table)))
            s.known[:sealed] = [True] * sealed

    def parts(self, table: BlockTable) -> int:
        """Summaries per block: bs / summary_tokens (1 when summary_tokens is 0)."""
        if not self.summary_tokens or self.summary_tokens >= table.bs:
            return 1
        if table.bs % self.summary_tokens:
            raise ValueError(f"summary_tokens {self.summary_tokens} does not divide the block size {table.bs}")
        return table.bs // self.summary_tokens

    def summaries(self, table: BlockTable, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean [sealed, B, Hkv, P, D], live [sealed, B, P]); blocks sealed before this policy was
        attached are summarised once, from the cache (the only time SparPR reads an offloaded
        block to score it)."""
        if table not in self._sums:
            self.attach(table, layer)
        s, bs, sealed = self._sums[table], table.bs, table.length // table.bs
        missing = [i for i in range(sealed) if not s.known[i]]
        if missing:
            kv, pos = table.gather(missing)
            keys = kv[0].float().unflatten(2, (len(missing), bs))  # keys: [B, Hkv, m, bs, D]
            valid = pos.view(len(missing), bs)[None] >= self.pads(table)[:, None, None]  # [B, m, bs]
            s.put(missing, *masked_mean_keys(keys, valid, self.parts(table)))
            for i in missing:
                s.known[i] = True
        return s.mean[:, :, :sealed], s.live[:, :sealed]

    # --- the step ---
    def plan(self, table: BlockTable, layer: int) -> Selection | None:
        return None  # the selection needs the query

    def target_keep(self, table: BlockTable, costs: dict[Tier, tuple[float, float]] | None) -> tuple[float, float]:
        """(keep ratio of this step, rho) from the sealed offloaded blocks' costs."""
        if costs is None:
            return self.keep_ratio, math.nan
        off = [costs[table.homes[i]] for i in range(table.length // table.bs) if table.homes[i] != Tier.COMPUTE]
        rho = cost_ratio(sum(c for c, _ in off), sum(r for _, r in off))
        return keep_target(rho, self.keep_ratio, self.min_keep), rho

    def top_k(self, table: BlockTable, layer: int, q: torch.Tensor, budgets: list[int]) -> torch.Tensor:
        """[B, L] bool: the cached tokens each sequence reads (the same for all its KV heads).

        Each sequence reads its sink, the recent window, the open block and (per_sequence) its own
        best blocks while its valid tokens fit its budget; the engine moves each block for the
        sequences that chose it. With
        per_sequence=False one set serves the batch: the sequences take turns (by rank) adding
        their next-best block while every sequence's valid tokens still fit its budget, and every
        sequence reads every chosen block. With one sequence the two are the same plain top-k."""
        b = q.shape[0]
        bs, length = table.bs, table.length
        sealed = length // bs
        valid = self.valid_tokens(table)  # valid: [B, L]
        counts = valid[:, :sealed * bs].view(b, sealed, bs).sum(dim=2)  # counts: [B, nb]
        score = block_scores(q, *self.summaries(table, layer), self.head_score)  # score: [B, nb]
        ids = torch.arange(sealed, device=q.device)
        sink = ids[None, :] == (self.pads(table) // bs)[:, None]  # sink: [B, nb]
        own = sink | (ids >= sealed - self.recent_blocks)[None, :]  # own: [B, nb] always read
        used = (counts * own).sum(dim=1) + valid[:, sealed * bs:].sum(dim=1)  # used: [B] tokens
        if self.per_sequence:  # each its own best blocks while they fit (Quest's rule, one set per sequence)
            order = score.masked_fill(own, -math.inf).argsort(dim=-1, descending=True)  # order: [B, nb]
            taken = (counts * ~own).gather(-1, order).cumsum(dim=-1)  # taken: [B, nb]
            room = torch.tensor(budgets, device=q.device) - used
            fits = (taken <= room[:, None]) & (score.masked_fill(own, -math.inf).gather(-1, order) > -math.inf)
            pick = own | torch.zeros_like(fits).scatter_(-1, order, fits)
            keep = torch.ones(b, length, dtype=torch.bool, device=q.device)  # the open block
            keep[:, :sealed * bs] = pick.repeat_interleave(bs, dim=-1)
            return keep & valid
        cand = ~own.all(dim=0) & (counts > 0).any(dim=0)  # cand: [nb] (another's sink may be one)
        ranked = score.masked_fill(~cand[None, :], -math.inf).argsort(dim=-1, descending=True)
        ranked = ranked[:, :int(cand.sum())].T.tolist()  # [rank][sequence] -> block id
        used = used.tolist()
        cnt, picked = (counts * ~own).T.tolist(), {}  # what a block adds to each sequence's reads
        for blk in (blk for row in ranked for blk in row):  # rank 0 of every sequence, then rank 1...
            if blk not in picked and all(u + c <= m for u, c, m in zip(used, cnt[blk], budgets)):
                picked[blk] = True
                used = [u + c for u, c in zip(used, cnt[blk])]
        pick = own.clone()
        pick[:, list(picked)] = True
        keep = torch.ones(b, length, dtype=torch.bool, device=q.device)  # the open block
        keep[:, :sealed * bs] = pick.repeat_interleave(bs, dim=-1)
        return keep & valid

    def select(self, table: BlockTable, layer: int, q: torch.Tensor) -> Selection:
        sealed, hkv = table.length // table.bs, table.block_shape[2]
        hidden = table.checkpoints.block_shape[4] if table.checkpoints is not None else q.shape[1] * q.shape[3]
        costs = None if self.quest_only else self.block_costs(table, hidden)
        target, rho = self.target_keep(table, costs if self.dynamic_budget else None)
        n_valid = self.valid_tokens(table).sum(dim=1).tolist()
        budgets = [token_budget(target, n, self.floor(table)) for n in n_valid]
        keep = self.top_k(table, layer, q, budgets)  # keep: [B, L]
        sel = selection_from_tokens(table, keep[:, None, :].expand(-1, hkv, -1))  # mask: [B, Hkv, T]
        rebuild, spans, sparse_s, dense_s, fell_back, nseq = [], [], math.nan, math.nan, False, None
        if costs is not None:
            copy = [costs[table.homes[i]][0] for i in range(sealed)]
            nseq, b = readers(table, sel), table.block_shape[1]
            part = [c * table.read_bytes(i, nseq.get(i, b)) / table.read_bytes(i, b) for i, c in enumerate(copy)]
            can = self.recompute and table.checkpoints is not None
            rec = [costs[t][1] if can and t != Tier.COMPUTE else math.inf for t in table.homes[:sealed]]
            spans = merge_spans([i for i in sel.blocks if i < sealed], table.homes)
            rebuild, sparse_s = plan_recovery(spans, part, rec, self.cost_model(table).span_overhead_s(table.dtype))
            dense_s = sum(copy)
            if self.fallback and should_fall_back(sparse_s, dense_s, self.gamma):
                sel, rebuild, fell_back = Selection.all(table), [], True
        self.step_stats.add(table, sel, rebuild, spans=len(spans), n_valid=n_valid, target=target, rho=rho,
                            sparse_s=sparse_s, dense_s=dense_s, fell_back=fell_back,
                            nseq=None if fell_back else nseq)
        sel = Selection(sel.blocks, sel.mask, recompute=tuple(rebuild), seqs=sel.seqs)
        # DKV cold blocks left out are still attended on their exact rows, held on compute (nothing moves)
        return sel if fell_back else with_exact_rows(table, sel, self.valid_tokens(table))

    def speculate(self, table: BlockTable, layer: int, q: torch.Tensor) -> Selection:
        """select, leaving the per-step statistics to the exact selection that follows."""
        kept, self.step_stats = self.step_stats, StepStats()
        try:
            return self.select(table, layer, q)
        finally:
            self.step_stats = kept

    def stats(self) -> dict:
        """JSON-able: the knobs, the cost model, totals and one record per decode step."""
        config = {k: getattr(self, k) for k in ("keep_ratio", "min_keep", "gamma", "recent_blocks", "dynamic_budget",
                                                "recompute", "fallback", "quest_only", "head_score",
                                                "per_sequence", "summary_tokens", "checkpoints")}
        return {"policy": self.name, "config": config,
                "costs": self.costs.to_dict() if self.costs is not None else None,
                "checkpoint_tables": {"kept": self.ckpt_tables[0], "asked": self.ckpt_tables[1]},
                **self.step_stats.report()}
