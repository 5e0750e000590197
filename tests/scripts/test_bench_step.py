"""scripts/bench_step.py: the decode step benchmark writes each cell's parts, ratios and the
configuration the engine resolved, and refuses bad flags in one line."""
from __future__ import annotations

import json

import pytest

from tests.scripts.runner import run_script


@pytest.mark.parametrize("args", [["--lengths", "10"], ["--steps", "0"], ["--keeps", "2"]])
def test_bad_flags_one_line(args):
    r = run_script("bench_step.py", *args)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr


def test_tiny_run_records_parts_and_resolved_config(smollm2_dir, tmp_path):
    r = run_script("bench_step.py", "--lengths", "256", "--batches", "1", "--placements", "resident", "--keeps", "0.25",
                   "--steps", "2", "--offload-dir", str(tmp_path / "off"), "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    (cell,) = json.loads((tmp_path / "step.json").read_text())["cells"]
    assert set(cell["policies"]) == {"dense", "sparpr@0.25"}
    assert all(row["step_s"] > 0 and set(row["parts_s"]) >= {"select", "read", "compute"}
               for row in cell["policies"].values())
    conf = cell["resolved"]
    assert conf["block_size"] == 16 and conf["kv_policy"]["name"] == "dense"
    assert conf["compared"]["sparpr@0.25"]["keep_ratio"] == 0.25
    assert "| 256 | 1 | resident | sparpr@0.25 |" in (tmp_path / "step.md").read_text()
    assert all(len(row["steps_s"]) == row["steps"] == 2 for row in cell["policies"].values())
    fallback = cell["policies"]["sparpr@0.25"]["step_fallback"]  # the step fallback's choice and timings
    assert fallback["steps"] == 2 and fallback["chosen"] is None  # two steps: still in its first trial


def test_a_row_whose_step_fallback_ran_dense_steps_says_how_many():
    from flexgen_sparpr.bench.step import _keep_said
    assert _keep_said({"effective_keep": 0.88, "step_fallback": {"steps": 24, "dense_steps": 20}}) == \
        "0.88, 20 of 24 steps dense"
    assert _keep_said({"effective_keep": 0.25, "step_fallback": {"steps": 24, "dense_steps": 0}}) == "0.25"
    assert _keep_said({}) == "1.00"


def test_kv_dtypes_make_a_disk_cell_each(smollm2_dir, tmp_path):
    """--kv-dtypes: one disk cell per KV storage dtype (q8 reads fewer bytes than the float16
    default), the resident cell once, each recording the dtype it stored."""
    r = run_script("bench_step.py", "--lengths", "256", "--batches", "1", "--placements", "resident", "disk",
                   "--kv-dtypes", "auto", "q8", "--keeps", "0.25", "--steps", "2", "--offload-dir",
                   str(tmp_path / "off"), "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    cells = json.loads((tmp_path / "step.json").read_text())["cells"]
    assert [(c["placement"], c["kv_dtype"]) for c in cells] == [("resident", "auto"), ("disk", "auto"), ("disk", "q8")]
    assert [c["resolved"]["kv_dtype"] for c in cells] == ["float16", "float16", "q8"]
    auto, q8 = (c["policies"]["dense"]["disk_bytes_per_step"] for c in cells[1:])
    assert 0 < q8 < 0.7 * auto
    assert all("dense_vs_floor" in c for c in cells[1:])
    assert all(len(c["disk_read_Bps_around"]) == 2 and min(c["disk_read_Bps_around"]) > 0 for c in cells[1:])
    assert "disk_read_Bps_around" not in cells[0]
    assert "| 256 | 1 | disk, q8 | dense |" in (tmp_path / "step.md").read_text()
    assert not any((tmp_path / "off").glob("*.kv*"))  # no offload files left



def test_kv_dtypes_are_the_engines():
    from flexgen_sparpr.bench.step import KV_DTYPES
    from flexgen_sparpr.engine.config import KV_DTYPES as ENGINE
    assert KV_DTYPES == ENGINE


def test_a_disk_cells_floor_uses_the_bandwidth_measured_around_it():
    """dense vs floor = dense disk step / max(resident dense step, bytes / the mean of the cell's
    own before / after bandwidths); a file without them (before per-cell bandwidth) uses the grid's."""
    from flexgen_sparpr.bench.step import add_ratios, render

    def cell(placement, step, nbytes=0.0, around=None):
        c = {"tokens": 2048, "batch": 1, "placement": placement, "kv_dtype": "auto",
             "policies": {"dense": {"step_s": step, "disk_bytes_per_step": nbytes, "parts_s": {}}}}
        return c if around is None else {**c, "disk_read_Bps_around": around}

    res, own, old = cell("resident", 0.01), cell("disk", 0.06, 50e6, [1e9, 3e9]), cell("disk", 0.06, 50e6)
    add_ratios([res, own, old], read_Bps=1e9)
    assert own["dense_vs_floor"] == pytest.approx(0.06 / (50e6 / 2e9))  # 2.4x, the cell's mean
    assert old["dense_vs_floor"] == pytest.approx(0.06 / (50e6 / 1e9))  # 1.2x, the grid's
    md = render({"config": {"engine_commit": "x", "disk_read_Bps": 1e9, "dd_read_Bps": 1.1e9, "per_cell_bandwidth": True,
                            "defaults": "d", "steps": 2},
                 "machine": {"cpu_model": "c", "cpu_count": 2, "torch": "t", "torch_threads": 2}, "cells": [res, own]})
    assert "| 2.40x (1.00 / 3.00 GB/s) |" in md and "(dd iflag=direct: 1.10 GB/s)" in md


def test_dd_reads_a_file_with_o_direct_and_leaves_nothing(tmp_path):
    from flexgen_sparpr.bench.step import dd_read_Bps
    bw = dd_read_Bps(tmp_path, nbytes=8 << 20)
    assert bw is None or bw > 1e6  # None: no dd, or this filesystem refuses O_DIRECT
    assert not list(tmp_path.iterdir())


def test_a_disk_cells_busy_floor_uses_the_resident_step_run_beside_a_busy_disk():
    """dense vs floor with the disk busy = dense disk step / max(dense's step in the resident-busy
    cell, bytes / bandwidth); none where that cell's reader did not run."""
    from flexgen_sparpr.bench.step import add_ratios, render

    def cell(placement, step, nbytes=0.0, **extra):
        return {"tokens": 2048, "batch": 1, "placement": placement, "kv_dtype": "auto", **extra,
                "policies": {"dense": {"step_s": step, "disk_bytes_per_step": nbytes, "parts_s": {}}}}

    res, busy, disk = cell("resident", 0.01), cell("resident-busy", 0.02, busy_read_Bps=1.5e9), cell("disk", 0.03, 10e6)
    add_ratios([res, busy, disk], read_Bps=1e9)
    assert disk["dense_vs_floor"] == pytest.approx(0.03 / 0.01)
    assert disk["dense_vs_busy_floor"] == pytest.approx(0.03 / 0.02)
    md = render({"config": {"engine_commit": "x", "disk_read_Bps": 1e9, "dd_read_Bps": None, "per_cell_bandwidth": True,
                            "defaults": "d", "steps": 2},
                 "machine": {"cpu_model": "c", "cpu_count": 2, "torch": "t", "torch_threads": 2}, "cells": [res, busy, disk]})
    assert "| 3.00x; disk busy 1.50x |" in md and "| resident, disk busy | dense |" in md and "reader 1.50 GB/s" in md
    idle = cell("resident-busy", 0.02, busy_read_Bps=None)
    disk = cell("disk", 0.03, 10e6)
    add_ratios([res, idle, disk], read_Bps=1e9)
    assert "dense_vs_busy_floor" not in disk and disk["dense_vs_floor"] == pytest.approx(3.0)


def test_busy_disk_reads_beside_the_block_and_leaves_nothing(tmp_path):
    import os
    import time

    from flexgen_sparpr.bench.busy_disk import BusyDisk
    with BusyDisk(tmp_path, nbytes=16 << 20) as busy:
        pid = busy.proc.pid
        time.sleep(0.5)
    assert busy.read_Bps is None or busy.read_Bps > 1e6  # None: this filesystem refuses O_DIRECT
    assert busy.proc.returncode is not None and not list(tmp_path.iterdir())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_resident_busy_cell_records_its_reader_and_the_disk_cell_its_busy_floor(smollm2_dir, tmp_path):
    r = run_script("bench_step.py", "--lengths", "256", "--batches", "1", "--placements", "resident", "resident-busy",
                   "disk", "--keeps", "0.25", "--steps", "2", "--offload-dir", str(tmp_path / "off"), "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    res, busy, disk = json.loads((tmp_path / "step.json").read_text())["cells"]
    assert busy["placement"] == "resident-busy" and "busy_read_Bps" in busy and "busy_read_Bps" not in res
    assert "disk_read_Bps_around" not in busy and "dense_vs_floor" not in busy
    if busy["busy_read_Bps"]:  # O_DIRECT here: the reader ran, so the disk cell has its busy floor
        assert busy["busy_read_Bps"] > 1e6 and disk["dense_vs_busy_floor"] > 0
    assert not list((tmp_path / "off").iterdir())  # no offload or scratch files left
