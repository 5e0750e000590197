"""The attention step of one layer for one GPU batch, over the block table."""
from __future__ import annotations

import torch

from ..kv.block_table import BlockTable
from ..models.layers import (attention_with_lse, causal_attention, decode_attention,
                             merge_attention, topk_sparse_attention)
from ..storage.tiers import Tier


def prefill_attention(table: BlockTable, q, k, v, valid):
    """q: [B, H, S, D]; k, v: [B, Hkv, S, D]; valid: [B, S]. Stores k, v; returns
    (o: [B, H, S, D], store jobs)."""
    o = causal_attention(q, k, v, valid)
    return o, table.append(k, v)


def pads_valid(pos, pads) -> torch.Tensor | None:
    """[B, S] validity of prefill tokens under left padding (None: no padding)."""
    if pads is None:
        return None
    s = pos.shape[1]
    return torch.arange(s, device=pos.device)[None, :] >= pads[:, None]


def decode_attention_step(table: BlockTable, q, k, v, pads, fetched, *, sparsity: float = 1.0,
                          cpu_compute: bool = False):
    """One new token. q: [B, H, 1, D]; k, v: [B, Hkv, 1, D]; pads: [B] left-pad counts or None;
    fetched: (kv [2, B, Hkv, T+1, D], pos [T+1], Selection) gathered *before* this token with a
    spare last slot, or None for a resident cache read whole, in place, after the append.
    Returns (o: [B, H, 1, D], kv, pos, store jobs)."""
    if cpu_compute and table.devices.is_cuda and Tier.CPU in table.homes[:table.num_blocks]:
        o = _split_by_home(table, q, k, v, pads)
        return o, None, None, table.append(k, v)
    mask = None
    if fetched is None:
        jobs = table.append(k, v)
        kv, pos = table.gather()
    else:
        kv, pos, sel = fetched.kv, fetched.pos, fetched.sel
        kv[0, :, :, -1:].copy_(k)
        kv[1, :, :, -1:].copy_(v)
        pos[-1] = table.length
        jobs = table.append(k, v)
        mask = sel.mask
    valid = None if pads is None else pos[None, :] >= pads[:, None]  # valid: [B, T+1]
    if mask is not None:
        if valid is None:
            valid = torch.ones(mask.shape[0], pos.shape[0], dtype=torch.bool, device=pos.device)
        keep = torch.cat([mask, mask.new_ones(*mask.shape[:2], 1)], dim=-1)  # keep: [B, Hkv, T+1]
        valid = valid[:, None, :] & keep  # valid: [B, Hkv, T+1]
    if sparsity < 1:
        return topk_sparse_attention(q, kv[0], kv[1], valid, sparsity), kv, pos, jobs
    return decode_attention(q, kv[0], kv[1], valid), kv, pos, jobs


def _split_by_home(table: BlockTable, q, k, v, pads):
    """FlexGen's --cpu-cache-compute: attend the CPU-homed blocks on the CPU (only the query
    crosses the link), the rest on the compute device, and merge by log-sum-exp."""
    nb = table.num_blocks
    on_cpu = [b for b in range(nb) if table.homes[b] == Tier.CPU and table.block_len(b) == table.bs]
    rest = [b for b in range(nb) if b not in set(on_cpu)]
    parts = []
    kv, pos = table.gather(rest)
    kv = torch.cat([kv, torch.stack([k, v])], dim=3)  # + the new token
    pos = torch.cat([pos, torch.tensor([table.length], device=pos.device)])
    if pads is None:
        pads = torch.zeros(q.shape[0], dtype=torch.long, device=q.device)
    parts.append(attention_with_lse(q, kv[0], kv[1], pos[None, :] >= pads[:, None]))
    if on_cpu:
        qc, pc = q.cpu(), pads.cpu()
        table.devices.counters.add("compute", "cpu", qc.nbytes)
        for b in on_cpu:
            blk = _host_block(table, b)  # blk: [2, B, Hkv, bs, D] on the host
            bpos = torch.arange(b * table.bs, (b + 1) * table.bs)
            o, lse = attention_with_lse(qc, blk[0], blk[1], bpos[None, :] >= pc[:, None])
            parts.append((o.to(q.device), lse.to(q.device)))
    return merge_attention(parts).to(q.dtype)


def _host_block(table: BlockTable, b: int) -> torch.Tensor:
    """CPU-homed block b's KV on the host: its arena slot, or its encoded row decoded there
    (--compress-cache and --cold-codec store the CPU tier encoded: it has no raw arena)."""
    if Tier.CPU in table.coded:
        return table.codec.decode(table._rows[Tier.CPU][table.slot[b]])
    return table._in_arena(b)
