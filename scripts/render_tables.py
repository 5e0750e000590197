"""Rewrite the marked tables in README.md and docs/ from the results files they cite.

    python scripts/render_tables.py          # rewrite the regions that differ
    python scripts/render_tables.py --check  # exit 1 on a region that differs or a missing citation

Either way it exits 1 on a cited file that does not exist and on a table of numbers outside a
region that does not say it has no results file.

See flexgen_sparpr/bench/render.py for the marker syntax.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flexgen_sparpr.bench.render import render

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if anything would change")
    args = ap.parse_args()
    problems = render(ROOT, write=not args.check)
    for line in problems:
        print(line)
    missing = [p for p in problems if "does not exist" in p or "outside a rendered region" in p]
    return 1 if missing or (args.check and problems) else 0


if __name__ == "__main__":
    sys.exit(main())
