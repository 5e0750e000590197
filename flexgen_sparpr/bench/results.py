"""Writing a benchmark's results: the machine and engine commit for its config, a wall-clock
timer, markdown tables, and the files themselves.

Results are written atomically (a temp file in the same directory, then os.replace), so a
crashed or interrupted run never leaves a half-written file under results/.
"""
from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from ..utils.files import write_atomic

REPO = Path(__file__).resolve().parents[2]  # the checkout this package runs from


@contextmanager
def timer():
    """`with timer() as t: ...` then t() is the elapsed wall seconds (frozen at exit)."""
    t0 = time.perf_counter()
    end = []
    yield lambda: (end[0] if end else time.perf_counter()) - t0
    end.append(time.perf_counter())


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def engine_commit() -> str:
    """The engine's git commit (+ "-dirty" with local changes), for the config."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "flexgen_sparpr"], cwd=REPO, capture_output=True,
                               text=True).stdout.strip()
        return rev.stdout.strip() + ("-dirty" if dirty else "")
    except OSError:
        return "unknown"


def machine_info() -> dict:
    import torch
    info = {
        "hostname": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average": load_average(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def command_line() -> str:
    """This process's command line, its script relative to the checkout: how to make the file again."""
    script = Path(sys.argv[0]).resolve()
    if script.is_relative_to(REPO):
        script = script.relative_to(REPO)
    return shlex.join(["python", str(script), *sys.argv[1:]])


def write_results(out_dir: Path, stem: str, payload: dict, markdown: str | None = None) -> list[Path]:
    """Write out_dir/stem.json (payload, which should carry its config, and gets the command that made
    it unless it names one) and, if given, out_dir/stem.md. Returns the paths written."""
    out_dir = Path(out_dir)
    if isinstance(payload, dict) and "command" not in payload:
        payload = {**payload, "command": command_line()}
    paths = [out_dir / f"{stem}.json"]
    write_atomic(paths[0], json.dumps(payload, indent=2, default=str) + "\n")
    if markdown is not None:
        paths.append(out_dir / f"{stem}.md")
        write_atomic(paths[1], markdown)
    return paths


def publish(out_dir: Path, stem: str, config: dict, cells: list, render) -> dict:
    """A benchmark's results: {config (with the engine commit), machine, cells} written as
    out_dir/stem.json and render(payload) as stem.md, said on stdout. Returns the payload."""
    payload = {"config": {**config, "engine_commit": engine_commit()}, "machine": machine_info(), "cells": cells}
    write_results(Path(out_dir), stem, payload, render(payload))
    print(f"wrote {out_dir}/{stem}.json and {stem}.md")
    return payload


def md_table(headers: list[str], rows: list[list]) -> str:
    """A GitHub-markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"
