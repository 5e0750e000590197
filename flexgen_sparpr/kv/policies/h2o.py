"""H2O: heavy hitters (most attended tokens so far) plus a recent window; the rest is evicted."""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

from ..block_table import BlockTable
from ..knobs import in_unit, knob
from ..policy import Selection
from .base import BudgetPolicy, recent_mask, selection_from_tokens


@dataclass(eq=False)
class _State:
    prefill: torch.Tensor  # [B, Hkv, capacity] attention received during prefill
    score: torch.Tensor | None = None  # [B, Hkv, capacity] prefill + every decode step so far
    evicted: torch.Tensor | None = None  # [B, Hkv, capacity] bool, for good
    planned: int = -1  # table.length at the last plan
    observed: bool = False  # observe ran since that plan
    sel: Selection | None = None


def prefill_column_sums(q: torch.Tensor, k: torch.Tensor, valid: torch.Tensor,
                        max_elems: int = 1 << 24) -> torch.Tensor:
    """Attention each key receives in prefill, summed over valid queries and a KV head's query
    heads. q: [B, H, S, D]; k: [B, Hkv, S, D]; valid: [B, S] (left padding) -> [B, Hkv, S] float32.

    A chunk of queries at a time, each against only the keys it can see, so memory stays near
    `max_elems` floats even at 8k tokens; the row normalisation is folded into a matmul
    (col = sum_q e_qk / Z_q = (1/Z)^T E), so the big score tile is only exponentiated in place."""
    b, h, s, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    qg = q.unflatten(1, (hkv, g))  # qg: [B, Hkv, G, S, D] (a view even of transposed heads)
    kf = k.reshape(b * hkv, s, d).float()
    pads = (~valid).sum(dim=1).tolist()
    col = torch.zeros(b * hkv, 1, s, dtype=torch.float32, device=q.device)
    chunk = max(1, max_elems // max(1, b * h * s))
    for i0 in range(0, s, chunk):
        i1 = min(s, i0 + chunk)
        c = i1 - i0
        qc = qg[:, :, :, i0:i1].reshape(b * hkv, g * c, d).float()  # qc: [B*Hkv, G*c, D]
        e = torch.bmm(qc, kf[:, :i1].transpose(1, 2)).mul_(1 / math.sqrt(d))  # e: [B*Hkv, G*c, i1]
        tile = e.view(b * hkv, g, c, i1)
        future = torch.ones(c, c, dtype=torch.bool, device=q.device).triu_(1)
        tile[..., i0:i1].masked_fill_(future, float("-inf"))  # causal: only the diagonal square
        for bi, p in enumerate(pads):
            if p:
                e[bi * hkv:(bi + 1) * hkv, :, :min(p, i1)] = float("-inf")
        e.sub_(e.amax(dim=-1, keepdim=True).clamp_min(-1e30)).exp_()  # all-pad rows -> 0
        z = e.sum(dim=-1)  # z: [B*Hkv, G*c]
        w = valid[:, i0:i1].float().repeat_interleave(hkv, dim=0).repeat(1, g)  # w: [B*Hkv, G*c]
        w = w / z.clamp_min(1e-30)  # pad queries weigh 0
        col[:, :, :i1] += torch.bmm(w[:, None, :], e)
    return col.view(b, hkv, s)


@dataclass(eq=False)
class H2O(BudgetPolicy):
    """Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
    Language Models" (NeurIPS 2023).

    Every token's score is the attention it has received, summed over the prefill's queries and
    every decode step's query, and over the query heads of its KV head. A step keeps, per
    sequence and KV head, the `recent` newest tokens (budget - heavy, heavy = floor(budget *
    heavy_fraction)) and the `heavy` highest-scoring older tokens that were never evicted; every
    other token is evicted for good. The choice uses only past attention, so `plan` answers it
    (prefetchable). Token level within blocks: a block moves if any sequence or head keeps a
    token in it, and the mask gives each head its own tokens. The open last block is treated like
    any other. Scores of a decode step come from recomputing its softmax in `observe` (one query).
    A rewind to the prefill snapshot (Engine.restore) is detected and restarts from the prefill
    scores; snapshots taken after decode steps are not supported.
    """

    name = "h2o"
    reuses_prefix = False  # its scores cover every cached token
    heavy_fraction: float = knob(0.5, "share of the budget given to the heavy hitters (the rest: recent tokens)")
    prefill_chunk_elems: int = 1 << 24  # floats per chunk of the prefill statistics

    def __post_init__(self):
        super().__post_init__()
        in_unit(self, "heavy_fraction", zero=True)
        self._state: weakref.WeakKeyDictionary[BlockTable, _State] = weakref.WeakKeyDictionary()

    def split(self, budget: int) -> tuple[int, int]:
        """(heavy, recent) token counts of a budget."""
        heavy = int(budget * self.heavy_fraction)
        return heavy, budget - heavy

    def mandatory(self, table: BlockTable, budget: int) -> tuple[int, int]:
        return 0, self.split(budget)[1]

    def on_prefill(self, table: BlockTable, layer: int, q, k, valid) -> None:
        super().on_prefill(table, layer, q, k, valid)
        b, hkv, s, _ = k.shape
        prefill = torch.zeros(b, hkv, table.capacity, dtype=torch.float32, device=k.device)
        prefill[..., :s] = prefill_column_sums(q, k, valid, self.prefill_chunk_elems)
        self._state[table] = _State(prefill)  # set, not added: a second call is harmless

    def adopt_prefill(self, other: "H2O", tables) -> None:
        """Take another H2O's prefill statistics for these tables (they depend on no knob), so
        several budgets can share one O(S^2) pass."""
        for t in tables:
            if t in other._state:
                self._pads[t] = other.pads(t)
                self._state[t] = _State(other._state[t].prefill)  # read-only: _live clones it

    def _live(self, table: BlockTable) -> _State:
        st = self._state.get(table)
        if st is None:  # attached after the prefill: no statistics, start from zero
            b, hkv = table.block_shape[1:3]
            st = self._state[table] = _State(torch.zeros(b, hkv, table.capacity, device=table.devices.compute))
        if st.score is None or table.length < st.planned or (table.length == st.planned and st.observed):
            st.score, st.evicted = st.prefill.clone(), torch.zeros_like(st.prefill, dtype=torch.bool)
            st.planned, st.sel = -1, None
        return st

    def plan(self, table: BlockTable, layer: int) -> Selection:
        st = self._live(table)
        length = table.length
        if st.planned == length and st.sel is not None:  # asked twice for one step
            return st.sel
        valid = self.valid_tokens(table)  # valid: [B, L]
        parts = [self.split(n) for n in self.budgets(table)]
        recent = recent_mask(valid, [r for _, r in parts])[:, None, :]  # recent: [B, 1, L]
        alive = valid[:, None, :] & ~st.evicted[..., :length] & ~recent  # alive: [B, Hkv, L]
        score = st.score[..., :length].masked_fill(~alive, float("-inf"))
        heavy_set = torch.zeros_like(alive)
        for b, (heavy, _) in enumerate(parts):
            if heavy:
                top = score[b].topk(heavy, dim=-1)  # top: [Hkv, heavy]
                heavy_set[b].scatter_(-1, top.indices, top.values > float("-inf"))
        keep = recent | heavy_set  # keep: [B, Hkv, L]
        st.evicted[..., :length] |= valid[:, None, :] & ~keep
        st.sel, st.planned, st.observed = selection_from_tokens(table, keep), length, False
        return st.sel

    def observe(self, table: BlockTable, layer: int, q, kv, pos, sel: Selection) -> None:
        st = self._live(table)
        b, h, _, d = q.shape
        hkv = kv.shape[2]
        see = (pos[None, :] >= self.pads(table)[:, None])[:, None, :]  # see: [B, 1, T+1]
        if sel.mask is not None:
            see = see & torch.cat([sel.mask, sel.mask.new_ones(b, hkv, 1)], dim=-1)  # [B, Hkv, T+1]
        qg = q.float().view(b, hkv, h // hkv, d)  # qg: [B, Hkv, G, D]
        sc = torch.einsum("bkgd,bktd->bkgt", qg, kv[0].float()) / math.sqrt(d)
        p = torch.softmax(sc.masked_fill(~see[:, :, None, :], float("-inf")), dim=-1).sum(dim=2)  # [B, Hkv, T+1]
        st.score.index_add_(2, pos.to(st.score.device), p)
        st.observed = True
