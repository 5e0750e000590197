"""The decode step, dense vs SparPR, at the engine's defaults: where its time goes, KV resident, all
on disk or half on disk (O_DIRECT), or resident while another process keeps the disk busy, at 2k / 4k /
8000 tokens, batch 1 and 4 (flexgen_sparpr/bench/step.py says what each cell measures and the ratios
the targets name).

Writes <out>/step.json (every cell, the configuration, engine commit and machine) and step.md.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's engine, the one engine_commit() names

from flexgen_sparpr.bench.step import parser, run_grid  # noqa: E402
from flexgen_sparpr.utils.guard import guarded  # noqa: E402

if __name__ == "__main__":
    sys.exit(guarded(lambda: run_grid(parser(__doc__).parse_args())))
