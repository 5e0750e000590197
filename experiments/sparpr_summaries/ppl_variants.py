"""SparPR selection variants end to end: teacher-forced perplexity on TUNING windows (alice29,
seed 0), one dense prefill, every variant decodes from it (issue 17s).

Variants simulate a scoring rule from the cached keys (probe.py's Rule: the summaries a rule would
store are a deterministic function of the keys, so computing them on the fly picks the same blocks)
or score blocks exactly (the block oracle). The rest is SparPR's: sink, recent block, open block,
per-sequence top-k under the budget, no dynamic budget (keep is the ceiling).

Usage (repo root): .venv/bin/python experiments/sparpr_summaries/ppl_variants.py P WINDOWS STEPS KEEP VARIANT[,VARIANT...]
VARIANT: sparpr, sparpr-<summary>[@rank] (the engine's other summaries; lowrank's summary_rank), oracle (exact block mass, one set per sequence), oracle-heads (per KV head),
mean-heads (SparPR's summaries, per KV head), mean-maxheads (one set, a block scored
by its best KV head's mass), tail-R-V (SparPR + left-out blocks as virtual
tokens), flexgen-topk, another of simulated.py's SCORES (mean-sumparts, mean-lognormal,
mean-iso), or a probe.py rule name with spaces as '_'.
Env: PPL_TEXT (comma list; default the tuning text alice29), PPL_SEED (default 0), PPL_BS (block
tokens, default 16). Outputs kept: results/ppl/explore/ceiling-held-out.txt, variants-tuning.txt.
"""
import math
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
import torch
from transformers import AutoTokenizer

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "sparpr_ppl"))
from forced import ppl_from_one_prefill, text_windows  # noqa: E402
from probe import RULES, Rule  # noqa: E402
from simulated import SCORES, PerHead, Simulated, make_simulated, mean_heads, mean_maxheads, oracle, oracle_heads  # noqa: E402

from flexgen_sparpr.kv.policies import make_policy
from flexgen_sparpr.kv.policies.sparpr import SparPR

P, W, T, KEEP = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
NAMES = sys.argv[5].split(",")
BS = int(os.environ.get("PPL_BS", 16))
TEXT, SEED = os.environ.get("PPL_TEXT", "alice29"), int(os.environ.get("PPL_SEED", 0))


