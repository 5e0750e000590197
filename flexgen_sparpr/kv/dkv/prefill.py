"""Training-free block-sparse prefill attention (DKV's `--dkv-sparse-prefill`).

Query block i (bs tokens) attends the sink block 0, its `local` predecessors, itself (causal),
and the `topk` earlier blocks whose mean key best matches the query block's mean query (per
sequence, summed over heads). Each query block reads at most (topk + local + 2) key blocks, so
the cost grows linearly with the prompt instead of quadratically.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...models.layers import masked_attention


def _block_means(x: torch.Tensor, w: torch.Tensor, nb: int, bs: int) -> torch.Tensor:
    """x: [B, Hx, nb*bs, D]; w: [B, nb*bs] weights -> [B, Hx, nb, D] weighted means per block."""
    b, hx, _, d = x.shape
    ww = w.view(b, 1, nb, bs, 1)
    return (x.float().view(b, hx, nb, bs, d) * ww).sum(3) / ww.sum(3).clamp(min=1)


def block_sparse_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None,
                         bs: int, topk: int, local: int = 1) -> torch.Tensor:
    """q: [B, H, S, D]; k, v: [B, Hkv, S, D]; valid: [B, S] bool or None. Returns o: [B, H, S, D]."""
    b, h, s, d = q.shape
    hkv = k.shape[1]
    nb = -(-s // bs)
    pad = nb * bs - s
    if valid is None:
        valid = torch.ones(b, s, dtype=torch.bool, device=q.device)
    kp, vp = F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))  # kp, vp: [B, Hkv, nb*bs, D]
    vmask = F.pad(valid, (0, pad))  # vmask: [B, nb*bs] (the padding tail is invalid)
    w = vmask.float()
    km = _block_means(kp, w, nb, bs)  # km: [B, Hkv, nb, D]
    qm = _block_means(F.pad(q, (0, 0, 0, pad)), w, nb, bs).view(b, hkv, h // hkv, nb, d).sum(2)  # [B, Hkv, nb, D]
    score = torch.einsum("bgid,bgjd->bij", qm, km)  # score: [B, nb (query block), nb (key block)]
    kb = kp.view(b, hkv, nb, bs, d)
    vb = vp.view(b, hkv, nb, bs, d)
    out = torch.empty_like(q)
    ar = torch.arange(b, device=q.device)[:, None]
    for i in range(nb):
        q0, q1 = i * bs, min(s, (i + 1) * bs)
        first_local = max(1, i - local)
        cands = first_local - 1  # blocks 1 .. first_local-1 compete for the top-k
        if cands <= topk:
            ids = torch.arange(i + 1, device=q.device).expand(b, -1)  # ids: [B, i+1] every block
        else:
            top = score[:, i, 1:first_local].topk(topk, dim=1).indices + 1  # top: [B, topk]
            fixed = torch.cat([torch.zeros(1, dtype=torch.long, device=q.device),
                               torch.arange(first_local, i + 1, device=q.device)])
            ids = torch.cat([fixed.expand(b, -1), top], dim=1).sort(dim=1).values  # ids: [B, n]
        n = ids.shape[1]
        ks = kb.permute(0, 2, 1, 3, 4)[ar, ids].permute(0, 2, 1, 3, 4).reshape(b, hkv, n * bs, d)
        vs = vb.permute(0, 2, 1, 3, 4)[ar, ids].permute(0, 2, 1, 3, 4).reshape(b, hkv, n * bs, d)
        kpos = (ids[..., None] * bs + torch.arange(bs, device=q.device)).flatten(1)  # kpos: [B, n*bs]
        qpos = torch.arange(q0, q1, device=q.device)  # qpos: [Sq]
        kval = torch.gather(vmask, 1, kpos)  # kval: [B, n*bs]
        mask = (kpos[:, None, :] <= qpos[None, :, None]) & kval[:, None, :]  # mask: [B, Sq, n*bs]
        mask |= kpos[:, None, :] == qpos[None, :, None]  # a padded query still sees itself
        o = masked_attention(q[:, :, q0:q1], ks, vs, mask[:, None])  # o: [B, H, Sq, D]
        out[:, :, q0:q1] = o
    return out
