"""Simulated SparPR selections for experiments (issues 16, 17s): a SparPR whose block scores
come from a function (the exact block mass, the mean summaries per KV head, ...), one block set
per sequence (Simulated) or one per KV head (PerHead). Used by ppl_variants.py and
../sparpr_selection/task_variants.py."""
import math

import torch

from flexgen_sparpr.kv.policies.scoring import budgeted_pick, picked_tokens
from flexgen_sparpr.kv.policies.sparpr import SparPR


class Simulated(SparPR):
    """SparPR whose block scores come from `score_fn(self, table, layer, q) -> [B, nb]`."""

    def __init__(self, score_fn, **kw):
        kw.setdefault("summary", "mean")  # mean_heads & co read the 4-token means (the default before lowrank)
        super().__init__(**kw)
        self.score_fn, self.basis = score_fn, {}

    def on_prefill(self, table, layer, q, k, valid):
        super().on_prefill(table, layer, q, k, valid)
        x = k[0].float()  # [Hkv, S, D]
        us = []
        for h in range(x.shape[0]):
            c = x[h] - x[h].mean(dim=0)
            _, _, vt = torch.linalg.svd(torch.cat([c, x[h].mean(dim=0, keepdim=True)]), full_matrices=False)
            us.append(vt.T)
        self.basis[layer] = torch.stack(us)

    def reads(self, table, budgets):
        """SparPR's always_read with the budget's room left for picked blocks: (valid, counts, own, room [B])."""
        valid, counts, own, used = self.always_read(table)
        return valid, counts, own, torch.tensor(budgets, device=counts.device) - used

    def top_k(self, table, layer, q, budgets):
        valid, counts, own, room = self.reads(table, budgets)
        pick = budgeted_pick(self.score_fn(self, table, layer, q), counts, room, own)  # score: [B, nb]
        return picked_tokens(pick, table) & valid


