"""A block selection's pick and its Selection in one compiled call a layer (models/select_kernel.cpp),
where that call gives what the tensor path does (selection.py's `pick` + `selection_from_pick`):

- the budgeted pick is one top-k (every block holds bs tokens: no left padding) over one score per
  block for all KV heads, and the policy's pick is that top-k (`BlockSelectionPolicy.picks_top`);
- the cache is resident on the CPU and holds no exact rows apart (DKV), so the Selection is read in
  place by its rows (engine/cell.py `reads_rows`);
- the compiled kernels are built (models/cpu_kernel.py).

Anywhere else `fused_selection` returns None and the tensor path runs; tests/kv/test_fused_pick.py
holds the two to the same picks, Selections and tokens.
"""
from __future__ import annotations

import torch

from ...models.cpu_kernel import kernel as compiled_kernel
from ..block_table import BlockTable
from ..policy import Selection


def fused_selection(table: BlockTable, score: torch.Tensor, view, room) -> tuple[torch.Tensor, Selection] | None:
    """score: [B, nb] float32 on the CPU; view: the step's StepView; room: its Room at the target
    -> (pick: [B, nb] bool, the Selection with its rows), or None where the fused call does not apply."""
    if (room.blocks is None or score.dim() != 2 or score.device.type != "cpu" or score.dtype != torch.float32
            or not table.store.resident or table.store.holds_exact_rows()):
        return None
    kernel = compiled_kernel()
    if kernel is None:
        return None
    b, hkv = table.block_shape[1], table.block_shape[2]
    # pick: [B, nb]; rows: [B, W + 1] cache positions, the step's new token's last; mask: [B, 1, W]; host:
    # the spans and tokens read, the n blocks some sequence picked, the sequences reading each; seqs: [B, n]
    # the sequences reading each block read (the union, as the statistics count it)
    pick, rows, mask, host, seqs = kernel.pick_rows(score, view.own, room.blocks, table.bs, view.length)
    host = host.tolist()  # the one host read (a few dozen numbers)
    n = (len(host) - 2) // 2
    blocks, nseq = host[2:2 + n], host[2 + n:]
    if view.length - view.sealed * table.bs:
        blocks.append(view.sealed)  # the open block
    picked = dict(rows=rows[:, :-1], next_rows=rows, nseq=nseq, counted=(host[0], host[1]))
    if b == 1:  # one row: every position it holds is read, no mask
        return pick, Selection(blocks, **picked)
    return pick, Selection(blocks, mask.expand(b, hkv, mask.shape[2]), seqs=table.devices.streams.on_host(seqs),
                           **picked)
