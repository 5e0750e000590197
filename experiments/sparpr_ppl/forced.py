"""What the perplexity explorations share: windows of public-domain texts, and teacher-forced
perplexity of several KV policies decoded from one dense prefill (printed against dense's)."""
import math
import time

from flexgen_sparpr.bench.forced import ForcedTokens
from flexgen_sparpr.bench.needle_prompt import normalise_filler
from flexgen_sparpr.bench.perplexity import windows
from flexgen_sparpr.bench.texts import TEXTS
from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.kv.policies import make_policy


def text_windows(tok, texts: list[str], prompt: int, score: int, count: int, seed: int) -> list:
    """`count` windows of each text (bench/perplexity.py `windows`), in text order."""
    out = []
    for text in texts:
        ids = tok(normalise_filler(TEXTS[text].path.read_text(encoding="utf-8", errors="replace")),
                  add_special_tokens=False)["input_ids"]
        out += windows(text, ids, prompt, score, count, seed=seed)
    return out


def ppl_from_one_prefill(src, ws, variants: dict, score: int, block_size: int = 16) -> None:
    """Prefill the windows densely once; decode `score` tokens teacher-forced with dense and each
    variant policy from it; print each one's perplexity and its ratio to dense's (per window too)."""
    with Engine(src, Policy(gpu_batch_size=len(ws)), EngineConfig(device="cpu", block_size=block_size)) as eng:
        dense = make_policy("dense")
        eng.set_kv_policy(dense, attach=False)
        st = eng.prefill([w.prompt for w in ws], score + 1, ForcedTokens([w.forced for w in ws]),
                         observers=tuple(variants.values()))
        snap = eng.snapshot(st)
        base = None
        for name, pol in [("dense", dense), *variants.items()]:
            t0 = time.time()
            eng.set_kv_policy(pol, attach=False)
            s = eng.restore(snap)
            s.sampler = ForcedTokens([w.forced[1:] for w in ws])
            eng.decode(s)
            nll = s.sampler.nll.mean(dim=1)  # nll: [windows]
            base = nll if base is None else base
            d = nll - base
            print(f"{name:28s} ppl {math.exp(float(s.sampler.nll.mean())):8.2f}  ratio {math.exp(float(d.mean())):.4f}"
                  f"  per window {[round(math.exp(float(x)), 3) for x in d]}  ({time.time() - t0:.0f}s)", flush=True)
