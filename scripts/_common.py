"""The scripts' one private helper, kept for scripts that still import it (bench_step.py): it puts
this checkout first on sys.path (its engine is the one engine_commit() names) and re-exports the
bench floor's helpers. New scripts import flexgen_sparpr.bench.{args,results,offload} directly."""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path[:1]:
    sys.path.insert(0, str(REPO))

from flexgen_sparpr.bench.args import (OneLineParser, add_opt_bench_args, check_context, die,  # noqa: E402,F401
                                       int_list)
from flexgen_sparpr.bench.offload import random_prompts, run_offload  # noqa: E402,F401
from flexgen_sparpr.bench.results import (cpu_model, engine_commit, load_average, machine_info,  # noqa: E402,F401
                                          md_table, timer, write_results)
from flexgen_sparpr.utils.files import write_atomic  # noqa: E402,F401
