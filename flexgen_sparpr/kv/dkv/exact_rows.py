"""DKV cold blocks under another policy's selection (SparPR --cold-codec dkv): every cold block's
exact rows are attended, selected or not, as the dkv policy attends them (docs/dkv.md, "Composed
with SparPR").

A DKV block keeps m rows exact (by default the ones the prompt's question reads). The table keeps
a copy of them on the compute device (`TierStore.hold_exact_rows`; m/bs of a raw block, 6 % at
the defaults), so a block the selection leaves out is still attended on those rows: it joins the
selection with no sequence reading it whole (`seqs` False, so nothing moves; the table fills the
rows it holds) and a mask that keeps its exact rows only. A selected block comes back whole
(decoded: exact rows exact, the rest rank-r).
"""
from __future__ import annotations

import torch

from ..block_table import BlockTable
from ..policy import Selection


def with_exact_rows(table: BlockTable, sel: Selection, valid: torch.Tensor) -> Selection:
    """sel plus the exact rows the table holds on compute of every sealed block, for each sequence
    that does not read the block whole (a block no sequence chose joins with no reader: nothing moves).
    valid: [B, L] the cached tokens that may be attended (False: left padding). A selection
    without a mask reads every token of its blocks; one with nothing to add is returned as is."""
    if not table.store.holds_exact_rows():
        return sel
    sealed = table.length // table.bs
    chosen = set(sel.blocks)
    held = [b for b in range(sealed) if table.exact_rows(b) is not None]
    extra = [b for b in held if b not in chosen]
    if not held or (sel.mask is None and not extra):  # every held block read whole already
        return sel
    _, b_, hkv, _, _ = table.block_shape
    dev = valid.device
    full = torch.zeros(b_, hkv, table.num_blocks * table.bs, dtype=torch.bool, device=dev)  # full: [B, Hkv, L']
    full[..., table.positions(sel.blocks, dev)] = True if sel.mask is None else sel.mask
    for blk in held:  # a chosen block too: a sequence that did not choose it reads its exact rows
        idx, _ = table.exact_rows(blk)  # idx: [B, m]
        full[:, :, :sealed * table.bs].scatter_(2, (blk * table.bs + idx.to(dev))[:, None].expand(-1, hkv, -1), True)
    full[..., :valid.shape[1]] &= valid[:, None]
    blocks = sorted(chosen | set(extra))
    # seqs: [B, n'] on the host (the store branches on it); extra blocks: no reader
    seqs = table.devices.streams.on_host(torch.zeros(b_, len(blocks), dtype=torch.bool))
    at = {blk: j for j, blk in enumerate(blocks)}
    cols = [at[blk] for blk in sel.blocks]
    seqs[:, cols] = True if sel.seqs is None else sel.seqs
    return Selection(blocks, full[..., table.positions(blocks, dev)], recompute=sel.recompute, seqs=seqs)
