"""The decode step per weight format and compute dtype: float32 weights, FlexGen's --compress-weight,
the defaults and --dtype bfloat16, with the weights resident or streamed from disk
(flexgen_sparpr/bench/weights_step.py says what each cell measures and the ratios the targets name).

Writes <out>/weights.json (every cell, the configuration, engine commit and machine) and weights.md.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's engine, the one engine_commit() names

from flexgen_sparpr.bench.weights_step import parser, run_grid  # noqa: E402
from flexgen_sparpr.utils.guard import guarded  # noqa: E402

if __name__ == "__main__":
    sys.exit(guarded(lambda: run_grid(parser(__doc__).parse_args())))
