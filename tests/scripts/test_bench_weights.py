"""scripts/bench_weights.py: the decode step per weight format and compute dtype writes each run's
step, the ratios the weight-bytes targets name and the configuration the engine resolved, and
refuses bad flags in one line."""
from __future__ import annotations

import json

import pytest

from tests.scripts.resolved_check import check_resolved
from tests.scripts.runner import run_script


@pytest.mark.parametrize("args", [["--runs", "float64"], ["--placements", "gpu"], ["--steps", "x"], ["--rounds", "0"]])
def test_bad_flags_one_line(args):
    r = run_script("bench_weights.py", *args)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr


def test_tiny_run_records_each_runs_format_and_ratios(smollm2_dir, tmp_path):
    r = run_script("bench_weights.py", "--lengths", "256", "--batches", "1", "--placements", "resident",
                   "--runs", "float32, raw", "float32, --compress-weight", "bfloat16, raw", "--steps", "2", "--rounds", "2",
                   "--offload-dir", str(tmp_path / "off"), "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    cells = {c["run"]: c for c in json.loads((tmp_path / "weights.json").read_text())["cells"]}
    raw, comp, bf = cells["float32, raw"], cells["float32, --compress-weight"], cells["bfloat16, raw"]
    check_resolved(raw["resolved"], compute_dtype="float32", policy="dense")
    assert raw["resolved"]["weight_format"].startswith("raw") and comp["resolved"]["weight_format"].startswith("int4")
    assert bf["resolved"]["compute_dtype"] == "bfloat16"
    assert all(c["step_s"] > 0 and c["disk_bytes_per_step"] == 0 for c in cells.values())
    # two rounds each, runs in turn: the cell is the faster round (the lower median of two)
    assert all(len(c["round_steps_s"]) == 2 and c["step_s"] == min(c["round_steps_s"]) for c in cells.values())
    assert raw["vs_raw"] == 1.0 and comp["vs_raw"] == pytest.approx(raw["step_s"] / comp["step_s"])
    assert bf["vs_float32"] == pytest.approx(raw["step_s"] / bf["step_s"])
    assert comp["vs_default"] is None  # the defaults' run was not asked for
    assert "| 256 | 1 | resident | float32, --compress-weight | int4" in (tmp_path / "weights.md").read_text()
