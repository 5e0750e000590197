"""DKV's residual pick on the late-question task (issue 16): the question comes 256 tokens after
the prefill, so a pick made from the prompt's last queries cannot see it. Tune on the TUNING split
(alice29, depths 0.25 / 0.75, seed 0); check a chosen variant once on held-out with scripts/needle.py.

Usage (repo root):
  .venv/bin/python experiments/dkv_pick/late.py [--split tuning] [--length 2048] [--trials 10] \
      --variants "residual_pick=attention;residual_pick=error;residual_pick=mixed"
A variant is a comma list of DKV knobs (name=value, ints where they parse). Prints dense's hits and
each variant's hits and agreement with dense, with the answers that differ.
"""
from __future__ import annotations

import argparse
import os
import random
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from flexgen_sparpr.bench.forced import ForcedTokens  # noqa: E402
from flexgen_sparpr.bench.needle_prompt import NeedlePrompts  # noqa: E402
from flexgen_sparpr.bench.sweep import Config, PolicySweep  # noqa: E402
from flexgen_sparpr.bench.tasks import build_trial, canonical, hit  # noqa: E402
from flexgen_sparpr.bench.texts import SPLITS, TEXTS  # noqa: E402
from flexgen_sparpr.engine.sampling import Sampler  # noqa: E402
from flexgen_sparpr.weights.resolve import resolve_source  # noqa: E402


def parse_variant(text: str) -> dict:
    out = {}
    for item in filter(None, text.split(",")):
        k, _, v = item.partition("=")
        out[k] = int(v) if v.lstrip("-").isdigit() else v
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--split", default="tuning", choices=sorted(SPLITS))
    ap.add_argument("--task", default="late-question")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--batch", type=int, default=5)
    ap.add_argument("--variants", default="residual_pick=attention;residual_pick=error;residual_pick=mixed")
    args = ap.parse_args()
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    split = SPLITS[args.split]
    src = resolve_source("smollm2-135m", "")
    tok = AutoTokenizer.from_pretrained(src.tokenizer_dir)
    builders = [(NeedlePrompts(tok, TEXTS[t].path, "The secret passkey is"), t) for t in split.texts]
    rng = random.Random(split.seed + 11)  # not needle.py's stream
    trials = [build_trial(args.task, builders[j % len(builders)][0], args.length, split.depths[j % len(split.depths)],
                          rng, builders[j % len(builders)][1]) for j in range(args.trials)]
    eos, t0 = src.spec.eos_id, time.time()
    variants = [v for v in args.variants.split(";") if v]
    answers: dict[str, list[str]] = {}
    for name, dkv_args, cfg in [("dense", {}, Config("dense"))] + [(v, parse_variant(v), Config("dkv")) for v in variants]:
        sweep = PolicySweep(src, dkv_args=dkv_args)
        got: list[str] = []
        try:
            for i in range(0, args.trials, args.batch):
                batch = trials[i:i + args.batch]
                forced = [t.forced for t in batch]
                nf = len(forced[0])

                def sampler_for(c, forced=forced, nf=nf):
                    return ForcedTokens([f[0 if c is None else 1:] for f in forced]) if nf else Sampler()

                def done(c, res, sampler, secs, nf=nf):
                    for toks in res.tokens:
                        toks = toks[nf:]
                        toks = toks[:toks.index(eos)] if eos in toks else toks
                        got.append(tok.decode(toks, skip_special_tokens=True))
                sweep.run([t.ids for t in batch], nf + batch[0].gen_len, [cfg], sampler_for,
                          stop=None if nf else eos, on_done=done)
        finally:
            sweep.close()
        answers[name] = got
        hits = sum(hit(args.task, a, t.expected) for a, t in zip(got, trials))
        same = sum(canonical(args.task, a) == canonical(args.task, d) for a, d in zip(got, answers["dense"]))
        diff = [f"{t.expected[0]}->{a.strip()[:24]!r}" for a, d, t in zip(got, answers["dense"], trials)
                if canonical(args.task, a) != canonical(args.task, d)]
        print(f"{name:40s} hits {hits}/{args.trials} same-as-dense {same}  {' '.join(diff)}  [{time.time() - t0:.0f}s]",
              flush=True)


if __name__ == "__main__":
    main()
