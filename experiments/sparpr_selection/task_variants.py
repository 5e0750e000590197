"""SparPR selection variants on the harder retrieval tasks (issue 16): every variant decodes from
the same dense prefill as dense, so the scores differ only by selection. Tune on the TUNING split
(alice29, depths 0.25 / 0.75, seed 0); check a chosen variant once on the held-out split.

Usage (repo root):
  .venv/bin/python experiments/sparpr_selection/task_variants.py [--split tuning] \
      [--tasks phrase,multi-value,multi-key,passkey] [--length 2048] [--trials 10] [--keep 0.1] \
      --variants "default;summary_tokens=2"
A variant is a comma list of SparPR knobs, as sparpr_variants.py reads them (recent_blocks,
summary_tokens, per_sequence, head_score, summary, summary_rank); "default" is the policy's defaults; "sim=NAME" a
simulated selection of ../sparpr_summaries/simulated.py (oracle, oracle-heads, mean-heads,
mean-maxheads, mean-sumparts). Prints per task: dense hits, each variant's hits and the
trials whose canonical answer equals dense's.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[2]

from flexgen_sparpr.bench.forced import ForcedTokens  # noqa: E402
from flexgen_sparpr.bench.needle_prompt import NeedlePrompts  # noqa: E402
from flexgen_sparpr.bench.tasks import build_trial, canonical, hit  # noqa: E402
from flexgen_sparpr.bench.texts import SPLITS, TEXTS  # noqa: E402
from flexgen_sparpr.engine.config import EngineConfig, Policy  # noqa: E402
from flexgen_sparpr.engine.executor import Engine  # noqa: E402
from flexgen_sparpr.kv.policies import make_policy  # noqa: E402
from flexgen_sparpr.kv.policies.sparpr import SparPR  # noqa: E402
from flexgen_sparpr.weights.resolve import resolve_source  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sparpr_summaries"))
from simulated import SCORES, make_simulated  # noqa: E402
from sparpr_variants import parse_variant  # noqa: E402  (the same knob syntax)


def variant_kw(text: str) -> dict:
    if text.startswith("sim="):
        if text[4:] not in SCORES:
            raise ValueError(f"unknown simulated selection {text[4:]!r} (known: {', '.join(SCORES)})")
        return {"sim": text[4:]}
    return parse_variant(text)


def new_policy(kw: dict, keep: float) -> SparPR:
    common = {"keep_ratio": keep, "dynamic_budget": False, "fallback": False}
    return make_simulated(kw["sim"], **common) if "sim" in kw else SparPR(**common, **kw)

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--split", default="tuning", choices=sorted(SPLITS))
    ap.add_argument("--tasks", default="phrase,multi-value,multi-key,passkey")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--batch", type=int, default=5)
    ap.add_argument("--keep", type=float, default=0.1)
    ap.add_argument("--variants", default="default;summary_tokens=2")
    args = ap.parse_args()
    variants = {v: variant_kw(v) for v in args.variants.split(";") if v}
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    split = SPLITS[args.split]
    src = resolve_source("smollm2-135m", "")
    tok = AutoTokenizer.from_pretrained(src.tokenizer_dir)
    builders = [(NeedlePrompts(tok, TEXTS[t].path, "The secret passkey is"), t) for t in split.texts]
    rng = random.Random(split.seed + 7)  # not needle.py's stream: other prompts than its reported grid
    eos, t0 = src.spec.eos_id, time.time()
    print(f"# split {args.split}, {args.length} tokens, keep {args.keep}, {args.trials} trials per task", flush=True)
    with Engine(src, Policy(gpu_batch_size=args.batch), EngineConfig(device="cpu", block_size=16)) as eng:
        for task in args.tasks.split(","):
            score = {name: [0, 0] for name in ["dense", *variants]}  # hits, same-as-dense
            for i in range(0, args.trials, args.batch):
                trials = [build_trial(task, builders[j % len(builders)][0], args.length,
                                      split.depths[j % len(split.depths)], rng, builders[j % len(builders)][1])
                          for j in range(i, i + args.batch)]
                pols = {v: new_policy(kw, args.keep) for v, kw in variants.items()}
                dense = make_policy("dense")
                eng.set_kv_policy(dense, attach=False)
                forced = [t.forced for t in trials]  # late-question: teacher-forced, then greedy
                nf = len(forced[0])
                snap = eng.snapshot(eng.prefill([t.ids for t in trials], nf + trials[0].gen_len,
                                                ForcedTokens(forced) if nf else None,
                                                observers=tuple(pols.values())))
                answers = {}
                for name, pol in [("dense", dense), *pols.items()]:
                    eng.set_kv_policy(pol, attach=False)
                    st = eng.restore(snap)
                    if nf:
                        st.sampler = ForcedTokens([f[1:] for f in forced])
                    res = eng.decode(st, stop=None if nf else eos)  # forced tokens may hold the stop token
                    toks = [r[nf:] for r in res.tokens]
                    answers[name] = [tok.decode(r[:r.index(eos)] if eos in r else r, skip_special_tokens=True)
                                     for r in toks]
                for name, ans in answers.items():
                    score[name][0] += sum(hit(task, a, t.expected) for a, t in zip(ans, trials))
                    score[name][1] += sum(canonical(task, a) == canonical(task, d)
                                          for a, d in zip(ans, answers["dense"]))
            line = "  ".join(f"{n} {h}/{args.trials} (={s})" for n, (h, s) in score.items())
            print(f"{task:12s} {line}   [{time.time() - t0:.0f}s]", flush=True)


if __name__ == "__main__":
    main()
