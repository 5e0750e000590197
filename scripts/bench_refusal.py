"""How long an explicit placement that cannot fit this machine takes to be refused.

Each run is a fresh process: `python -m flexgen_sparpr run --model <model> --path _DUMMY_
--percent 100 0 100 0 100 0` (all weights and the cache on the compute tier), which must end with
exit 2 and one `error: ... does not fit` line before any weight loads (runtime/capacity.py). The
bare start-up of the same interpreter importing torch is timed beside it, so the check's own cost
shows. Writes <out>/refusal_time.{json,md} with the config, the engine commit and the load.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's engine, the one engine_commit() names
from flexgen_sparpr.bench.args import die, OneLineParser  # noqa: E402
from flexgen_sparpr.bench.results import engine_commit, machine_info, md_table, write_results  # noqa: E402


def timed(cmd: list[str], env: dict) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    return time.perf_counter() - t0, r


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="processes timed (default: 5)")
    ap.add_argument("--model", default="opt-30b", help="a model too large for this machine (default: opt-30b)")
    ap.add_argument("--offload-dir", default="/tmp/flexgen-refusal", help="offload folder named to the run "
                    "(nothing is written there)")
    ap.add_argument("--out", default=str(REPO / "results" / "refusal"), help="output folder")
    args = ap.parse_args(argv)
    if args.runs < 1:
        die(f"--runs must be >= 1 (got {args.runs})")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("FLEXGEN_SPARPR_NO_MEMORY_CHECK", None)
    cmd = [sys.executable, "-m", "flexgen_sparpr", "run", "--model", args.model, "--path", "_DUMMY_",
           "--percent", "100", "0", "100", "0", "100", "0", "--offload-dir", args.offload_dir, "--no-log"]
    bare = [sys.executable, "-c", "import torch"]
    refuse_s, bare_s, line = [], [], ""
    for _ in range(args.runs):  # interleaved, so a change in load hits both alike
        dt, r = timed(cmd, env)
        line = r.stderr.strip()
        if r.returncode != 2 or "does not fit" not in line or "\n" in line:
            die(f"{args.model} was not refused as expected (exit {r.returncode}): {line[-300:]}")
        refuse_s.append(dt)
        bare_s.append(timed(bare, env)[0])
    # refused before any weight loads: no LLM exists, so no "resolved"; the placement is the command's flags
    config = {"model": args.model, "runs": args.runs, "command": " ".join(cmd[1:]), "engine_commit": engine_commit()}
    stats = {k: {"median_s": statistics.median(v), "max_s": max(v), "all_s": v}
             for k, v in (("refusal", refuse_s), ("python_import_torch", bare_s))}
    payload = {"config": config, "machine": machine_info(), "results": stats, "error_line": line}
    md = (f"# Time to refuse an over-capacity placement\n\n`{config['command']}` ({args.runs} fresh processes, "
          f"engine {config['engine_commit']}, load average {payload['machine']['load_average']}).\n\n"
          + md_table(["what", "median s", "max s"],
                     [[k, f"{v['median_s']:.2f}", f"{v['max_s']:.2f}"] for k, v in stats.items()])
          + f"\nThe error line:\n\n```\n{line}\n```\n")
    for p in write_results(Path(args.out), "refusal_time", payload, md):
        print(p)
    print(f"refused in {stats['refusal']['median_s']:.2f} s (median; python importing torch alone "
          f"{stats['python_import_torch']['median_s']:.2f} s)")
    return 0


if __name__ == "__main__":
    from flexgen_sparpr.utils.guard import guarded
    sys.exit(guarded(main))
