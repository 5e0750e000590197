"""Which block-scoring rule picks the blocks attention needs, at which summary cost (issue 17s).

A dense teacher-forced decode of TUNING windows (alice29, seed 0); at every decode step and layer a
probe policy (reads everything, so no rule perturbs the next) applies each scoring rule to the
exact query and cached keys, picks blocks as SparPR does (sink, recent block, open block always;
the best-scoring others while the budget lasts) and measures, against exact attention:
  mass   = attention mass the kept tokens hold (mean over query heads)
  err    = |o_kept - o| / |o| of the attention output (renormalised over the kept tokens)
Per rule, per layer, averaged over steps, sequences. Also a token-level, per-KV-head top-k
reference (flexgen-topk's rule) for what 16-token blocks cost at all.

Usage (repo root): [PROBE_RULES="name,name"] [PROBE_TAG=_x] .venv/bin/python experiments/sparpr_summaries/probe.py [P] [WINDOWS] [STEPS] [KEEP]
(writes results/sparpr/summaries/probe_P<P>_k<KEEP><PROBE_TAG>.json; the findings: docs/sparpr.md, "Summary memory")
"""
import json
import math
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
import torch
from transformers import AutoTokenizer

from flexgen_sparpr.bench.forced import ForcedTokens
from flexgen_sparpr.bench.needle_prompt import normalise_filler
from flexgen_sparpr.bench.perplexity import windows
from flexgen_sparpr.bench.texts import TEXTS
from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.kv.policies.base import token_budget
from flexgen_sparpr.kv.policies.scoring import budgeted_pick
from flexgen_sparpr.kv.policy import KVPolicy, Selection
from flexgen_sparpr.weights.resolve import resolve_source

P = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
W = int(sys.argv[2]) if len(sys.argv) > 2 else 4
T = int(sys.argv[3]) if len(sys.argv) > 3 else 24
KEEP = float(sys.argv[4]) if len(sys.argv) > 4 else 0.1
BS = 16


def quant(x, how, parts=1, cal=None):
    """x: [..., d] summaries in float32 -> as stored (then dequantised for scoring)."""
    if how == "fp32":
        return x
    if how == "fp16":
        return x.half().float()
    if how.startswith("blk"):  # "blk4": symmetric int4, one scale per (block, KV head) over its runs (absmax)
        bits = int(how[3:])
        lim = 2 ** (bits - 1) - 1
        b_, k, n, d = x.shape
        xb = x.view(b_, k, -1, parts * d)
        s = xb.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / lim
        return ((xb / s).round().clamp(-lim, lim) * s).view(b_, k, n, d)
    if how.startswith("dim"):  # "dim4": symmetric int4, one static scale per (KV head, dim), from `cal`
        bits = int(how[3:])
        lim = 2 ** (bits - 1) - 1
        s = cal / lim  # [Hkv, D]
        return (x / s[None, :, None]).round().clamp(-lim, lim) * s[None, :, None]
    if how.startswith("int"):  # symmetric, one scale per vector (absmax)
        bits = int(how[3:])
        lim = 2 ** (bits - 1) - 1
        s = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / lim
        return (x / s).round().clamp(-lim, lim) * s
    raise ValueError(how)


