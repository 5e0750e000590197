"""SparPR's runtime decisions from measured costs (docs/sparpr.md): the keep target a step's budget
uses (from rho, copy over recompute cost of the offloaded blocks), and, for the blocks the
selection chose, which spans are copied and which rebuilt from hidden-state checkpoints, or a
dense fallback when the sparse path costs more than gamma x the dense one.

A mixin of SparPR (whose dataclass owns the knobs it reads: keep_ratio, min_keep, gamma,
dynamic_budget, recompute, fallback, quest_only, checkpoints, costs, probe_dir). Per step and
layer it costs O(home tiers) for the budget and O(chosen offloaded blocks) for the plan; a table
that lives wholly on the compute device skips the plan (nothing moves)."""
from __future__ import annotations

import dataclasses
import itertools
import math
import weakref

import torch

from ...runtime.costs import (CostModel, cost_ratio, dtype_name, keep_target, kv_rebuild_flops, merge_spans,
                              plan_recovery, should_fall_back)
from ...storage.tiers import Tier
from ..block_table import BlockTable
from ..dkv.exact_rows import with_exact_rows
from ..policy import Selection
from .selection import StepView

CKPT_MARGIN = 2.0  # keep checkpoints while a rebuild costs < this x a copy (at start-up costs)


class CostPlan:
    """The cost-driven half of SparPR (see the module docstring)."""

    def _init_plan(self) -> None:
        self._probed = False
        self.ckpt_tables = [0, 0]  # auto: tables that kept checkpoints, tables asked
        # per table: cumulative count of blocks homed on each tier ({tier: [count of the first n]})
        self._home_counts: weakref.WeakKeyDictionary[BlockTable, dict] = weakref.WeakKeyDictionary()
        self._whole_noted: weakref.WeakKeyDictionary[BlockTable, int] = weakref.WeakKeyDictionary()  # its last whole step

    # --- costs ---
    def cost_model(self, table: BlockTable) -> CostModel:
        """The given cost model, else the start-up probe's (measured once per machine, cached)."""
        if self.costs is None or (self._probed and dtype_name(table.dtype) not in self.costs.matmul_flops):
            from ...runtime.probe import probe
            from ...utils.paths import default_cache_dir
            disk_dir = self.probe_dir or default_cache_dir()
            data = probe(table.devices.compute, [table.dtype], disk_dir)
            self.costs, self._probed = CostModel.from_probe(data, disk_dir), True
        return self.costs

    def block_costs(self, table: BlockTable, hidden: int) -> dict[Tier, tuple[float, float]]:
        """Per home tier: (copy seconds, recompute seconds) of one sealed block."""
        cm, ck = self.cost_model(table), table.checkpoints
        _, b, hkv, bs, d = table.block_shape
        flops = kv_rebuild_flops(b, bs, hidden, hkv * d)

        def ckpt_bytes(t: Tier) -> int:  # a block's checkpoints as stored on tier t
            if ck is not None:
                return ck.store.codec_of(t).nbytes
            return b * bs * hidden * (table.store.store_dtype if t != Tier.COMPUTE else table.dtype).itemsize
        return {t: (cm.copy_s(table.store.codec_of(t).nbytes, t, table.devices),
                    cm.recompute_s(ckpt_bytes(t), flops, t, table.devices, table.dtype)) for t in set(table.homes)}

    def wants_checkpoints(self, table: BlockTable, hidden: int) -> bool:
        """Keep this table's checkpoints only if, for some offloaded home tier, a rebuild costs less
        than CKPT_MARGIN x a copy at the start-up costs (room for the live bandwidth to fall below
        the probe's); else every prefill would write them (+50 % writes for OPT) for nothing."""
        if not self.needs_checkpoints:
            return False
        self.ckpt_tables[1] += 1
        keep = self.checkpoints == "always" or any(
            rec < CKPT_MARGIN * copy for tier, (copy, rec) in self.block_costs(table, hidden).items()
            if tier != Tier.COMPUTE)
        self.ckpt_tables[0] += keep
        return keep

    def offloaded(self, table: BlockTable, sealed: int) -> dict[Tier, int]:
        """Sealed blocks homed off the compute device, per tier (from counts kept per table)."""
        cum = self._home_counts.get(table)
        if cum is None:
            cum = {}
            for tier in set(table.homes) - {Tier.COMPUTE}:
                cum[tier] = [0, *itertools.accumulate(h == tier for h in table.homes)]  # host ints, no tensor
            self._home_counts[table] = cum
        return {tier: c[sealed] for tier, c in cum.items() if c[sealed]}

    @staticmethod
    def hidden_of(table: BlockTable, q: torch.Tensor) -> int:
        return table.checkpoints.block_shape[4] if table.checkpoints is not None else q.shape[1] * q.shape[3]

    # --- the budget ---
    def target_keep(self, table: BlockTable, costs: dict[Tier, tuple[float, float]] | None) -> tuple[float, float]:
        """(keep ratio of this step, rho) from the sealed offloaded blocks' costs."""
        if costs is None:
            return self.keep_ratio, math.nan
        off = self.offloaded(table, table.length // table.bs)
        rho = cost_ratio(sum(n * costs[t][0] for t, n in off.items()), sum(n * costs[t][1] for t, n in off.items()))
        return keep_target(rho, self.keep_ratio, self.min_keep), rho

    def keep_target(self, table: BlockTable, q: torch.Tensor) -> tuple[float, float]:
        if self.quest_only or not self.dynamic_budget:
            return self.keep_ratio, math.nan
        if not self.offloaded(table, table.length // table.bs):  # nothing to move: rho 0, the ceiling
            return self.keep_ratio, 0.0
        return self.target_keep(table, self.block_costs(table, self.hidden_of(table, q)))

    # --- whole steps read densely while they are measured faster (sparpr_steps.py) ---
    def plan(self, table: BlockTable, layer: int) -> Selection | None:
        """Every block, read as dense reads them, on a step the measured fallback gives to dense;
        else None (the selection needs the query)."""
        if not self.reads_step_whole(table) or self.is_dense_layer(layer):
            return None
        return Selection.all(table, dense=True)

    def reads_step_whole(self, table: BlockTable) -> bool:
        """Whether the measured fallback gave this step to dense (a resident cache then asks no plan:
        engine/cell.py `in_place`); the step's statistics for the table are noted on its first ask."""
        if not self.step_fallback or not self.step_modes.dense(table.length):
            return False
        if self._whole_noted.get(table) != table.length:
            self._whole_noted[table] = table.length
            off = self.offloaded(table, table.length // table.bs)
            n_valid = [table.length - p for p in self.host_pads(table)]
            self.step_stats.add(table, blocks_selected=table.num_blocks, copied=sum(off.values()), rebuilt=0, spans=1,
                                n_valid=n_valid, tokens_read=sum(n_valid), target=1.0, rho=math.nan,
                                sparse_s=math.nan, dense_s=math.nan, fell_back=True, est_bytes={})
        return True

    def after_step(self, length: int, seconds: float) -> None:
        if self.step_fallback:  # with a sparse step's floor: the least its offloaded blocks' reads cost
            last = self.step_stats.steps[-1] if self.step_stats.steps else None
            self.step_modes.record(length, seconds, last["dense_floor_s"] if last and last["context"] == length else None)

    # --- the plan for the chosen blocks ---
    def finish(self, table: BlockTable, layer: int, sel: Selection, pick: torch.Tensor, view: StepView,
               target: float, rho: float, q: torch.Tensor) -> Selection:
        sealed, b = view.sealed, table.block_shape[1]
        per_seq = pick if pick.dim() == 2 else pick.any(dim=1)  # per_seq: [B, nb]
        rebuild, nspans, sparse_s, dense_s, fell_back, est, moved = [], None, math.nan, math.nan, False, {}, 0
        floor_s = math.nan
        if not self.quest_only and self.offloaded(table, sealed):
            costs = self.block_costs(table, self.hidden_of(table, q))
            chosen = [i for i in sel.blocks if i < sealed]
            nseq = sel.nseq if b > 1 and sel.nseq is not None else [b] * len(chosen)
            homes, store = table.homes, table.store
            can = self.recompute and table.checkpoints is not None
            # per home tier, once: (copy s of a whole block, rebuild s, whether a copy moves only its readers' rows)
            tier = {t: (c, r if can and t != Tier.COMPUTE else math.inf, store.reads_rows_on(t))
                    for t, (c, r) in costs.items()}
            copy, rec = {}, {}
            for i, n in zip(chosen, nseq):
                c, r, rows = tier[homes[i]]
                copy[i], rec[i] = (c * n / b if rows else c), r
            moved = sum(homes[i] != Tier.COMPUTE for i in chosen)
            spans = merge_spans(chosen, homes)
            nspans = len(spans)
            rebuild, sparse_s = plan_recovery(spans, copy, rec, self.cost_model(table).span_overhead_s(table.dtype))
            off, cm = self.offloaded(table, sealed), self.cost_model(table)
            dense_s = sum(n * costs[t][0] for t, n in off.items())
            floor_s = sum(n * cm.least_copy_s(store.codec_of(t).nbytes, t, table.devices) for t, n in off.items())
            if self.fallback and should_fall_back(sparse_s, dense_s, self.gamma):
                sel, rebuild, fell_back = Selection.all(table), [], True
                moved = sum(off.values())
            else:
                est = self._est_bytes(table, chosen, rebuild, nseq)
        # nothing offloaded: spans of adjacent chosen blocks and tokens read, as the fused pick counted them,
        # or counted on the device per step
        counted = sel.counted if nspans is None and not fell_back else None
        picked = (per_seq, view.counts, view.open_tokens) if nspans is None and not fell_back and not counted else None
        read = sum(view.n_valid) if fell_back else counted[1] if counted else None if picked else \
            (view.counts * per_seq).sum() + view.open_tokens
        self.step_stats.add(table, blocks_selected=len(sel.blocks), copied=moved - len(rebuild),
                            rebuilt=len(rebuild), spans=counted[0] if counted else nspans,
                            n_valid=view.n_valid, tokens_read=read, target=target, rho=rho, sparse_s=sparse_s,
                            dense_s=dense_s, fell_back=fell_back, est_bytes=est, picked=picked, dense_floor_s=floor_s)
        if rebuild or sel.recompute:
            sel = dataclasses.replace(sel, recompute=tuple(rebuild))
        # DKV cold blocks left out are still attended on their exact rows, held on compute (nothing moves)
        return sel if fell_back else with_exact_rows(table, sel, view.valid)

    @staticmethod
    def _est_bytes(table: BlockTable, chosen: list[int], rebuild: list[int], nseq: list[int]) -> dict:
        """Estimated bytes per link of the chosen offloaded blocks (copied, or their checkpoints)."""
        store, homes, rebuilt = table.store, table.homes, set(rebuild)
        ckpt = table.checkpoints.store if rebuilt else None
        moved = dict.fromkeys((Tier.CPU, Tier.DISK), 0)
        for i, n in zip(chosen, nseq):
            home = homes[i]
            if home != Tier.COMPUTE:
                moved[home] += ckpt.codec_of(home).nbytes if i in rebuilt else (
                    store.seq_nbytes * n if store.reads_rows_on(home) else store.codec_of(home).nbytes)
        out = {"disk->cpu": moved[Tier.DISK]} if moved[Tier.DISK] else {}
        if table.devices.is_cuda and moved[Tier.CPU] + moved[Tier.DISK]:
            out["cpu->compute"] = moved[Tier.CPU] + moved[Tier.DISK]
        return out
