"""Fidelity of DKV with a residual pick variant: answers + digits kept per layer (needle block)."""
import os, random, sys, math
os.environ.setdefault("HF_HUB_OFFLINE", "1"); os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))  # scripts/_common.py
from _common import REPO
from transformers import AutoTokenizer
from flexgen_sparpr.bench.needle_prompt import NeedlePrompts, random_key, passkey_hit
from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.weights.resolve import resolve_source
import flexgen_sparpr.kv.dkv.importance as imod

lengths = [int(x) for x in sys.argv[1].split(",")]
pick, window, agg = sys.argv[2], int(sys.argv[3]), sys.argv[4]
ntr = int(sys.argv[5]) if len(sys.argv) > 5 else 2
res = int(os.environ.get("RES", 16))

CALLS = []
LAYERS = tuple(int(x) for x in os.environ.get("LAYERS", "0,99").split(","))
def variant(q, k, valid, window=32):
    b, h, s, d = q.shape; hkv = k.shape[1]; w = min(window, s)
    qpos = torch.arange(s - w, s); causal = torch.arange(s)[None] <= qpos[:, None]
    mask = valid[:, None, :] & causal[None]
    qw = q[:, :, s - w:].float().unflatten(1, (hkv, h // hkv))
    outs = []
    for g in range(hkv):
        sc = torch.einsum("bqwd,bsd->bqws", qw[:, g], k[:, g].float()) / math.sqrt(d)
        p = sc.masked_fill(~mask[:, None], float("-inf")).softmax(-1)  # [B, G, W, S]
        outs.append(p)
    p = torch.cat(outs, 1)  # [B, H, W, S]
    if agg.startswith("oracle"):  # the needle sentence's tokens first (ORACLE: [B] lists of positions)
        CALLS.append(1)
        layer = len(CALLS) - 1
        out = torch.rand(b, s) * 1e-3
        lo, hi = LAYERS
        if not (lo <= layer < hi):
            return out
        for i, pos in enumerate(ORACLE):
            out[i, pos] = 1.0
        return out
    if agg.startswith("pool") or agg.startswith("fwd"):
        kk = int(agg[4:] if agg.startswith("pool") else agg[3:])
        base = p.sum(dim=(1, 2))  # [B, S]
        x = base[:, None]
        if agg.startswith("pool"):
            pooled = torch.nn.functional.max_pool1d(x, kk, stride=1, padding=kk // 2)[:, 0, :s]
        else:  # a token inherits the importance of the kk-1 tokens before it (what an induction head reads next)
            pooled = torch.nn.functional.max_pool1d(torch.nn.functional.pad(x, (kk - 1, 0), value=0.0), kk, stride=1)[:, 0]
        return pooled + base
    if agg == "max":
        return p.amax(dim=(1, 2))
    if agg == "headmax":  # sum over window, max over heads
        return p.sum(2).amax(1)
    if agg == "norm":  # each head's window mass normalised by its mean over tokens: sink heads don't own it
        ph = p.sum(2)  # [B, H, S]
        return (ph / ph.amax(-1, keepdim=True)).sum(1)
    return p.sum(dim=(1, 2))
if agg != "sum":
    imod.observation_importance = variant
imps = []
orig = imod.observation_importance
def rec(*a, **kw):
    out = orig(*a, **kw); imps.append(out); return out
imod.observation_importance = rec

src = resolve_source("smollm2-135m", "")
tok = AutoTokenizer.from_pretrained(src.tokenizer_dir)
builder = NeedlePrompts(tok, REPO / "tests/data/alice29.txt", "The secret passkey is")
rng = random.Random(0)
depths = (0.25, 0.75, 0.5, 0.1, 0.9)
plans = {n: [builder.build(n, depths[i % 5], random_key(rng, 5), rng) for i in range(ntr)] for n in lengths}
eos = src.spec.eos_id
for n in lengths:
    trials = plans[n]
    imps.clear(); CALLS.clear()
    ORACLE = []
    for t in trials:
        nd = builder._needle(t.key)
        dg = [t.needle_at + i for i, x in enumerate(nd) if tok.decode([x]).strip().isdigit()]
        ORACLE.append(dg if agg == "oracle-digits" else list(range(t.needle_at, t.needle_at + len(nd))))
    cfg = EngineConfig(device="cpu", block_size=256, kv_policy="dkv",
                       policy_args={"rank": 32, "residuals": res, "residual_pick": pick, "pick_window": window})
    with Engine(src, Policy(gpu_batch_size=len(trials), cache_gpu_percent=100), cfg) as eng:
        st = eng.prefill([t.ids for t in trials], 12)
        kept = []
        for b, t in enumerate(trials):
            nd = builder._needle(t.key)
            digits = [t.needle_at + i for i, x in enumerate(nd) if tok.decode([x]).strip().isdigit()]
            blk = digits[0] // 256
            if blk >= n // 256 - 1:
                kept.append("recent"); continue
            c = 0
            for layer in range(src.spec.num_layers):
                tab = eng.tables[(layer, 0)]
                r = set((tab.store.codec.parts(tab.rows([blk])).res_idx[0, b].long() + blk * 256).tolist())
                c += sum(d in r for d in digits)
            kept.append(f"{c}/{5 * src.spec.num_layers}")
        out = eng.decode(st, stop=eos)
    ans = []
    for t, toks in zip(trials, out.tokens):
        toks = toks[:toks.index(eos)] if eos in toks else toks
        txt = tok.decode(toks, skip_special_tokens=True); ans.append((t.key, txt.strip(), passkey_hit(txt, t.key)))
    print(f"{pick} W{window} {agg} m{res} @ {n}: {sum(a[2] for a in ans)}/{len(ans)} {ans} digits kept {kept}", flush=True)
