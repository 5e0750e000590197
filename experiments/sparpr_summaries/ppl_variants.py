"""SparPR selection variants end to end: teacher-forced perplexity on TUNING windows (alice29,
seed 0), one dense prefill, every variant decodes from it (issue 17s).

Variants simulate a scoring rule from the cached keys (probe.py's Rule: the summaries a rule would
store are a deterministic function of the keys, so computing them on the fly picks the same blocks)
or score blocks exactly (the block oracle). The rest is SparPR's: sink, recent block, open block,
per-sequence top-k under the budget, no dynamic budget (keep is the ceiling).

Usage (repo root): .venv/bin/python experiments/sparpr_summaries/ppl_variants.py P WINDOWS STEPS KEEP VARIANT[,VARIANT...]
VARIANT: dense-ref names below, or a probe.py rule name with spaces as '_'.
"""
import math
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
import torch
from transformers import AutoTokenizer

sys.path.insert(0, os.path.dirname(__file__))
from probe import RULES, Rule  # noqa: E402

from flexgen_sparpr.bench.forced import ForcedTokens
from flexgen_sparpr.bench.needle_prompt import normalise_filler
from flexgen_sparpr.bench.perplexity import windows
from flexgen_sparpr.bench.texts import TEXTS
from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.kv.policies import make_policy
from flexgen_sparpr.kv.policies.scoring import budgeted_pick, picked_tokens
from flexgen_sparpr.kv.policies.sparpr import SparPR

P, W, T, KEEP = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
NAMES = sys.argv[5].split(",")
BS = 16


class Simulated(SparPR):
    """SparPR whose block scores come from `score_fn(self, table, layer, q) -> [B, nb]`."""

    def __init__(self, score_fn, **kw):
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

    def top_k(self, table, layer, q, budgets):
        b = q.shape[0]
        bs, sealed = table.bs, table.length // table.bs
        valid, counts = self.block_counts(table)
        score = self.score_fn(self, table, layer, q)  # [B, nb]
        ids = torch.arange(sealed, device=q.device)
        sink = ids[None, :] == (self.pads(table) // bs)[:, None]
        own = sink | (ids >= sealed - self.recent_blocks)[None, :]
        used = (counts * own).sum(dim=1) + valid[:, sealed * bs:].sum(dim=1)
        pick = budgeted_pick(score, counts, torch.tensor(budgets, device=q.device) - used, own)
        return picked_tokens(pick, table) & valid


def oracle(self, table, layer, q):
    kv, _ = table.gather()
    keys = kv[0].float()
    b, h, _, d = q.shape
    hkv, L = keys.shape[1], keys.shape[2]
    p = torch.einsum("bkgd,bktd->bkgt", q.float().view(b, hkv, h // hkv, d), keys).div(math.sqrt(d)).softmax(-1)
    sealed = L // table.bs
    return p[..., :sealed * table.bs].reshape(b, hkv, h // hkv, sealed, table.bs).sum(dim=(-1, 1, 2))


def rule_fn(rule: Rule):
    def fn(self, table, layer, q):
        kv, _ = table.gather()
        sealed = table.length // table.bs
        return rule.scores(q.float()[:, :, 0], kv[0].float()[:, :, :sealed * table.bs], self.basis[layer])
    return fn


def make(name):
    if name == "sparpr":
        return make_policy("sparpr", keep_ratio=KEEP, dynamic_budget=False)
    if name == "oracle":
        return Simulated(oracle, keep_ratio=KEEP, dynamic_budget=False)
    if name.startswith("flexgen-topk"):
        return make_policy("flexgen-topk", keep_ratio=KEEP)
    rules = {r.name.replace(" ", "_"): r for r in RULES}
    return Simulated(rule_fn(rules[name]), keep_ratio=KEEP, dynamic_budget=False)


def main():
    src = resolve = None
    from flexgen_sparpr.weights.resolve import resolve_source
    src = resolve_source("smollm2-135m", "")
    tok = AutoTokenizer.from_pretrained(src.tokenizer_dir)
    ids = tok(normalise_filler(TEXTS["alice29"].path.read_text(encoding="utf-8", errors="replace")),
              add_special_tokens=False)["input_ids"]
    ws = windows("alice29", ids, P, T, W, seed=0)
    variants = {n: make(n) for n in NAMES}
    with Engine(src, Policy(gpu_batch_size=W), EngineConfig(device="cpu", block_size=BS)) as eng:
        dense = make_policy("dense")
        eng.set_kv_policy(dense, attach=False)
        st = eng.prefill([w.prompt for w in ws], T + 1, ForcedTokens([w.forced for w in ws]),
                         observers=tuple(variants.values()))
        snap = eng.snapshot(st)
        base = None
        for name, pol in [("dense", dense), *variants.items()]:
            t0 = time.time()
            eng.set_kv_policy(pol, attach=False)
            s = eng.restore(snap)
            s.sampler = ForcedTokens([w.forced[1:] for w in ws])
            eng.decode(s)
            nll = s.sampler.nll.mean(dim=1)  # per window
            base = nll if base is None else base
            d = nll - base
            print(f"{name:28s} ppl {math.exp(float(s.sampler.nll.mean())):8.2f}  ratio {math.exp(float(d.mean())):.4f}"
                  f"  per window {[round(math.exp(float(x)), 3) for x in d]}  ({time.time() - t0:.0f}s)", flush=True)


if __name__ == "__main__":
    main()
