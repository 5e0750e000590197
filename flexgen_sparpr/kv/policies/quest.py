"""Quest: query-aware block selection by an upper bound on each block's attention score."""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..block_table import BlockTable
from ..knobs import at_least, knob
from ..policy import Selection
from .base import BudgetPolicy, selection_from_tokens


def block_upper_bound(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Upper bound of q.k over every key k with kmin <= k <= kmax channel-wise.

    q: [..., D]; kmin, kmax: [..., D] (broadcast) -> [...]: sum_d max(q_d kmin_d, q_d kmax_d)."""
    return torch.maximum(q * kmin, q * kmax).sum(dim=-1)


@dataclass(eq=False)
class _Bounds:
    kmin: torch.Tensor  # [num_blocks, B, Hkv, D] channel-wise min of each sealed block's keys
    kmax: torch.Tensor
    known: list[bool]


@dataclass(eq=False)
class Quest(BudgetPolicy):
    """Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference"
    (ICML 2024).

    Each sealed block keeps the channel-wise min and max of its keys (kept by `table.on_seal`,
    so a block's summary costs nothing to read). For the step's query a block's score bound is
    sum_d max(q_d min_d, q_d max_d) >= q.k for every key in it; the query heads of a KV head
    share blocks, scored by the max bound over the group. Per sequence and KV head the best
    blocks are taken while their valid tokens fit the budget (whole blocks only; the slack is
    under one block). The open (partial, unsealed) last block has no summary yet and is always
    read; its tokens count in the budget, which never drops below them. No sink is forced: the
    first block competes like the others (its bound is usually high). Blocks moved: the union over
    sequences and heads; the mask restricts each head to its own blocks. The first
    `dense_layers` layers read everything, as in the paper.
    """

    name = "quest"
    dense_layers: int = knob(2, "the first layers read every block (the paper leaves two dense)")

    def __post_init__(self):
        super().__post_init__()
        at_least(self, "dense_layers", 0)
        self._bounds: weakref.WeakKeyDictionary[BlockTable, _Bounds] = weakref.WeakKeyDictionary()

    @classmethod
    def matrix_knobs(cls, keep: float) -> dict:
        return super().matrix_knobs(keep) | {"dense_layers": 1}  # the tiny models have two layers

    def resident_share(self, block_size: int, dtype_bytes: int, cold=None) -> float:
        """A float32 min and max key per block: 2 x 4 bytes against 2 bs dtype_bytes."""
        return 4 / (block_size * dtype_bytes)

    def is_dense_layer(self, layer: int) -> bool:
        return layer < self.dense_layers

    def floor(self, table: BlockTable) -> int:
        return table.length % table.bs

    def mandatory(self, table: BlockTable, budget: int) -> tuple[int, int]:
        return 0, table.length % table.bs

    def attach(self, table: BlockTable, layer: int) -> None:
        if table in self._bounds:  # attached twice (engine policy and observer): one hook
            return
        nb = table.capacity // table.bs
        _, b, hkv, _, d = table.block_shape
        z = torch.zeros(nb, b, hkv, d, dtype=torch.float32, device=table.devices.compute)
        bounds = self._bounds[table] = _Bounds(z, z.clone(), [False] * nb)
        ref = weakref.ref(bounds)  # the table holds the hook; the hook must not hold the table

        def on_seal(block: int, kv: torch.Tensor) -> None:
            bd = ref()
            if bd is not None:
                keys = kv[0].float()  # keys: [B, Hkv, bs, D]
                bd.kmin[block], bd.kmax[block] = keys.amin(dim=2), keys.amax(dim=2)
                bd.known[block] = True
        table.on_seal.append(on_seal)

    def plan(self, table: BlockTable, layer: int) -> Selection | None:
        return Selection.all(table) if self.is_dense_layer(layer) else None  # else: needs the query

    def select(self, table: BlockTable, layer: int, q: torch.Tensor) -> Selection:
        if self.is_dense_layer(layer):
            return Selection.all(table)
        if table not in self._bounds:
            self.attach(table, layer)
        bd, bs, length = self._bounds[table], table.bs, table.length
        sealed = length // bs
        missing = [i for i in range(sealed) if not bd.known[i]]
        if missing:  # attached after these blocks sealed: summarise them once, from the cache
            kv, _ = table.gather(missing)
            keys = kv[0].float().unflatten(2, (len(missing), bs))  # keys: [B, Hkv, m, bs, D]
            bd.kmin[missing] = keys.amin(dim=3).permute(2, 0, 1, 3)
            bd.kmax[missing] = keys.amax(dim=3).permute(2, 0, 1, 3)
            for i in missing:
                bd.known[i] = True
        b, h, _, d = q.shape
        hkv = table.block_shape[2]
        qg = q.float().view(b, hkv, h // hkv, 1, d)  # qg: [B, Hkv, G, 1, D]
        kmin = bd.kmin[:sealed].permute(1, 2, 0, 3)[:, :, None]  # kmin: [B, Hkv, 1, nb, D]
        kmax = bd.kmax[:sealed].permute(1, 2, 0, 3)[:, :, None]
        bound = block_upper_bound(qg, kmin, kmax).amax(dim=2)  # bound: [B, Hkv, nb]
        valid = self.valid_tokens(table)  # valid: [B, L]
        counts = valid[:, :sealed * bs].view(b, sealed, bs).sum(dim=2)  # counts: [B, nb]
        bound = bound.masked_fill((counts == 0)[:, None, :], float("-inf"))  # all-pad blocks
        order = bound.argsort(dim=-1, descending=True)  # order: [B, Hkv, nb]
        taken = counts[:, None, :].expand_as(order).gather(-1, order).cumsum(dim=-1)
        room = torch.tensor(self.budgets(table), device=q.device) - valid[:, sealed * bs:].sum(dim=1)
        fits = (taken <= room[:, None, None]) & (bound.gather(-1, order) > float("-inf"))
        pick = torch.zeros_like(fits).scatter_(-1, order, fits)  # pick: [B, Hkv, nb]
        keep = torch.ones(b, hkv, length, dtype=torch.bool, device=q.device)  # the open block
        keep[..., :sealed * bs] = pick.repeat_interleave(bs, dim=-1)
        return selection_from_tokens(table, keep & valid[:, None, :])