class Rule:
    """tokens per summary t, a projection rank r (None: all D), storage, part->block and head aggregation."""

    def __init__(self, name, t, r=None, q="fp32", part="max", head="softmax", two_stage=None, pq=None, bits=None):
        self.name, self.t, self.r, self.q, self.part, self.head, self.two = name, t, r, q, part, head, two_stage
        self.pq, self.bits = pq, bits  # pq: (subspaces, centroid bits): keys replaced by their PQ reconstruction

    def cost(self, d=64, b=2):  # share of fp16 K+V
        if self.pq:
            return self.pq[0] * self.pq[1] / 8 / (self.t * 2 * d * b)
        if self.bits:
            return (self.r or d) * self.bits / 8 / (self.t * 2 * d * b)
        r = self.r or d
        if self.q[:3] == "blk":  # + one fp16 scale per block
            return (BS // self.t * r * int(self.q[3:]) / 8 + 2) / (BS * 2 * d * b)
        bits = {"fp32": 32, "fp16": 16, "int8": 8, "int4": 4, "int2": 2, "dim4": 4, "dim8": 8, "dim3": 3}[self.q]
        return r * bits / 8 / (self.t * 2 * d * b)

    def scores(self, q, keys, basis, cal=None):
        """q: [B, H, D]; keys: [B, Hkv, n*bs, D] -> [B, nb]. cal: per-layer calibration (PQ codebooks, scales)."""
        b, h, d = q.shape
        hkv = keys.shape[1]
        g = h // hkv
        if self.pq:
            keys = pq_reconstruct(keys, cal[self.pq])
        if self.r is not None and self.bits:  # PCA coordinates, each dim its own static scale
            u = basis[:, :, :self.r]
            kc = torch.einsum("bktd,kdr->bktr", keys, u)
            lim = 2 ** (self.bits - 1) - 1
            s = cal[("scale", self.r)] / lim  # [Hkv, r]
            kc = (kc / s[None, :, None]).round().clamp(-lim, lim) * s[None, :, None]
            keys = torch.einsum("bktr,kdr->bktd", kc, u)
        elif self.r is not None:
            u = basis[:, :, :self.r]  # u: [Hkv, D, r]
            keys = torch.einsum("bktd,kdr->bktr", keys, u)
            qq = torch.einsum("bkgd,kdr->bkgr", q.view(b, hkv, g, d), u)
        else:
            qq = q.view(b, hkv, g, d)
        n = keys.shape[2]
        summ = keys.view(b, hkv, n // self.t, self.t, -1).mean(dim=3)  # [B, Hkv, n/t, r]
        summ = quant(summ, self.q, BS // self.t, None if cal is None else cal.get(("dimscale", self.t)))
        if self.r is not None and self.bits:
            qq = q.view(b, hkv, g, d)
        logit = torch.einsum("bkgr,bkpr->bkgp", qq, summ) / math.sqrt(d)  # [B, Hkv, G, parts]
        if self.head == "softmax":
            per = logit.softmax(dim=-1)
        elif self.head == "sum":
            per = logit
        nb = n // BS
        per = per.view(b, hkv, g, nb, BS // self.t)
        if self.part == "max":
            blk = per.amax(dim=-1)
        elif self.part == "sum":
            blk = per.sum(dim=-1)
        if self.head == "max":
            return blk.amax(dim=(1, 2))
        return blk.sum(dim=(1, 2))


def kmeans(x, k, iters=8):
    """x: [G, N, d] -> centroids [G, k, d]."""
    g, n, d = x.shape
    idx = torch.stack([torch.randperm(n, generator=torch.Generator().manual_seed(i))[:k] for i in range(g)])
    c = x.gather(1, idx[..., None].expand(-1, -1, d)).clone()
    for _ in range(iters):
        a = torch.cdist(x, c).argmin(dim=-1)  # [G, N]
        s = torch.zeros_like(c).scatter_add_(1, a[..., None].expand(-1, -1, d), x)
        cnt = torch.zeros(g, k).scatter_add_(1, a, torch.ones(g, n))
        c = torch.where(cnt[..., None] > 0, s / cnt.clamp(min=1)[..., None], c)
    return c


def pq_train(keys, m, bits):
    """keys: [B, Hkv, S, D] -> codebooks [Hkv, m, 2^bits, D/m] (shared by the batch)."""
    b, hkv, s, d = keys.shape
    x = keys.permute(1, 0, 2, 3).reshape(hkv, b * s, m, d // m).permute(0, 2, 1, 3).reshape(hkv * m, b * s, d // m)
    return kmeans(x, 2 ** bits).view(hkv, m, 2 ** bits, d // m)


def pq_reconstruct(keys, cb):
    b, hkv, n, d = keys.shape
    m = cb.shape[1]
    x = keys.view(b, hkv, n, m, d // m).permute(1, 3, 0, 2, 4).reshape(hkv * m, b * n, d // m)
    c = cb.reshape(hkv * m, -1, d // m)
    a = torch.cdist(x, c).argmin(dim=-1)  # [Hkv*m, B*n]
    r = c.gather(1, a[..., None].expand(-1, -1, d // m))
    return r.view(hkv, m, b, n, d // m).permute(2, 0, 3, 1, 4).reshape(b, hkv, n, d)


RULES = [
    Rule("tok pca16 dim4", 1, r=16, bits=4, part="sum"),
    Rule("tok pca12 dim4", 1, r=12, bits=4, part="sum"),
    Rule("tok pca8 dim4", 1, r=8, bits=4, part="sum"),
    Rule("tok pca16 dim3", 1, r=16, bits=3, part="sum"),
    Rule("mean4 blk4", 4, q="blk4"),
    Rule("mean4 blk3", 4, q="blk3"),
    Rule("mean4 dim4", 4, q="dim4"),
    Rule("mean4 dim3", 4, q="dim3"),
    Rule("mean8 dim8", 8, q="dim8"),
    Rule("mean4 fp32 (now)", 4),
    Rule("mean4 fp16", 4, q="fp16"),
    Rule("mean4 int8", 4, q="int8"),
    Rule("mean4 int4", 4, q="int4"),
    Rule("mean8 fp16", 8, q="fp16"),
    Rule("mean8 int8", 8, q="int8"),
    Rule("mean16 fp16", 16, q="fp16"),
    Rule("mean4 sum-parts", 4, part="sum"),
    Rule("mean2 fp32", 2),
    Rule("mean1 fp32", 1),
    Rule("tok pca8 int8", 1, r=8, q="int8", part="sum"),
    Rule("tok pca8 fp16", 1, r=8, q="fp16", part="sum"),
    Rule("tok pca16 int8", 1, r=16, q="int8", part="sum"),
    Rule("tok pca16 int4", 1, r=16, q="int4", part="sum"),
    Rule("tok pca32 int4", 1, r=32, q="int4", part="sum"),
    Rule("tok pca8 int8 maxpart", 1, r=8, q="int8", part="max"),
    Rule("mean2 pca16 int8", 2, r=16, q="int8", part="sum"),
    Rule("mean2 pca16 int8 max", 2, r=16, q="int8", part="max"),
    Rule("mean4 pca16 fp16", 4, r=16, q="fp16"),
    Rule("mean4 pca32 int8", 4, r=32, q="int8"),
    Rule("mean4 pca16 fp16 sum", 4, r=16, q="fp16", part="sum"),
    Rule("tok pca16 fp32", 1, r=16, part="sum"),
    Rule("tok pca32 fp32", 1, r=32, part="sum"),
    Rule("tok pca16 int4 dimscale", 1, r=16, bits=4, part="sum"),
    Rule("tok pca32 int2 dimscale", 1, r=32, bits=2, part="sum"),
    Rule("tok pca8 int8 dimscale", 1, r=8, bits=8, part="sum"),
    Rule("tok pq8x8", 1, pq=(8, 8), part="sum"),
    Rule("tok pq4x8", 1, pq=(4, 8), part="sum"),
    Rule("tok pq8x6", 1, pq=(8, 6), part="sum"),
    Rule("tok pq16x4", 1, pq=(16, 4), part="sum"),
    Rule("tok fp32 (exact logits)", 1, part="sum"),
    Rule("tok fp32 exact maxpart", 1, part="max"),
]


def calibrate(k, basis):
    """k: [B, Hkv, S, D] prefill keys -> PQ codebooks and PCA coordinate scales."""
    cal = {}
    for r in RULES:
        if r.pq and r.pq not in cal:
            cal[r.pq] = pq_train(k, *r.pq)
        if r.q.startswith("dim") and ("dimscale", r.t) not in cal:  # absmax of the prefill's t-token means
            b_, hkv, s_, d = k.shape
            m = k[:, :, :s_ // r.t * r.t].reshape(b_, hkv, -1, r.t, d).mean(dim=3)
            cal[("dimscale", r.t)] = m.abs().amax(dim=(0, 2))  # [Hkv, D]
        if r.bits and ("scale", r.r) not in cal:
            kc = torch.einsum("bktd,kdr->bktr", k, basis[:, :, :r.r])
            cal[("scale", r.r)] = kc.abs().permute(1, 0, 2, 3).reshape(k.shape[1], -1, r.r).quantile(0.999, dim=1)
    return cal


ONLY = os.environ.get("PROBE_RULES")  # comma list of rule names to run (default: all)
if ONLY:
    RULES = [r for r in RULES if r.name in ONLY.split(",")]


class Probe(KVPolicy):
    name = "probe-17s"

    def __init__(self):
        self.basis = {}  # layer -> [Hkv, D, D] PCA of the prefill's keys
        self.cal = {}
        self.acc = {}  # (rule, layer) -> [mass_sum, err_sum, count]

    def on_prefill(self, table, layer, q, k, valid):
        x = k[0].float()  # [Hkv, S, D] (first sequence's prompt: a calibration sample)
        us = []
        for h in range(x.shape[0]):
            c = x[h] - x[h].mean(dim=0)
            _, _, vt = torch.linalg.svd(torch.cat([c, x[h].mean(dim=0, keepdim=True)]), full_matrices=False)
            us.append(vt.T)  # [D, D]
        self.basis[layer] = torch.stack(us)
        self.cal[layer] = calibrate(k.float(), self.basis[layer])

    def plan(self, table, layer):
        return None

    def select(self, table, layer, q):
        kv, _ = table.gather()
        keys, vals = kv[0].float(), kv[1].float()  # [B, Hkv, L, D]
        b, h, _, d = q.shape
        hkv, L = keys.shape[1], keys.shape[2]
        g = h // hkv
        qf = q.float()[:, :, 0]  # [B, H, D]
        logit = torch.einsum("bkgd,bktd->bkgt", qf.view(b, hkv, g, d), keys) / math.sqrt(d)
        p = logit.softmax(dim=-1)  # [B, Hkv, G, L]
        o = torch.einsum("bkgt,bktd->bkgd", p, vals)
        sealed = L // BS
        nb_len = sealed * BS
        ids = torch.arange(sealed)
        own = ((ids == 0) | (ids >= sealed - 1))[None].expand(b, -1)
        counts = torch.full((b, sealed), BS)
        floor = BS * 2 + L % BS
        budget = token_budget(KEEP, L, floor)
        room = torch.full((b,), budget) - BS * 2 - (L - nb_len)

        def measure(name, keep_tok):  # keep_tok: [B, Hkv, L] bool
            pk = p * keep_tok[:, :, None, :]
            mass = pk.sum(dim=-1)  # [B, Hkv, G]
            ok = torch.einsum("bkgt,bktd->bkgd", pk / mass[..., None], vals)
            err = (ok - o).norm(dim=-1) / o.norm(dim=-1).clamp(min=1e-6)
            a = self.acc.setdefault((name, layer), [0.0, 0.0, 0])
            a[0] += float(mass.mean()) * b
            a[1] += float(err.mean()) * b
            a[2] += b

        def tokens(pick):  # [B, nb] -> [B, Hkv, L]
            t = torch.ones(b, L, dtype=torch.bool)
            t[:, :nb_len] = pick.repeat_interleave(BS, dim=1)
            return t[:, None].expand(-1, hkv, -1)

        # references
        mblk = p[..., :nb_len].reshape(b, hkv, g, sealed, BS).sum(-1)  # [B, Hkv, G, nb]
        measure("oracle block, sum heads", tokens(budgeted_pick(mblk.sum(dim=(1, 2)), counts, room, own)))
        measure("oracle block, max heads", tokens(budgeted_pick(mblk.amax(dim=(1, 2)), counts, room, own)))
        rank = p.amax(dim=2)  # [B, Hkv, L] (flexgen-topk's rule)
        mask = torch.zeros(b, hkv, L, dtype=torch.bool)
        mask.scatter_(-1, rank.topk(budget, dim=-1).indices, True)
        measure("token top-k per KV head (flexgen-topk)", mask)
        ks = keys[:, :, :nb_len]
        for r in RULES:
            measure(r.name, tokens(budgeted_pick(r.scores(qf, ks, self.basis[layer], self.cal[layer]), counts, room, own)))
        return Selection.all(table)


def main():
    src = resolve_source("smollm2-135m", "")
    tok = AutoTokenizer.from_pretrained(src.tokenizer_dir)
    ids = tok(normalise_filler(TEXTS["alice29"].path.read_text(encoding="utf-8", errors="replace")),
              add_special_tokens=False)["input_ids"]
    ws = windows("alice29", ids, P, T, W, seed=0)
    probe = Probe()
    t0 = time.time()
    with Engine(src, Policy(gpu_batch_size=W), EngineConfig(device="cpu", block_size=BS)) as eng:
        eng.set_kv_policy(probe, attach=False)
        st = eng.prefill([w.prompt for w in ws], T + 1, ForcedTokens([w.forced for w in ws]))
        eng.decode(st)
    names = list(dict.fromkeys(n for n, _ in probe.acc))
    layers = sorted({l for _, l in probe.acc})
    rows = {}
    for n in names:
        per = [probe.acc[(n, l)] for l in layers]
        rows[n] = {"mass": sum(a[0] / a[2] for a in per) / len(per), "err": sum(a[1] / a[2] for a in per) / len(per),
                   "err_by_layer": [round(a[1] / a[2], 3) for a in per]}
    costs = {r.name: r.cost() for r in RULES}
    print(f"P={P} windows={W} steps={T} keep={KEEP} ({time.time() - t0:.0f}s)")
    for n, v in rows.items():
        c = costs.get(n)
        print(f"{n:42s} mass {v['mass']:.3f} err {v['err']:.3f}  share(fp16 cache) {'' if c is None else f'1/{1 / c:.0f}'}")
    out = os.path.join("results", "sparpr", "summaries", f"probe_P{P}_k{KEEP}{os.environ.get('PROBE_TAG', '')}.json")
    json.dump({"P": P, "windows": W, "steps": T, "keep": KEEP, "rows": rows, "costs": costs}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
