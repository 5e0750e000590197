"""Running the results plan (bench/plan.py): each entry as a subprocess of the same Python, one
after another, one line each (ran / skipped / failed / not run, with the seconds taken); a failure
is reported and the rest go on; an entry whose optional bench extra is not installed is skipped, saying so. The full run skips an entry whose outputs are complete (a grid that
stopped part way resumes: its script skips the batches it holds); --force reruns it from scratch."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

from .plan import Entry, is_complete


def run_entry(root: Path, entry: Entry, quick: bool, force: bool, log_dir: Path) -> tuple[str, float]:
    """Run one entry; returns (status, seconds). Its output goes to log_dir/<name>.log."""
    if quick and entry.quick is None:
        return "not run (no quick variant)", 0.0
    if not quick and not force and is_complete(root, entry):
        return "skipped (complete)", 0.0
    if entry.extra and importlib.util.find_spec(entry.extra) is None:
        return f"skipped ({entry.extra} is not installed: an optional bench extra, `{entry.script} --help` says how)", 0.0
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{entry.name}.log"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, *entry.command(quick, force)], cwd=root, stdout=f,
                            stderr=subprocess.STDOUT).returncode
    secs = time.perf_counter() - t0
    if rc:
        return f"FAILED (exit {rc}; see {log.relative_to(root)})", secs
    return "ran", secs


def run_plan(root: Path, entries: list[Entry], quick: bool, force: bool, say=print) -> int:
    """Run the entries and then the renderer (a quick run only checks the docs: it renders nothing);
    returns 1 if any entry or the render failed, else 0."""
    log_dir = root / ".cache" / "results-logs" / ("quick" if quick else "full")  # git-ignored
    failed = 0
    width = max((len(e.name) for e in entries), default=0)
    for entry in entries:
        current = entry.name
        try:
            status, secs = run_entry(root, entry, quick, force, log_dir)
        except KeyboardInterrupt:
            say(f"stopped (Ctrl-C) during {current}; run the same command again to go on from there")
            raise
        failed += status.startswith("FAILED")
        say(f"{entry.name:<{width}}  {status}  {secs:.0f}s", flush=True)
    render = [sys.executable, "scripts/render_tables.py", *(["--check"] if quick else [])]
    r = subprocess.run(render, cwd=root, capture_output=True, text=True)
    say(f"{'render --check' if quick else 'render'}: {'ok' if r.returncode == 0 else 'FAILED'}", flush=True)
    for line in (r.stdout + r.stderr).splitlines():
        say(f"  {line}")
    return 1 if failed or r.returncode else 0
