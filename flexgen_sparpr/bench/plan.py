"""The results plan: which script, with which arguments, writes each results file behind a number
in README.md or docs/ (scripts/results.py runs it; `make results`, `make results-quick`).

An Entry is one script run. `args` is the full run, at the defaults except where the figure is about
a flag (then the flag is in `args` and the entry's name says it); `outputs` are the files it writes.
`quick` are the arguments of a run at tiny sizes that only checks the script still works: `{out}`
stands for the entry's own folder under results/quick/ (git-ignored), so a quick run never touches
the published files and the renderer reads none of it. `needs` says why an entry cannot run
unattended on an ordinary machine (root and the kernel's read throttle, a GPU, many hours): such
an entry runs only when named with --only. The entries themselves are in plan_entries.py.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

QUICK_ROOT = "results/quick"


@dataclass(frozen=True)
class Entry:
    name: str
    script: str  # relative to the repository
    args: tuple[str, ...]
    outputs: tuple[str, ...]  # the files the full run writes, relative to the repository
    quick: tuple[str, ...] | None = None  # None: no quick run makes sense
    needs: str = ""  # why it runs only when named (empty: it runs with the plan)
    resumable: bool = False  # the script resumes from its partial results (bench/resume.py)
    partial: str = ""  # why the published file holds only part of its recorded grid (kept; --force reruns)
    extra: str = ""  # the module of an optional bench extra the script needs; without it the entry is skipped, said

    def __post_init__(self):
        if not self.outputs or any(not o.startswith("results/") for o in self.outputs):
            raise ValueError(f"{self.name}: outputs must lie under results/")
        if self.quick is not None and "{out}" not in " ".join(self.quick):
            raise ValueError(f"{self.name}: a quick run must write to its own folder ({{out}})")

    def quick_dir(self) -> str:
        return f"{QUICK_ROOT}/{self.name}"

    def command(self, quick: bool, force: bool = False) -> list[str]:
        """The script and its arguments (relative paths, run from the repository root)."""
        if quick:
            args = [a.replace("{out}", self.quick_dir()) for a in self.quick or ()]
        else:
            args = list(self.args)
        return [self.script, *args, *(["--fresh"] if force and self.resumable else [])]


def expected_batches(plan: dict) -> int | None:
    """How many batches a resumable grid's plan (scripts/needle.py, scripts/ppl.py) holds when done;
    None for a plan of another shape."""
    batch = plan.get("batch")
    if not batch:
        return None
    if "tasks" in plan and "trials" in plan:  # needle.py: per (task, length), trials cut in batches
        return len(plan["tasks"]) * len(plan["lengths"]) * math.ceil(plan["trials"] / batch)
    if "windows" in plan:  # ppl.py: per length, windows of every text (or of the one stream)
        per_length = plan["windows"] * (1 if plan.get("stream") else len(plan["texts"]))
        return len(plan["lengths"]) * math.ceil(per_length / batch)
    return None


def is_complete(root: Path, entry: Entry) -> bool:
    """Every output exists, and a resumable grid's JSON holds all its batches, none skipped (but for
    a published part of a grid, `partial`: the grid it asked for cannot be resumed as recorded)."""
    for out in entry.outputs:
        path = root / out
        if not path.is_file():
            return False
        if path.suffix == ".json" and entry.resumable and not entry.partial:
            try:
                data = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                return False
            if isinstance(data, dict) and "plan" in data and "batches" in data:
                want = expected_batches(data["plan"])
                if data.get("skipped") or (want is not None and len(data["batches"]) < want):
                    return False
    return True


def produces(entries: list[Entry], cited: str) -> bool:
    """Whether some entry's full run writes the cited path: a file, or a folder or stem of files
    (`results/fidelity`, `results/decode_vs_hf`, `results/latency_modeled_`)."""
    return any(o.startswith(cited) for e in entries for o in e.outputs)


def excepted(exceptions: dict[str, str], cited: str) -> bool:
    """Whether the cited path is, or lies under, a documented exception."""
    return any(cited.startswith(e) for e in exceptions)


def select(entries: list[Entry], only: list[str] | None, quick: bool) -> list[Entry]:
    """The entries a run takes: those named (any, in plan order; unknown names raise), else every
    entry without `needs` (and, for a quick run, with a quick variant)."""
    if only:
        names = {e.name for e in entries}
        unknown = [n for n in only if n not in names]
        if unknown:
            raise ValueError(f"no such plan entry: {', '.join(unknown)} (see --list)")
        return [e for e in entries if e.name in only]
    return [e for e in entries if not e.needs and (e.quick is not None or not quick)]
