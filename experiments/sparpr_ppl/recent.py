"""Why SparPR's perplexity at keep 0.1 is far from dense's: its recent window (recent_blocks) on the
TUNING split (alice29). One dense prefill, SparPR variants decode teacher-forced from it.
Usage (repo root): .venv/bin/python experiments/sparpr_ppl/recent.py [P] [WINDOWS] [KEEP]"""
import os
import sys
os.environ.setdefault("HF_HUB_OFFLINE", "1"); os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
from transformers import AutoTokenizer
from flexgen_sparpr.kv.policies import make_policy
from flexgen_sparpr.weights.resolve import resolve_source
from forced import ppl_from_one_prefill, text_windows  # this folder (run as a script: it is on sys.path)

P = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
W = int(sys.argv[2]) if len(sys.argv) > 2 else 4
KEEP = float(sys.argv[3]) if len(sys.argv) > 3 else 0.1
T = 64
src = resolve_source("smollm2-135m", "")
tok = AutoTokenizer.from_pretrained(src.tokenizer_dir)
ws = text_windows(tok, ["alice29"], P, T, W, seed=0)
variants = {f"recent_blocks={r}": make_policy("sparpr", keep_ratio=KEEP, recent_blocks=r) for r in (1, 4, 8, 16)}
ppl_from_one_prefill(src, ws, variants, T)
