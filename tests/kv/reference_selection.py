"""The block selection as it was before the fused path (engine ae59702), kept as the reference the
fused selection must equal: plain per-layer tensor code with Python loops, scoring every block
from the policy's summaries, the budgeted pick, then the token mask and the blocks it touches."""
from __future__ import annotations

import math

import torch

from flexgen_sparpr.kv.block_table import BlockTable
from flexgen_sparpr.kv.policies.base import token_budget
from flexgen_sparpr.kv.policies.quest import Quest, block_upper_bound
from flexgen_sparpr.kv.policies.sparpr import SparPR
from flexgen_sparpr.kv.policies.sparpr_mean import block_scores
from flexgen_sparpr.kv.policies.sparpr_lowrank import LEVELS, nibbles


def budgeted_pick(score, counts, room, own=None):
    if own is not None:
        score, counts = score.masked_fill(own, -math.inf), counts * ~own
    order = score.argsort(dim=-1, descending=True)
    taken = counts.expand_as(order).gather(-1, order).cumsum(dim=-1)
    fits = (taken <= room[..., None]) & (score.gather(-1, order) > -math.inf)
    pick = torch.zeros_like(fits).scatter_(-1, order, fits)
    return pick if own is None else own | pick


def picked_tokens(pick, table: BlockTable):
    sealed = pick.shape[-1] * table.bs
    keep = torch.ones(*pick.shape[:-1], table.length, dtype=torch.bool)
    keep[..., :sealed] = pick.repeat_interleave(table.bs, dim=-1)
    return keep


def valid_tokens(pol, table):
    pos = torch.arange(table.length)
    return pos[None, :] >= pol.pads(table).cpu()[:, None]


def block_counts(pol, table):
    b, bs, sealed = table.block_shape[1], table.bs, table.length // table.bs
    valid = valid_tokens(pol, table)
    return valid, valid[:, :sealed * bs].view(b, sealed, bs).sum(dim=2)


def lowrank_scores(q, codes, basis, valid, bs, head_score):
    b, h, _, d = q.shape
    hkv = codes.shape[1]
    qr = torch.einsum("bkgd,kdr->bkgr", q.float().view(b, hkv, h // hkv, d), basis.u.float())
    qs = qr * (basis.step[None, :, None, :] / math.sqrt(d))
    lo, hi = nibbles(codes)
    logit = torch.matmul(qs[..., 0::2], lo.mT)
    logit += torch.matmul(qs[..., 1::2], hi.mT)
    logit -= (LEVELS + 1) * qs.sum(dim=-1, keepdim=True)
    logit = logit.masked_fill(~valid[:, None, None], -math.inf)
    t = logit.shape[-1]
    if head_score == "softmax":
        score = logit.softmax(dim=-1).sum(dim=(1, 2)).view(b, t // bs, bs).sum(dim=-1)
    else:
        score = logit.sum(dim=(1, 2)).view(b, t // bs, bs).amax(dim=-1)
    return score.masked_fill(~valid.view(b, t // bs, bs).any(dim=-1), -math.inf)


def sparpr_keep(pol: SparPR, table: BlockTable, layer: int, q: torch.Tensor, target: float) -> torch.Tensor:
    """[B, L] bool: the cached tokens each sequence reads at keep target `target` (SparPR.top_k)."""
    bs, sealed = table.bs, table.length // table.bs
    budgets = [token_budget(target, table.length - p, pol.floor(table)) for p in pol.host_pads(table)]
    valid, counts = block_counts(pol, table)
    ids = torch.arange(sealed)
    sink = ids[None, :] == (pol.pads(table).cpu() // bs)[:, None]
    own = sink | (ids >= sealed - pol.recent_blocks)[None, :]
    used = (counts * own).sum(dim=1) + valid[:, sealed * bs:].sum(dim=1)
    summ = pol.summaries(table, layer)
    if pol.lowrank:
        codes = summ[0].flatten(3).mT  # codes: [B, Hkv, T, r / 2] (stored [B, Hkv, r / 2, nb, bs])
        score = lowrank_scores(q, codes, pol._basis[table], valid[:, :sealed * bs], bs, pol.head_score)
    else:
        score = block_scores(q, *summ, pol.head_score)
    if pol.per_sequence:
        pick = budgeted_pick(score, counts, torch.tensor(budgets) - used, own)
        return picked_tokens(pick, table) & valid
    cand = ~own.all(dim=0) & (counts > 0).any(dim=0)
    ranked = score.masked_fill(~cand[None, :], -math.inf).argsort(dim=-1, descending=True)
    ranked = ranked[:, :int(cand.sum())].T.tolist()
    used = used.tolist()
    cnt, picked = (counts * ~own).T.tolist(), {}
    for blk in (blk for row in ranked for blk in row):
        if blk not in picked and all(u + c <= m for u, c, m in zip(used, cnt[blk], budgets)):
            picked[blk] = True
            used = [u + c for u, c in zip(used, cnt[blk])]
    pick = own.clone()
    pick[:, list(picked)] = True
    return picked_tokens(pick, table) & valid


def quest_keep(pol: Quest, table: BlockTable, layer: int, q: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, L] bool: the cached tokens each sequence and KV head reads (Quest.select)."""
    kmin, kmax = pol.summaries(table, layer)
    b, h, _, d = q.shape
    hkv, sealed = table.block_shape[2], table.length // table.bs
    qg = q.float().view(b, hkv, h // hkv, 1, d)
    bound = block_upper_bound(qg, kmin.permute(1, 2, 0, 3)[:, :, None], kmax.permute(1, 2, 0, 3)[:, :, None]).amax(dim=2)
    valid, counts = block_counts(pol, table)
    bound = bound.masked_fill((counts == 0)[:, None, :], -math.inf)
    room = torch.tensor(pol.budgets(table)) - valid[:, sealed * table.bs:].sum(dim=1)
    pick = budgeted_pick(bound, counts[:, None, :], room[:, None])
    return picked_tokens(pick, table) & valid[:, None, :]
