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

from itertools import compress

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
    # pick: [B, nb]; rows: [B, W] cache positions; mask: [B, 1, W]; readers: [nb + 2] sequences picking each
    # block, then the spans and tokens read; seqs: [B, n] the sequences reading each block read (the union,
    # as the statistics count it)
    pick, rows, mask, readers, seqs = kernel.pick_rows(score, view.own, room.blocks, table.bs, view.length)
    host = readers.tolist()  # the one host read
    counted = (host.pop(-2), host.pop())
    blocks = list(compress(range(len(host)), host))
    nseq = list(filter(None, host))
    open_len = view.length - view.sealed * table.bs
    if open_len:
        blocks.append(view.sealed)
    if b == 1:  # one row: every position it holds is read, no mask
        return pick, Selection(blocks, rows=rows, nseq=nseq, counted=counted)
    return pick, Selection(blocks, mask.expand(b, hkv, mask.shape[2]), seqs=table.devices.streams.on_host(seqs),
                           rows=rows, nseq=nseq, counted=counted)
