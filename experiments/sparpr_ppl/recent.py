"""Why SparPR's perplexity at keep 0.1 is far from dense's: its recent window (recent_blocks) on the
TUNING split (alice29). One dense prefill, SparPR variants decode teacher-forced from it.
Usage (repo root): .venv/bin/python experiments/sparpr_ppl/recent.py [P] [WINDOWS] [KEEP]"""
import math, os, sys
os.environ.setdefault("HF_HUB_OFFLINE", "1"); os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
from transformers import AutoTokenizer
from flexgen_sparpr.bench.forced import ForcedTokens
from flexgen_sparpr.bench.needle_prompt import normalise_filler
from flexgen_sparpr.bench.perplexity import windows
from flexgen_sparpr.bench.texts import TEXTS
from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.kv.policy import make_policy
from flexgen_sparpr.weights.resolve import resolve_source

P = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
W = int(sys.argv[2]) if len(sys.argv) > 2 else 4
KEEP = float(sys.argv[3]) if len(sys.argv) > 3 else 0.1
T = 64
src = resolve_source("smollm2-135m", "")
tok = AutoTokenizer.from_pretrained(src.tokenizer_dir)
ids = tok(normalise_filler(TEXTS["alice29"].path.read_text(encoding="utf-8", errors="replace")),
          add_special_tokens=False)["input_ids"]
ws = windows("alice29", ids, P, T, W, seed=0)
variants = {f"recent_blocks={r}": make_policy("sparpr", keep_ratio=KEEP, recent_blocks=r) for r in (1, 4, 8, 16)}
with Engine(src, Policy(gpu_batch_size=W), EngineConfig(device="cpu", block_size=16)) as eng:
    dense = make_policy("dense")
    eng.set_kv_policy(dense, attach=False)
    st = eng.prefill([w.prompt for w in ws], T + 1, ForcedTokens([w.forced for w in ws]),
                     observers=tuple(variants.values()))
    snap = eng.snapshot(st)
    base = None
    for name, pol in [("dense", dense), *variants.items()]:
        eng.set_kv_policy(pol, attach=False)
        s = eng.restore(snap)
        s.sampler = ForcedTokens([w.forced[1:] for w in ws])
        eng.decode(s)
        nll = s.sampler.nll.mean(dim=1)  # per window
        base = nll if base is None else base
        print(f"{name:18s} ppl {math.exp(float(s.sampler.nll.mean())):8.2f}  ratio to dense "
              f"{math.exp(float((nll - base).mean())):.3f}  per window {[round(math.exp(float(x)), 3) for x in nll - base]}",
              flush=True)
