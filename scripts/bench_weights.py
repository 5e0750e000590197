"""The decode step per weight format and compute dtype: float32 weights, FlexGen's --compress-weight,
the defaults and --dtype bfloat16, with the weights resident or streamed from disk
(flexgen_sparpr/bench/weights_step.py says what each cell measures and the ratios the targets name).

Writes <out>/weights.json (every cell, the configuration, engine commit and machine) and weights.md.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's engine, the one engine_commit() names

from flexgen_sparpr.bench.args import OneLineParser  # noqa: E402
from flexgen_sparpr.bench.results import publish  # noqa: E402
from flexgen_sparpr.bench.weights_step import PLACEMENTS, RUNS, add_ratios, render, run_cell  # noqa: E402
from flexgen_sparpr.utils.guard import guarded  # noqa: E402


def main() -> int:
    ap = OneLineParser(description=__doc__)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--placements", nargs="+", choices=list(PLACEMENTS), default=list(PLACEMENTS))
    ap.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    ap.add_argument("--steps", type=int, default=12, help="decode steps each run times (median taken)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--offload-dir", default=str(Path(tempfile.gettempdir()) / "flexgen-sparpr-bench-weights"))
    ap.add_argument("--out", default=str(REPO / "results" / "weights"))
    args = ap.parse_args()
    cells = []
    for tokens in args.lengths:
        for batch in args.batches:
            for placement in args.placements:
                for label in args.runs:
                    cells.append(run_cell(tokens, batch, placement, label, args.steps, args.offload_dir, args.seed))
                    print(f"{tokens} x{batch} {placement} {label}: {cells[-1]['step_s']:.4f} s", flush=True)
    add_ratios(cells)
    publish(args.out, "weights", {**vars(args), "model": "smollm2-135m"}, cells, render)
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))
