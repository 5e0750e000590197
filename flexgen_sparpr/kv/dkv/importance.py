"""Query-aware token importance for DKV's residual pick (docs/dkv.md, "Which rows stay exact").

At prefill, the last `window` prompt queries (an observation window, as in SnapKV: with a
question at the end of the prompt, these are the question's tokens) say which cached tokens the
model reads. A token's importance in one layer is the attention mass it receives from them:

    imp[b, t] = sum over query heads h and window queries i of softmax_t(q_{h,i} . k_{g(h),t} / sqrt(D))

with the softmax per head and query over its whole valid causal prefix, and GQA's query head h
reading KV head g(h) = h // (H / Hkv).

That mass alone mostly lands on what the question *matches* ("secret", "pass", "key", "is"), not
on what the answer will copy (the key's digits, which follow the match: an induction head reads
the token after the one it matched). So a token also inherits the largest mass of the `follow`
tokens before it (`follow_spread`):

    score[t] = imp[t] + max(imp[t - follow], ..., imp[t])

The block table's store hands each sealed block's slice of `score` to the codec's encode
(`TierStore.hints`), which keeps the top rows exact.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

WINDOW = 32  # observation window: the last prompt queries
# a token inherits the importance of this many tokens before it: 12 covers a 10-digit key and the
# token that ends it (8 covered 5 digits: 4/10 10-digit keys on the tuning split, 12: 8/10, 16:
# 3/10; 5-digit keys 10/10 with 8 and 12; results/fidelity/explore/dkv-follow-tuning.txt). With 5
# the 8k passkeys were recalled but not where they end ("23199999999")
FOLLOW = 12


def observation_importance(q: torch.Tensor, k: torch.Tensor, valid: torch.Tensor | None,
                           window: int = WINDOW) -> torch.Tensor:
    """q: [B, H, S, D]; k: [B, Hkv, S, D] (the prompt's keys, positions 0..S-1); valid: [B, S] bool
    (False: left padding) or None. Returns imp: [B, S] float32 (0 at padding)."""
    b, h, s, d = q.shape
    hkv = k.shape[1]
    w = min(window, s)
    if valid is None:
        valid = torch.ones(b, s, dtype=torch.bool, device=q.device)
    qpos = torch.arange(s - w, s, device=q.device)
    causal = torch.arange(s, device=q.device)[None, :] <= qpos[:, None]  # causal: [W, S]
    mask = valid[:, None, :] & causal[None]  # mask: [B, W, S]
    live = valid[:, s - w:, None]  # live: [B, W, 1] a padded query position reads nothing
    qw = q[:, :, s - w:].float().unflatten(1, (hkv, h // hkv))  # qw: [B, Hkv, G, W, D]
    imp = torch.zeros(b, s, dtype=torch.float32, device=q.device)
    for g in range(hkv):  # one KV head at a time: peak memory [B, G, W, S]
        sc = torch.einsum("bqwd,bsd->bqws", qw[:, g], k[:, g].float()) / math.sqrt(d)  # sc: [B, G, W, S]
        p = sc.masked_fill(~mask[:, None], float("-inf")).softmax(dim=-1)  # p: [B, G, W, S]
        p = torch.where(live[:, None], p, torch.zeros((), device=q.device))  # no NaN rows from pads
        imp += p.sum(dim=(1, 2))  # [B, S]
    return imp


def follow_spread(imp: torch.Tensor, follow: int = FOLLOW) -> torch.Tensor:
    """imp: [B, S] -> score: [B, S], score[t] = imp[t] + max(imp[t - follow .. t]) (the module doc)."""
    if follow <= 0:
        return imp + imp
    padded = F.pad(imp[:, None], (follow, 0))  # padded: [B, 1, follow + S] (zeros before position 0)
    return imp + F.max_pool1d(padded, follow + 1, stride=1)[:, 0]  # [B, S]


def hint_sealed_blocks(table, q: torch.Tensor, k: torch.Tensor, valid: torch.Tensor | None,
                       window: int = WINDOW, follow: int = FOLLOW) -> None:
    """After a whole-prompt prefill's append (before its store jobs run): give every sealed block
    that the table stores through a query-aware DKV codec its tokens' importance [B, bs] in
    `table.store.hints` (observation_importance, then follow_spread). Does nothing for other codecs, raw tiers, or a prefill that does not
    start at position 0. q: [B, H, S, D]; k: [B, Hkv, S, D]; valid: [B, S] or None."""
    store = table.store
    if not store.codec.takes_hints or not store.coded:
        return
    bs, s = table.bs, k.shape[2]
    sealed = table.length // bs
    if not sealed or table.length != s:
        return
    coded = [blk for blk in range(sealed) if table.homes[blk] in store.coded]
    if not coded:
        return
    imp = follow_spread(observation_importance(q, k, valid, window), follow)  # imp: [B, S]
    imp = imp[:, :sealed * bs].unflatten(1, (sealed, bs))  # imp: [B, n, bs]
    for blk in coded:
        store.hints[blk] = imp[:, blk].clone()  # [B, bs]
