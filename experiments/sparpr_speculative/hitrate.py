"""How well does layer j+1's selection from layer j's input (one layer early) cover the exact one?

Ad-hoc measurement behind docs/sparpr.md's speculative-prefetch numbers (README.md beside it):
  .venv/bin/python experiments/sparpr_speculative/hitrate.py smollm2 2048 0.25
  .venv/bin/python experiments/sparpr_speculative/hitrate.py opt 2048 0.25
Batch 4, 8 new tokens, SparPR selection only (quest_only), cache on the compute tier (where it
lives does not change what is selected)."""
import sys, random, os
from pathlib import Path
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import torch
from flexgen_sparpr.weights.resolve import resolve_source
from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.kv.policies.sparpr import SparPR
from flexgen_sparpr.engine.weights import sub_weights

model, ctx, keep = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
gen = 8
if model == "smollm2":
    from transformers import AutoTokenizer
    from flexgen_sparpr.bench.needle_prompt import NeedlePrompts, random_key
    src = resolve_source("smollm2-135m", "")
    tok = AutoTokenizer.from_pretrained(src.tokenizer_dir)
    b = NeedlePrompts(tok, REPO / "tests" / "data" / "alice29.txt")
    rng = random.Random(0)
    prompts = [b.build(ctx, d, random_key(rng, 5), rng).ids for d in (0.25, 0.75, 0.5, 0.1)]
else:
    from _common import random_prompts
    src = resolve_source("opt-125m", "_DUMMY_", max_seq_len=ctx + gen, seed=0)
    prompts = random_prompts(src.spec.vocab, 4, ctx, 0)
pol = SparPR(keep_ratio=keep, min_keep=min(0.1, keep), quest_only=True)
eng = Engine(src, Policy(gpu_batch_size=4), EngineConfig(device="cpu", block_size=64, kv_policy="dense"))
eng.set_kv_policy(pol)
stats = {"pairs": 0, "covered": 0, "spec_pairs": 0, "cells": 0, "full_hit": 0}
prev = {}
real = Engine._attention
def pairs(sel, t):
    bs = sel.blocks
    if sel.seqs is None:
        return {(b, s) for b in bs for s in range(t.block_shape[1])}
    return {(b, s) for j, b in enumerate(bs) for s in range(sel.seqs.shape[0]) if bool(sel.seqs[s, j])}
def patched(self, w, x, layer_idx, k, pos, pads, fetched, prefill):
    if not prefill:
        t = self.tables[(layer_idx, k)]
        a = self.arch
        sealed = t.length // t.bs
        if layer_idx - 1 in prev:
            xp = prev[layer_idx - 1]
            q_spec = a.query(w, a.attn_input(w, xp), pos)
            q = a.query(w, a.attn_input(w, x), pos)
            s_spec, s_ex = pairs(pol.select(t, layer_idx, q_spec), t), pairs(pol.select(t, layer_idx, q), t)
            s_spec = {p for p in s_spec if p[0] < sealed}; s_ex = {p for p in s_ex if p[0] < sealed}
            stats["pairs"] += len(s_ex); stats["covered"] += len(s_ex & s_spec); stats["spec_pairs"] += len(s_spec)
            stats["cells"] += 1; stats["full_hit"] += s_ex <= s_spec
        prev[layer_idx] = x
    return real(self, w, x, layer_idx, k, pos, pads, fetched, prefill)
Engine._attention = patched
with torch.inference_mode():
    st = eng.prefill(prompts, gen)
    eng.decode(st)
eng.close()
print(model, ctx, keep, {k: v for k, v in stats.items()}, f"coverage {stats['covered']/max(1,stats['pairs']):.3f}, cells fully covered {stats['full_hit']/max(1,stats['cells']):.3f}")
