"""SparPR's scores from mean key summaries (`--summary mean`, and the upstream hook's): each block's
(or each run of summary_tokens tokens') mean valid key per KV head, scored against the query."""
from __future__ import annotations

import math

import torch

from ..block_table import BlockTable


def block_scores(q: torch.Tensor, summ: torch.Tensor, live: torch.Tensor, head_score: str = "sum") -> torch.Tensor:
    """q: [B, H, 1, D]; summ: [B, Hkv, nb, P, D]; live: [B, nb, P] -> [B, nb] (-inf: no valid token).

    A part's score is the sum over query heads h of f_h(q_h . summ[g(h)]), g(h) = h // (H / Hkv);
    a block scores its best part (P = 1: the block's own mean). "sum": f is the identity.
    "softmax": f_h is head h's softmax over all parts (logits scaled by 1/sqrt(D), as attention's
    are), so each head adds one unit of mass and a head with large logits cannot outvote the
    others; still a sum over heads of a monotone function of each head's inner products."""
    b, h, _, d = q.shape
    _, hkv, nb, parts, _ = summ.shape
    live = live.reshape(b, nb * parts)  # live: [B, nb * P]
    summ = summ.reshape(b, hkv, nb * parts, d)  # summ: [B, Hkv, nb * P, D] (a view of a block prefix)
    qs = q.to(summ.dtype)  # products in the summaries' dtype, summed in float32 (no copy of them)
    if head_score == "sum":  # sum_h q_h . s_g(h) = sum_g (sum of g's query heads) . s_g
        qg = q.float().view(b, hkv, h // hkv, d).sum(dim=2)  # qg: [B, Hkv, D]
        part = torch.einsum("bgd,bgnd->bn", qg, summ.float())  # part: [B, nb * P], float32 (fp16 ties/overflows)
    else:
        per = torch.einsum("bgjd,bgnd->bgjn", qs.view(b, hkv, h // hkv, d), summ).float()  # [B, Hkv, G, nb * P]
        per = (per / math.sqrt(d)).masked_fill(~live[:, None, None], -math.inf)
        part = per.softmax(dim=-1).sum(dim=(1, 2))  # part: [B, nb * P]
    return part.masked_fill(~live, -math.inf).view(b, nb, parts).amax(dim=-1)  # [B, nb]


def summary_scores(table: BlockTable, q: torch.Tensor, summ: tuple[torch.Tensor, ...], head_score: str) -> torch.Tensor:
    """block_scores where the summaries live: on q's device, or in host memory (--summaries-on cpu:
    the query goes there, the scores come back, both counted on the link). -> [B, nb]"""
    if summ[0].device == q.device:
        return block_scores(q, *summ, head_score)
    qh = q.to(summ[0].device)
    score = block_scores(qh, *summ, head_score).to(q.device)  # score: [B, nb]
    table.devices.counters.add("compute", "cpu", qh.nbytes)
    table.devices.counters.add("cpu", "compute", score.nbytes)
    return score
