"""Regenerate every results file behind a number in README.md or docs/, then the tables rendered
from them (README "Regenerating the figures"; the plan is flexgen_sparpr/bench/plan_entries.py).

    python scripts/results.py --quick            # minutes: every script once at tiny sizes, into
                                                 # results/quick/ (git-ignored); the docs are only checked
    python scripts/results.py --full             # hours: the published files; rerun to resume
    python scripts/results.py --full --only step llamacpp --force
    python scripts/results.py --list

Exit status 1 if any entry failed (the rest still run); Ctrl-C stops after one line.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's package, the one the entries run

from flexgen_sparpr.bench.plan import select  # noqa: E402
from flexgen_sparpr.bench.plan_entries import PLAN  # noqa: E402
from flexgen_sparpr.bench.regen import run_plan  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--quick", action="store_true", help="tiny sizes into results/quick/, minutes")
    mode.add_argument("--full", action="store_true", help="the published results, hours; resumable")
    mode.add_argument("--list", action="store_true", help="print the plan and exit")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="these entries (also those that need more)")
    ap.add_argument("--force", action="store_true", help="rerun complete entries (grids from scratch)")
    args = ap.parse_args(argv)
    if args.list:
        for e in PLAN:
            note = f"  [needs: {e.needs}]" if e.needs else ("" if e.quick else "  [no quick variant]")
            note += f"  [partial: {e.partial}]" if e.partial else ""
            print(f"{e.name}: {e.script} {' '.join(e.args)}{note}")
        return 0
    try:
        entries = select(PLAN, args.only, args.quick)
    except ValueError as e:
        ap.error(str(e))
    try:
        return run_plan(ROOT, entries, quick=args.quick, force=args.force)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
