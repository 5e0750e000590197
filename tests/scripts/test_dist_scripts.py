"""scripts/model_dist.py writes its modeled table with its config and the engine commit;
scripts/bench_dist.py refuses bad settings in one line (its runs are the lead's, not CI's)."""
from __future__ import annotations

import json

from tests.scripts.runner import run_script


def test_model_dist_writes_a_labeled_table(tmp_path):
    r = run_script("model_dist.py", "--models", "opt-1.3b", "--nodes", "1,2", "--hardware",
                   "configs/hardware/t4-flexgen.yaml", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    payload = json.loads((tmp_path / "modeled.json").read_text())
    assert payload["config"]["engine_commit"] and payload["config"]["nodes"] == [1, 2]
    one, two = payload["rows"]
    assert one["fits"] and two["fits"] and sum(two["stage_layers"]) == 24
    md = (tmp_path / "modeled.md").read_text()
    assert md.startswith("# MODELED") and "python scripts/model_dist.py --models opt-1.3b" in md


def test_bench_dist_bad_splits_is_one_line(tmp_path):
    r = run_script("bench_dist.py", "--splits", "3x3", "--out", str(tmp_path))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "does not make the batch of 8" in r.stderr
    assert not list(tmp_path.iterdir())
