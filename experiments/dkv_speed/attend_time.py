"""DKV's decode attention timed alone (issue 16): TUNING passkey prompts
(alice29) at N tokens, batch 2, block 256; 5 decodes of 16 tokens from one prefill; prints the
best decode's ms a step and the attention's (DKV.attend) ms a layer-step. For an A/B of two
engine versions, run it alternately from two checkouts:

  for r in 1 2 3; do for wt in OLD NEW; do (cd $wt && PYTHONPATH=$wt .venv/bin/python \
      experiments/dkv_speed/attend_time.py 4096 $(basename $wt)); done; done

(the engine's threads as torch sets them; the attention itself runs on --dkv-decode-threads).
"""
import os
import random
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from transformers import AutoTokenizer
from flexgen_sparpr.bench.needle_prompt import NeedlePrompts
from flexgen_sparpr.bench.tasks import build_trial
from flexgen_sparpr.bench.texts import SPLITS, TEXTS
from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.weights.resolve import resolve_source
from flexgen_sparpr.kv.policies.dkv import DKV
n = int(sys.argv[1])
src = resolve_source("smollm2-135m", "")
tok = AutoTokenizer.from_pretrained(src.tokenizer_dir)
b = NeedlePrompts(tok, TEXTS[SPLITS["tuning"].texts[0]].path, "The secret passkey is")
rng = random.Random(5)
trials = [build_trial("passkey", b, n, 0.5, rng) for _ in range(2)]
T = [0.0]
orig = DKV.attend
def timed(self, *a, **k):
    t0 = time.perf_counter(); r = orig(self, *a, **k); T[0] += time.perf_counter() - t0; return r
DKV.attend = timed
eng = Engine(src, Policy(gpu_batch_size=2), EngineConfig(device="cpu", block_size=256, kv_policy="dkv"))
snap = eng.snapshot(eng.prefill([t.ids for t in trials], 16))
eng.decode(eng.restore(snap))
res = []
for _ in range(5):
    T[0] = 0; t0 = time.perf_counter(); eng.decode(eng.restore(snap)); res.append((time.perf_counter() - t0, T[0]))
best = min(res)
print(sys.argv[2] if len(sys.argv) > 2 else 'dkv', f"step {best[0]/15*1000:.1f} ms, attend {min(r[1] for r in res)/15/30*1000:.3f} ms/layer-step", flush=True)
eng.close()
