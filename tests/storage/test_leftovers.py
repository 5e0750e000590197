"""Run folders of dead runs (storage/leftovers.py): removed by the next run; a live run's folder,
another host's or another pid namespace's is never touched; a reused pid is seen through."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from flexgen_sparpr.storage.disk_store import DiskStore
from flexgen_sparpr.storage.leftovers import OWNER_FILE, dead_owner, owner_record, sweep_dead_runs


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _folder(root, name: str, owner: dict | None, payload: int = 4096):
    d = root / name
    d.mkdir(parents=True)
    (d / "kv-g1-l0-b0").write_bytes(b"x" * payload)
    if owner is not None:
        (d / OWNER_FILE).write_text(json.dumps(owner))
    return d


def test_a_store_records_its_owner(tmp_path):
    with DiskStore(tmp_path) as store:
        info = json.loads((store.dir / OWNER_FILE).read_text())
        assert info == owner_record() and info["pid"] == os.getpid()
        assert dead_owner(store.dir) is None  # this process is alive
        assert sweep_dead_runs(tmp_path) == [] and store.dir.is_dir()


def test_only_dead_runs_are_removed(tmp_path):
    me, dead = owner_record(), _dead_pid()
    gone = _folder(tmp_path, f"run-{dead}-aaa", me | {"pid": dead, "start": "1"})
    legacy = _folder(tmp_path, f"run-{dead}-bbb", None)  # no owner record: the name's pid
    live = _folder(tmp_path, f"run-{os.getpid()}-ccc", me)
    reused = _folder(tmp_path, f"run-{os.getpid()}-ddd", me | {"start": "-1"})  # our pid, another start
    elsewhere = _folder(tmp_path, f"run-{dead}-eee", me | {"pid": dead, "host": "another-host"})
    container = _folder(tmp_path, f"run-{dead}-fff", me | {"pid": dead, "pidns": "pid:[1]"})
    other = _folder(tmp_path, "not-a-run", None)
    removed = sweep_dead_runs(tmp_path)
    assert sorted((p.name, pid) for p, pid, _ in removed) == sorted(
        [(gone.name, dead), (legacy.name, dead), (reused.name, os.getpid())])
    assert all(size >= 4096 for *_, size in removed)
    assert not gone.exists() and not legacy.exists() and not reused.exists()
    assert live.is_dir() and elsewhere.is_dir() and container.is_dir() and other.is_dir()


def test_a_missing_root_is_nothing_to_do(tmp_path):
    assert sweep_dead_runs(tmp_path / "none") == []
