"""Quest: query-aware block selection by an upper bound on each block's attention score."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..block_table import BlockTable
from ..knobs import at_least, knob
from ..policy import Selection
from .selection import BlockSelectionPolicy, StepView


def block_upper_bound(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Upper bound of q.k over every key k with kmin <= k <= kmax channel-wise.

    q: [..., D]; kmin, kmax: [..., D] (broadcast) -> [...]: sum_d max(q_d kmin_d, q_d kmax_d)."""
    return torch.maximum(q * kmin, q * kmax).sum(dim=-1)


@dataclass(eq=False)
class Quest(BlockSelectionPolicy):
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

    # --- summaries: kmin, kmax [num_blocks, B, Hkv, D] float32 (padding keys included) ---
    summary_axes = (0, 0)

    def empty_summaries(self, table: BlockTable) -> tuple[torch.Tensor, ...]:
        _, b, hkv, _, d = table.block_shape
        z = torch.zeros(table.capacity // table.bs, b, hkv, d, dtype=torch.float32, device=table.devices.compute)
        return z, z.clone()

    def summarise(self, table: BlockTable, keys: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return keys.amin(dim=3).permute(2, 0, 1, 3), keys.amax(dim=3).permute(2, 0, 1, 3)  # [n, B, Hkv, D]

    # --- the step ---
    def plan(self, table: BlockTable, layer: int) -> Selection | None:
        return Selection.all(table) if self.is_dense_layer(layer) else None  # else: needs the query

    def block_scores(self, table: BlockTable, layer: int, q: torch.Tensor, view: StepView) -> torch.Tensor:
        """Per KV head, the max bound over its query heads: [B, Hkv, nb] (-inf: an all-pad block)."""
        kmin, kmax = self.summaries(table, layer)  # kmin, kmax: [nb, B, Hkv, D]
        b, h, _, d = q.shape
        hkv = table.block_shape[2]
        qg = q.float().view(b, hkv, h // hkv, 1, d)  # qg: [B, Hkv, G, 1, D]
        kmin = kmin.permute(1, 2, 0, 3)[:, :, None]  # kmin: [B, Hkv, 1, nb, D]
        kmax = kmax.permute(1, 2, 0, 3)[:, :, None]
        bound = block_upper_bound(qg, kmin, kmax).amax(dim=2)  # bound: [B, Hkv, nb]
        return bound if view.live is None else bound.masked_fill(~view.live[:, None, :], -math.inf)