class Tail(SparPR):
    """SparPR's pick attended exactly; every sealed block it left out joins the softmax through
    virtual tokens made from its summaries (simulated here from the cached keys and values):
    `run` tokens per virtual key (its mean key, logit + log(count)) and `vrun` per mean value."""
    attends = True

    def __init__(self, run, vrun, **kw):
        super().__init__(**{"summary": "mean", **kw})  # its virtual tokens read the 4-token means
        self.run, self.vrun = run, vrun

    def attend(self, table, layer, q, k, v, pads):
        from flexgen_sparpr.kv.policies.base import token_budget
        from flexgen_sparpr.models.layers import attention_with_lse, merge_attention
        n_valid = [table.length - p for p in self.host_pads(table)]
        budgets = [token_budget(self.keep_ratio, n, self.floor(table)) for n in n_valid]
        keep = self.top_k(table, layer, q, budgets)  # [B, L]
        valid = self.valid_tokens(table)  # [B, L]
        sealed = table.length // table.bs
        jobs = table.append(k, v)
        kv, pos = table.gather()
        L = keep.shape[1]
        keep = torch.cat([keep, keep.new_ones(keep.shape[0], kv.shape[3] - L)], 1)
        ok = torch.cat([valid, valid.new_ones(valid.shape[0], kv.shape[3] - L)], 1)
        parts = [attention_with_lse(q, kv[0], kv[1], keep & ok)]
        n = sealed * table.bs
        out = (~keep[:, :n] & ok[:, :n]).float()  # [B, n] tokens left out
        if out.sum() > 0:
            b, hkv, d = kv.shape[1], kv.shape[2], kv.shape[4]
            w = out[:, None, :, None]
            kk = (kv[0, :, :, :n].float() * w).view(b, hkv, n // self.run, self.run, d).sum(3)
            cnt = out.view(b, n // self.run, self.run).sum(2)  # [B, nk]
            kk = kk / cnt.clamp(min=1)[:, None, :, None]
            vv = (kv[1, :, :, :n].float() * w).view(b, hkv, n // self.vrun, self.vrun, d).sum(3)
            vc = out.view(b, n // self.vrun, self.vrun).sum(2)
            vv = (vv / vc.clamp(min=1)[:, None, :, None]).repeat_interleave(self.vrun // self.run, dim=2)
            h = q.shape[1]
            qg = q.float().view(b, hkv, h // hkv, 1, d)
            sc = torch.einsum("bkgqd,bktd->bkgqt", qg, kk) / math.sqrt(d) + cnt.clamp(min=1e-9).log()[:, None, None, None, :]
            sc = sc.masked_fill((cnt == 0)[:, None, None, None, :], -math.inf)
            lse = torch.logsumexp(sc, -1)
            safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
            o = torch.einsum("bkgqt,bktd->bkgqd", torch.exp(sc - safe[..., None]), vv)
            parts.append((o.reshape(b, h, 1, d), lse.reshape(b, h, 1)))
        return merge_attention(parts).to(q.dtype), jobs


def rule_fn(rule: Rule):
    def fn(self, table, layer, q):
        kv, _ = table.gather()
        sealed = table.length // table.bs
        return rule.scores(q.float()[:, :, 0], kv[0].float()[:, :, :sealed * table.bs], self.basis[layer])
    return fn


def make(name):
    if name == "sparpr":
        return make_policy("sparpr", keep_ratio=KEEP, dynamic_budget=False)
    if name.startswith("sparpr-"):  # sparpr-<summary>[@rank]: the engine's other summaries (sparpr-lowrank@0.5)
        summary, _, rank = name.split("-", 1)[1].partition("@")
        extra = {"summary_rank": float(rank)} if rank else {}
        return make_policy("sparpr", keep_ratio=KEEP, dynamic_budget=False, summary=summary, **extra)
    if name.startswith("tail"):  # tail-<run>-<vrun>
        _, run, vrun = name.split("-")
        return Tail(int(run), int(vrun), keep_ratio=KEEP, dynamic_budget=False)
    if name == "oracle-heads":
        return PerHead(oracle_heads, keep_ratio=KEEP, dynamic_budget=False)
    if name == "mean-heads":
        return PerHead(mean_heads, keep_ratio=KEEP, dynamic_budget=False)
    if name == "mean-maxheads":
        return Simulated(mean_maxheads, keep_ratio=KEEP, dynamic_budget=False)
    if name == "oracle":
        return Simulated(oracle, keep_ratio=KEEP, dynamic_budget=False)
    if name in SCORES:  # the other simulated selections (simulated.py)
        return make_simulated(name, keep_ratio=KEEP, dynamic_budget=False)
    if name.startswith("flexgen-topk"):
        return make_policy("flexgen-topk", keep_ratio=KEEP)
    rules = {r.name.replace(" ", "_"): r for r in RULES}
    return Simulated(rule_fn(rules[name]), keep_ratio=KEEP, dynamic_budget=False)


def main():
    from flexgen_sparpr.weights.resolve import resolve_source
    src = resolve_source("smollm2-135m", "")
    tok = AutoTokenizer.from_pretrained(src.tokenizer_dir)
    ws = text_windows(tok, TEXT.split(","), P, T, W, SEED)  # PPL_TEXT / PPL_SEED: tuning alice29 / 0 unless told
    ppl_from_one_prefill(src, ws, {n: make(n) for n in NAMES}, T, BS)


if __name__ == "__main__":
    main()
