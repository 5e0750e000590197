"""The decode step, dense vs SparPR, at the engine's defaults: where its time goes, KV resident or
on disk (O_DIRECT), at 2k / 4k / 8000 tokens, batch 1 and 4 (flexgen_sparpr/bench/step.py says
what each cell measures and the ratios the targets name).

Writes <out>/step.json (every cell, the configuration, engine commit and machine) and step.md.
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
from flexgen_sparpr.bench.step import KV_DTYPES, PLACEMENTS, add_ratios, defaults_said, disk_read_Bps, render, run_cell  # noqa: E402
from flexgen_sparpr.utils.guard import guarded  # noqa: E402


def main() -> int:
    ap = OneLineParser(description=__doc__)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8000],
                    help="prompt tokens (8000: room for the decode steps in an 8192-position model)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--placements", nargs="+", choices=list(PLACEMENTS), default=list(PLACEMENTS))
    ap.add_argument("--keeps", type=float, nargs="+", default=[0.25, 0.1], help="SparPR keep ratios")
    ap.add_argument("--kv-dtypes", nargs="+", choices=KV_DTYPES, default=["auto"],
                    help="--kv-dtype of the disk cells, each its own cell (q8 / q4: quantized blocks; the resident "
                         "cells keep the compute dtype and run once)")
    ap.add_argument("--steps", type=int, default=8, help="decode steps each policy runs (median taken)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--offload-dir", default=str(Path(tempfile.gettempdir()) / "flexgen-sparpr-bench-step"))
    ap.add_argument("--out", default=str(REPO / "results" / "step"))
    args = ap.parse_args()
    read_Bps, mode = disk_read_Bps(Path(args.offload_dir))
    print(f"disk: {read_Bps / 1e9:.2f} GB/s O_DIRECT read ({mode})", flush=True)
    cells = []
    for tokens in args.lengths:
        for batch in args.batches:
            for placement in args.placements:
                for kv in (args.kv_dtypes if placement == "disk" else ["auto"]):
                    cell = run_cell(tokens, batch, placement, args.keeps, args.steps, args.offload_dir, args.seed, kv)
                    cells.append(cell)
                    print(f"{tokens} x{batch} {placement} {kv}: " + ", ".join(
                        f"{k} {v['step_s']:.3f}s" for k, v in cell["policies"].items()), flush=True)
    add_ratios(cells, read_Bps)
    publish(args.out, "step", {**vars(args), "model": "smollm2-135m", "defaults": defaults_said(cells),
                               "disk_read_Bps": read_Bps}, cells, render)
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))
