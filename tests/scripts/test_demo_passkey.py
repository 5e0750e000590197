"""`make run`'s demo at a short context: dense and SparPR from one prefill, a row each with its
median step, decode speed, disk bytes per step, where the step went and the answers; SparPR reads
less from disk; no offload files left."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_demo_shows_dense_and_sparpr_side_by_side(smollm2_dir, tmp_path):
    off = tmp_path / "off"
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "demo_passkey.py"), "--tokens", "512", "--quiet",
                        "--batch", "2", "--steps", "4", "--keep", "0.25", "--min-keep-tokens", "0",
                        "--offload-dir", str(off)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {m[0]: (float(m[1]), float(m[3]), [float(x) for x in re.findall(r"([\d.]+)s", m[4])])
            for m in re.findall(r"^(dense|sparpr@0\.25) +([\d.]+)s +([\d.]+) +([\d.]+) +((?:[\d.]+s +){5}) *\d/2 found$",
                                r.stdout, re.M)}
    assert set(rows) == {"dense", "sparpr@0.25"}, r.stdout
    assert rows["dense"][1] > 0 and rows["sparpr@0.25"][1] < rows["dense"][1]  # disk MiB read per step
    for step, _, parts in rows.values():  # select, read, rebuild, io_wait, compute: a median each
        assert len(parts) == 5 and all(p >= 0 for p in parts)
    assert rows["sparpr@0.25"][2][0] > 0 and rows["dense"][2][0] == 0  # only SparPR selects
    assert "prefill (one, shared)" in r.stdout
    assert not off.exists() or not any(off.iterdir())
