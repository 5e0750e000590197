"""What the upstream hook (sparpr_hook.py) chooses with: each (layer, GPU batch) cache's key
summaries on upstream's compute device, and the blocks one decode step reads (SparPR's scoring,
budget and pick, as the engine does them, over upstream's one-row-per-position cache)."""
from __future__ import annotations

import math

import torch

from ..kv.policies.base import token_budget
from ..kv.policies.scoring import budgeted_pick
from ..kv.policies.sparpr_mean import block_scores
from ..runtime.costs import keep_target


class Summaries:
    """One (layer, GPU batch) cache's key summaries on the compute device: mean [runs, B*H, D]
    and the valid tokens of each run and sequence, count [runs, B]."""

    def __init__(self, capacity: int, bh: int, d: int, b: int, run: int, dtype, device):
        runs = -(-capacity // run)
        self.run = run
        self.mean = torch.zeros(runs, bh, d, dtype=dtype, device=device)
        self.count = torch.zeros(runs, b, dtype=torch.int32, device=device)

    @property
    def nbytes(self) -> int:
        return self.mean.nbytes + self.count.nbytes

    def add(self, k: torch.Tensor, valid: torch.Tensor, start: int) -> None:
        """k: [n, B*H, D] keys of positions [start, start + n); valid: [B, n] (False: padding)."""
        n, bh, d = k.shape
        b = valid.shape[0]
        r0, r1 = start // self.run, (start + n - 1) // self.run + 1
        pad = start - r0 * self.run
        w = torch.zeros(b, (r1 - r0) * self.run, device=k.device)  # w: [B, runs * run]
        w[:, pad:pad + n] = valid.float()
        kk = torch.zeros((r1 - r0) * self.run, bh, d, device=k.device)
        kk[pad:pad + n] = k.float()
        kk = kk.view(r1 - r0, self.run, b, bh // b, d)  # [runs, run, B, H, D]
        w = w.view(b, r1 - r0, self.run).permute(1, 2, 0)  # w: [runs, run, B]
        old = self.count[r0:r1]  # old: [runs, B]
        total = (self.mean[r0:r1].float().view(r1 - r0, b, bh // b, d) * old[:, :, None, None] +
                 (kk * w[..., None, None]).sum(dim=1))  # total: [runs, B, H, D]
        cnt = old + w.sum(dim=1).int()
        self.count[r0:r1] = cnt
        self.mean[r0:r1] = (total / cnt.clamp(min=1)[:, :, None, None]).view(r1 - r0, bh, d).to(self.mean.dtype)


def pick_blocks(q: torch.Tensor, summ: Summaries, mask: torch.Tensor, config) -> list[int]:
    """The sealed blocks one decode step reads. q: [B, H, 1, D]; mask: [B, S] (False: padding; the
    last position is the new token); config: the hook's SparPRConfig (block_size, keep_ratio,
    min_keep, recent_blocks). Every block when the budget holds them all."""
    b, s = mask.shape
    h, d, bs = q.shape[1], q.shape[3], config.block_size
    n = s - 1
    sealed = n // bs
    valid = mask[:, :n]  # valid: [B, n]
    counts = valid[:, :sealed * bs].reshape(b, sealed, bs).sum(dim=2)  # counts: [B, nb]
    target = keep_target(math.nan, config.keep_ratio, config.min_keep)
    floor = bs * (1 + config.recent_blocks) + n % bs
    budget = torch.tensor([token_budget(target, int(m), floor) for m in valid.sum(dim=1).tolist()],
                          device=mask.device)
    if sealed == 0 or bool((budget >= valid.sum(dim=1)).all()):
        return list(range(sealed))
    per = bs // summ.run
    mean = summ.mean[:sealed * per].view(sealed, per, b, h, d).permute(2, 3, 0, 1, 4)  # [B, H, nb, P, D]
    live = (summ.count[:sealed * per] > 0).view(sealed, per, b).permute(2, 0, 1)  # live: [B, nb, P]
    score = block_scores(q, mean, live, "softmax")  # score: [B, nb]
    ids = torch.arange(sealed, device=mask.device)
    first = valid.long().argmax(dim=1)  # each sequence's first valid position (left padding)
    own = ((ids[None, :] == (first // bs)[:, None]) | (ids >= sealed - config.recent_blocks)[None, :]).any(dim=0)
    used = (counts * own).sum(dim=1) + valid[:, sealed * bs:].sum(dim=1)  # used: [B]
    room = (budget - used).min()
    batch_score = score.nan_to_num(neginf=0.0).sum(dim=0).masked_fill(counts.sum(dim=0) == 0, -math.inf)  # [nb]
    pick = budgeted_pick(batch_score, counts.amax(dim=0), room, own)  # pick: [nb]
    return pick.nonzero().flatten().tolist()