def block_mass(table, q):
    """[B, Hkv, G, nb]: each query head's exact attention mass per sealed block."""
    kv, _ = table.gather()
    keys = kv[0].float()
    b, h, _, d = q.shape
    hkv, L = keys.shape[1], keys.shape[2]
    p = torch.einsum("bkgd,bktd->bkgt", q.float().view(b, hkv, h // hkv, d), keys).div(math.sqrt(d)).softmax(-1)
    sealed = L // table.bs
    return p[..., :sealed * table.bs].reshape(b, hkv, h // hkv, sealed, table.bs).sum(dim=-1)


def oracle(self, table, layer, q):
    """[B, nb]: every head's exact attention mass per sealed block, summed."""
    return block_mass(table, q).sum(dim=(1, 2))


def oracle_heads(self, table, layer, q):
    """[B, Hkv, nb]: each KV head's exact attention mass per sealed block (its query heads summed)."""
    return block_mass(table, q).sum(dim=2)


def run_masses(self, table, layer, q):
    """([B, Hkv, G, nb, P]: each query head's softmax over every run of SparPR's mean summaries,
    live [B, nb, P])."""
    mean, live = self.summaries(table, layer)  # [B, Hkv, nb, P, D], [B, nb, P]
    b, h, _, d = q.shape
    hkv, nb, parts = mean.shape[1], mean.shape[2], mean.shape[3]
    lv = live.reshape(b, 1, 1, nb * parts)
    per = torch.einsum("bkgd,bknd->bkgn", q.float().view(b, hkv, h // hkv, d), mean.float().reshape(b, hkv, nb * parts, d))
    per = (per / math.sqrt(d)).masked_fill(~lv, -math.inf).softmax(-1)  # per: [B, Hkv, G, nb*P]
    return per.view(b, hkv, h // hkv, nb, parts), live


def mean_heads(self, table, layer, q):
    """[B, Hkv, nb]: SparPR's mean summaries, each KV head's softmax over parts (its query heads summed)."""
    return run_masses(self, table, layer, q)[0].sum(dim=2).amax(dim=-1)


def mean_maxheads(self, table, layer, q):
    """[B, nb]: SparPR's mean summaries, each KV head's mass (mean_heads); a block scores its best
    KV head's, so one block set still serves every head (one read per block)."""
    return mean_heads(self, table, layer, q).amax(dim=1)


class PerHead(Simulated):
    """Each KV head picks its own blocks (sink, recent, open always) within the sequence's budget."""

    def select(self, table, layer, q):
        from flexgen_sparpr.kv.policies.base import selection_from_tokens, token_budget
        n_valid = [table.length - p for p in self.host_pads(table)]
        budgets = [token_budget(self.keep_ratio, n, self.floor(table)) for n in n_valid]
        valid, counts, own, room = self.reads(table, budgets)
        score = self.score_fn(self, table, layer, q)  # [B, Hkv, nb]
        hkv = score.shape[1]
        pick = budgeted_pick(score, counts[:, None], room[:, None].expand(-1, hkv), own[:, None].expand(-1, hkv, -1))
        keep = picked_tokens(pick, table) & valid[:, None]
        return selection_from_tokens(table, keep)


def mean_sumparts(self, table, layer, q):
    """[B, nb]: SparPR's mean summaries scored as in the engine (each query head's softmax over
    every run, summed over heads), but a block scores the sum of its runs (a mass), not its best."""
    per, live = run_masses(self, table, layer, q)
    return per.sum(dim=(1, 2, 4)).masked_fill(~live.any(-1), -math.inf)


def _lognormal(iso: bool, t: int = 4):
    """[B, nb]: each t-token run's attention mass estimated from its mean key and its keys' variance
    (per channel, or `iso`: one number a run and KV head) as if its scores were normal:
    count * exp(q.mu / sqrt(D) + q^T diag(var) q / (2 D)); each query head's softmax over every run,
    summed over heads and over a block's runs (simulated from the cached keys)."""
    def fn(self, table, layer, q):
        kv, _ = table.gather()
        bs, sealed = table.bs, table.length // table.bs
        keys = kv[0].float()[:, :, :sealed * bs]  # keys: [B, Hkv, n*bs, D]
        b, hkv, _, d = keys.shape
        keys = keys.view(b, hkv, sealed, bs // t, t, d)  # [B, Hkv, nb, P, t, D]
        w = self.valid_tokens(table)[:, :sealed * bs].view(b, 1, sealed, bs // t, t, 1).float()
        cnt = w.sum(-2)  # cnt: [B, 1, nb, P, 1]
        mu = (keys * w).sum(-2) / cnt.clamp(min=1)  # mu: [B, Hkv, nb, P, D]
        var = ((keys - mu[..., None, :]).square() * w).sum(-2) / cnt.clamp(min=1)  # var: [B, Hkv, nb, P, D]
        if iso:
            var = var.mean(-1, keepdim=True).expand_as(var)
        h = q.shape[1]
        qg = q[:, :, 0].float().view(b, hkv, h // hkv, d) / math.sqrt(d)  # qg: [B, Hkv, G, D]
        logit = (torch.einsum("bkgd,bknpd->bkgnp", qg, mu) + 0.5 * torch.einsum("bkgd,bknpd->bkgnp", qg.square(), var)
                 + cnt[..., 0].clamp(min=1e-9).log()[:, :, None])  # logit: [B, Hkv, G, nb, P]
        logit = logit.masked_fill((cnt[..., 0] == 0)[:, :, None], -math.inf)
        mass = logit.flatten(3).softmax(-1).view_as(logit).sum(dim=(1, 2))  # mass: [B, nb, P]
        return mass.sum(-1).masked_fill(cnt[:, 0, :, :, 0].sum(-1) == 0, -math.inf)
    return fn


SCORES = {"oracle": (Simulated, oracle), "oracle-heads": (PerHead, oracle_heads),
          "mean-heads": (PerHead, mean_heads), "mean-maxheads": (Simulated, mean_maxheads),
          "mean-sumparts": (Simulated, mean_sumparts), "mean-lognormal": (Simulated, _lognormal(False)),
          "mean-iso": (Simulated, _lognormal(True))}


def make_simulated(name: str, **kw) -> SparPR:
    """A simulated variant by name (SCORES), with SparPR knobs kw."""
    cls, fn = SCORES[name]
    return cls(fn, **kw)
