"""DKV's exact routed blocks: of the cold blocks a decode step routes, the few with the most
attention mass are attended from raw copies instead of in low-rank form.

A block's anchor + rank-r delta + m exact rows keeps what most queries read, but a needle's
digits or a phrase that sits in a block's low-energy directions is blurred (docs/fidelity.md).
The router already knows which blocks the query reads most (their log mass in low-rank space), so
reading the raw rows of the top E of them, per sequence, is exact where it matters. The raw copies
live in the table's `raw_copies` (kv/block_table.py), homed on a slower tier (CPU or disk): E
blocks a sequence move a step, counted on the links like every other read (kv/tier_store.py)."""
from __future__ import annotations

import torch

from ...models.layers import attention_with_lse
from ..block_table import BlockTable


def split_route(lse: torch.Tensor, route: torch.Tensor | None, exact: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(top: [B, E], rest: [B, K-E]) of the routed blocks, top the E the router ranks highest.
    lse: [B, n, H] every cold block's log mass; route: [B, K], sorted by the router's score,
    largest first (DKV._route's topk: the low-rank mass, or the mean key's score), or None (all n
    routed: ranked here by their mass summed over heads)."""
    if route is None:  # every cold block routed: rank them all
        route = lse.logsumexp(dim=2).topk(lse.shape[1], dim=1).indices  # route: [B, n]
    e = min(exact, route.shape[1])
    return route[:, :e], route[:, e:]


def exact_blocks(q: torch.Tensor, raw: BlockTable, top: torch.Tensor, first: int, usable: torch.Tensor):
    """The blocks `top` picks per sequence, read raw and attended exactly.

    q: [B, H, 1, D]; raw: the table's raw copies; top: [B, E] cold-block indices (block first + i);
    usable: [n, B, bs] bool, a cold block's tokens that are neither padding nor residual rows (the
    rows DKV attends exactly already). Each block is read once, only for the sequences that picked
    it. Returns (out: [B, H, 1, D] float32, lse: [B, H, 1]) as attention_with_lse."""
    b, e = top.shape
    bs = raw.bs
    picks = top.tolist()  # a host sync: which blocks to read follows from this step's query
    union = sorted({first + i for row in picks for i in row})
    src = {blk: raw.store.view(blk, bs, raw.sealed) for blk in union}  # in place where they live on compute
    away = [blk for blk in union if src[blk] is None]
    if away:  # from their tier, each block for the sequences that picked it only
        need = torch.tensor([[blk - first in row for blk in away] for row in picks])  # need: [B, U] (host)
        kv, _ = raw.gather(away, seqs=need)  # kv: [2, B, Hkv, U*bs, D], rows no sequence needs zeroed
        src |= {blk: kv[:, :, :, j * bs:(j + 1) * bs] for j, blk in enumerate(away)}
    _, _, hkv, _, d = raw.block_shape
    sel = torch.empty(2, b, hkv, e * bs, d, dtype=raw.dtype, device=q.device)  # sel: [2, B, Hkv, E*bs, D]
    for s, row in enumerate(picks):  # each sequence's own blocks, one copy a (sequence, block)
        for j, i in enumerate(row):
            sel[:, s, :, j * bs:(j + 1) * bs].copy_(src[first + i][:, s])
    ok = usable.permute(1, 0, 2).gather(1, top[:, :, None].expand(-1, -1, bs)).reshape(b, e * bs)  # ok: [B, E*bs]
    return attention_with_lse(q, sel[0].to(q.dtype), sel[1].to(q.dtype), ok)
