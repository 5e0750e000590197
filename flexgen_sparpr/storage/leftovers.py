"""Offload folders of runs that died without cleaning up (SIGKILL, power loss).

Each run's folder (`run-<pid>-<random>`, storage/disk_store.py) records its owner: pid, the process's
start time (so a reused pid is not mistaken for the owner), host and pid namespace. A new run
removes the folders whose owner is gone; a folder of a live run, of another host or of another
pid namespace (a container sharing the folder) is never touched.
"""
from __future__ import annotations

import json
import os
import platform
import re
import shutil
from pathlib import Path

OWNER_FILE = "owner.json"
_NAME = re.compile(r"^run-(\d+)-")


def _start_time(pid: int) -> str | None:
    """When process pid started (clock ticks since boot, from /proc), or None if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def owner_record() -> dict:
    pid = os.getpid()
    return {"pid": pid, "start": _start_time(pid), "host": platform.node(), "pidns": _pid_namespace()}


def write_owner(run_dir: Path) -> None:
    (Path(run_dir) / OWNER_FILE).write_text(json.dumps(owner_record()) + "\n")


def _alive(pid: int) -> bool:
    """pid is a running process: a zombie (dead, its parent not yet told) is not; a killed rank of
    a distributed run stays one until its launcher reaps it, while the others clean up."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def dead_owner(run_dir: Path) -> int | None:
    """The pid of a run folder whose owner is gone, else None (alive, or not provably dead)."""
    try:
        info = json.loads((Path(run_dir) / OWNER_FILE).read_text())
        pid = int(info["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        m = _NAME.match(Path(run_dir).name)  # no owner record (yet, or an older version): the name's pid
        if not m:
            return None
        info, pid = {}, int(m.group(1))
    me = owner_record()
    for key in ("host", "pidns"):  # another machine or container: its pids mean nothing here
        if info.get(key) is not None and me[key] is not None and info[key] != me[key]:
            return None
    if not _alive(pid):
        return pid
    start = info.get("start")
    return pid if start is not None and _start_time(pid) not in (None, start) else None  # pid reused


def _size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total


def sweep_dead_runs(root) -> list[tuple[Path, int, int]]:
    """Remove the run folders under root whose owner is gone: [(folder, pid, bytes freed)]."""
    root = Path(root).expanduser()
    if not root.is_dir():
        return []
    removed = []
    for d in sorted(root.glob("run-*")):
        if not d.is_dir() or d.is_symlink():
            continue
        pid = dead_owner(d)
        if pid is None:
            continue
        size = _size(d)
        shutil.rmtree(d, ignore_errors=True)
        if not d.exists():
            removed.append((d, pid, size))
    return removed
