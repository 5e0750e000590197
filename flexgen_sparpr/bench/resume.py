"""Resuming a long grid from its partial results file.

A grid script writes its JSON after every batch: {"plan": {...}, "batches": [{"id": ...}, ...],
"records": [...]}. Run again with the same plan, it reads that file and skips the batches it
holds; with another plan it refuses (mixing two plans' trials would be silent nonsense).
"""
from __future__ import annotations

import json
from pathlib import Path


class PlanMismatch(ValueError):
    pass


def load_partial(path: Path, plan: dict) -> dict | None:
    """The results at `path` if they were made with `plan` (compared as JSON), else None when
    there is no file. Raises PlanMismatch naming the first differing key, or ValueError for a
    file that is not a results file."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read partial results {path}: {e}") from e
    if not isinstance(data, dict) or not isinstance(data.get("batches"), list) or "plan" not in data:
        raise ValueError(f"{path} is not a resumable results file (no plan / batches)")
    old = json.loads(json.dumps(data["plan"]))
    new = json.loads(json.dumps(plan, default=str))
    if old != new:
        diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        raise PlanMismatch(f"{path} holds results of another plan (differs in: {', '.join(diff)}); "
                           "use another --out or --fresh")
    return data


def done_ids(data: dict | None) -> set:
    """Ids of the batches a partial results file already holds."""
    return {b["id"] for b in data["batches"]} if data else set()
