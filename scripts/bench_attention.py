"""Decode attention's kernels: torch's fused CPU kernel against the compiled CPU kernel (what is
timed: flexgen_sparpr/bench/attention_kernel.py) -> <out>/attention.{json,md}."""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's engine, the one engine_commit() names
from flexgen_sparpr.bench.attention_kernel import main  # noqa: E402  (its flags: --help)

if __name__ == "__main__":
    from flexgen_sparpr.utils.guard import guarded
    sys.exit(guarded(main))
