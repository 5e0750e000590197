"""scripts/bench_throttled.py, bench_ablations.py and bench_upstream_sparpr.py: a tiny throttled run writes every run's counts
and the model's errors (no speed targets here: those live in results/); bad input is one line
and exit 2."""
from __future__ import annotations

import json
import os

import pytest

from flexgen_sparpr.config.flags import DEFAULTS
from tests.scripts.resolved_check import check_resolved
from tests.scripts.runner import run_script


def groups() -> set[str]:
    root = "/sys/fs/cgroup/blkio"
    return {p for p in os.listdir(root) if p.startswith("flexgen-sparpr-")} if os.path.isdir(root) else set()


def test_tiny_throttled_run_counts_every_byte(tmp_path):
    out, before = tmp_path / "res", groups()
    r = run_script("bench_throttled.py", "--contexts", "192", "--gen-len", "3", "--calib-context", "128",
                   "--min-keep-tokens", "0",
                   "--no-upstream", "--read-mbps", "400", "--out", str(out), "--stem", "t",
                   "--offload-dir", str(tmp_path / "offload"))
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads((out / "t.json").read_text())
    (row,) = data["runs"]
    d, s = row["cells"]["dense"], row["cells"]["sparpr"]
    assert 0 < s["disk_read_bytes"] < d["disk_read_bytes"]
    assert s["blocks_selected"] <= s["blocks_total"] and s["requests"]["disk->cpu"] > 0
    assert all(abs(c["model_error"]) < 10 for c in (d, s))  # a number, whatever its size on a busy machine
    check_resolved(d["resolved"], policy="dense", block_size=DEFAULTS["block_size"])  # each run's own, the engine's block
    check_resolved(s["resolved"], policy="sparpr", block_size=DEFAULTS["block_size"])
    assert data["config"]["engine_commit"] and data["command"].startswith("python scripts/bench_throttled.py")
    if row["throttled"]:  # root with cgroup v1 blkio: the kernel saw the engine's O_DIRECT reads, and beside
        # them only the few pages the process faults in meanwhile from the same disk (code, a lazy import)
        for c in (d, s):
            assert 0 <= c["kernel_disk_read_bytes"] - c["disk_read_bytes"] <= max(1 << 20, c["disk_read_bytes"] // 100)
    else:
        assert "NOT throttled" in (out / "t.md").read_text()
    assert data["balance"]["read_mbps"] > 0 and not (tmp_path / "offload").exists()
    (summ,) = data["summary"]
    assert summ["bytes_ratio"] == pytest.approx(s["disk_read_bytes"] / d["disk_read_bytes"])
    assert not groups() - before  # its cgroup is removed


@pytest.mark.parametrize("script, args, msg", [
    ("bench_throttled.py", ["--read-mbps", "0"], "--read-mbps"),
    ("bench_throttled.py", ["--there-cache-percent", "50,10"], "--there-cache-percent"),
    ("bench_throttled.py", ["--gen-lens", "1"], "--gen-len"),
    ("bench_ablations.py", ["--trials", "0"], "--trials"),
    ("bench_ablations.py", ["--read-mbps", "-3"], "--read-mbps"),
    ("bench_upstream_sparpr.py", ["--percent", "1,2,3"], "--percent"),
    ("bench_upstream_sparpr.py", ["--contexts", "x"], "--contexts"),
])
def test_bad_input_is_one_line(script, args, msg):
    r = run_script(script, *args)
    assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
