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
    assert "| 256 | 1 | disk, q8 | dense |" in (tmp_path / "step.md").read_text()
    assert not any((tmp_path / "off").glob("*.kv*"))  # no offload files left



def test_kv_dtypes_are_the_engines():
    from flexgen_sparpr.bench.step import KV_DTYPES
    from flexgen_sparpr.engine.config import KV_DTYPES as ENGINE
    assert KV_DTYPES == ENGINE
