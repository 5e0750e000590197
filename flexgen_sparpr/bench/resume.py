"""Resuming a long grid from its partial results file.

A grid script writes its JSON after every batch: {"plan": {...}, "batches": [{"id": ...}, ...],
"records": [...]}. Run again with the same plan, it reads that file and skips the batches it
holds; with another plan it refuses (mixing two plans' trials would be silent nonsense). A plan
is cut into batches with stable ids (plan_batches), and each batch names the engine commit it ran
under (resumed_batches, engines).
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


def plan_batches(items: dict, batch: int) -> list[tuple[str, object, list]]:
    """{key: [item, ...]} (key: a length, or a (task, length) tuple) -> [(id, key, chunk)]: the
    shorter lengths first, and within a length round-robin over the keys (a time limit leaves
    the short lengths complete and every task with some trials); ids "<key>:<index of the
    chunk's first item>", e.g. "2048:5" or "passkey:2048:5" (stable across runs: for resuming)."""
    def name(key) -> str:
        return ":".join(map(str, key)) if isinstance(key, tuple) else str(key)

    def length(key) -> int:
        return key[-1] if isinstance(key, tuple) else key
    out = []
    for k, xs in items.items():
        for j, i in enumerate(range(0, len(xs), batch)):
            out.append((length(k), j, name(k), (f"{name(k)}:{i}", k, xs[i:i + batch])))
    return [b for *_, b in sorted(out, key=lambda o: o[:3])]



def resumed_batches(old: dict | None) -> list[dict]:
    """A partial results file's batches, each naming the engine commit it ran under ("engine"):
    a file written before batches named theirs gets its config's commit, the only one it kept
    (the last run's: a resumed run rewrites the config)."""
    if not old:
        return []
    commit = old.get("config", {}).get("engine_commit", "unknown")
    return [dict(b, engine=b.get("engine", commit)) for b in old["batches"]]



def engines(batches: list[dict], current: str) -> str:
    """Which engine commits ran the batches, for a report: "a7e49b6" or "a7e49b6 (6 batches),
    5973f20 (6 batches)" in the order they first ran; `current` where no batch ran yet."""
    count: dict[str, int] = {}
    for b in batches:
        c = b.get("engine", current)
        count[c] = count.get(c, 0) + 1
    if len(count) <= 1:
        return next(iter(count), current)
    return ", ".join(f"{c} ({n} batch{'es' if n != 1 else ''})" for c, n in count.items())
