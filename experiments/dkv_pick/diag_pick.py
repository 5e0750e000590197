"""Which rows does the pick keep exact in the needle's block? Are the key's digits among them?"""
import os, random, sys
os.environ.setdefault("HF_HUB_OFFLINE", "1"); os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))  # scripts/_common.py
from _common import REPO
from transformers import AutoTokenizer
from flexgen_sparpr.bench.needle_prompt import NeedlePrompts, random_key
from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.weights.resolve import resolve_source
import flexgen_sparpr.kv.dkv.importance as imod

length, pick = int(sys.argv[1]), sys.argv[2]
window = int(sys.argv[3]) if len(sys.argv) > 3 else 32
src = resolve_source("smollm2-135m", "")
tok = AutoTokenizer.from_pretrained(src.tokenizer_dir)
builder = NeedlePrompts(tok, REPO / "tests/data/alice29.txt", "The secret passkey is")
rng = random.Random(0)
depths = (0.25, 0.75)
trials = [builder.build(length, depths[i], random_key(rng, 5), rng) for i in range(2)]
imps = []
orig = imod.observation_importance
def rec(q, k, valid, window=32):
    out = orig(q, k, valid, window); imps.append(out); return out
imod.observation_importance = rec
cfg = EngineConfig(device="cpu", block_size=256, kv_policy="dkv",
                   policy_args={"rank": 32, "residuals": 16, "residual_pick": pick, "pick_window": window})
with Engine(src, Policy(gpu_batch_size=2, cache_gpu_percent=100), cfg) as eng:
    st = eng.prefill([t.ids for t in trials], 2)
    L = src.spec.num_layers
    for b, t in enumerate(trials):
        nd = builder._needle(t.key)
        digits = [t.needle_at + i for i, x in enumerate(nd) if tok.decode([x]).strip().isdigit()]
        blk = digits[0] // 256
        print(f"trial {b} key {t.key} digits at {digits} block {blk} (sealed {len(t.ids)//256})")
        kept_all, ranks = [], []
        for layer in range(L):
            tab = eng.tables[(layer, 0)]
            p = tab.store.codec.parts(tab.rows([blk]))
            res = set((p.res_idx[0, b].long() + blk * 256).tolist())
            imp = imps[layer][b, blk * 256:(blk + 1) * 256] if imps else None
            kept = sum(d in res for d in digits)
            kept_all.append(kept)
            if imp is not None:
                order = imp.argsort(descending=True).tolist()
                ranks.append([order.index(d - blk * 256) for d in digits])
                top = [tok.decode([t.ids[blk * 256 + i]]) for i in order[:16]]
            print(f"  layer {layer:2d}: digits kept {kept}/{len(digits)}" +
                  (f" imp ranks {ranks[-1]} top16 {top}" if imp is not None else ""))
        print(f"  digits kept over layers: {sum(kept_all)}/{len(digits) * L}")
