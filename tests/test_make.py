"""`make test`, as CI runs it, cannot silently skip the real-model tests: a failed `prepare`
fails the target, and with the model missing those tests fail instead of skipping."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_failed_prepare_fails_make_test(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    ran = tmp_path / "pytest-ran"
    (venv / "bin" / "flexgen-sparpr").write_text("#!/bin/sh\necho 'error: no network' >&2\nexit 3\n")
    (venv / "bin" / "python").write_text(f"#!/bin/sh\ntouch {ran}\n")
    for f in (venv / "bin").iterdir():
        f.chmod(0o755)
    (venv / ".installed").touch()  # set up already: only the recipe of `test` runs
    r = subprocess.run(["make", "-C", str(REPO), "test", f"VENV={venv}"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "no network" in r.stderr, r.stdout + r.stderr
    assert not ran.exists()  # pytest never ran on a half-prepared machine


def test_the_real_model_tests_fail_rather_than_skip_when_required(tmp_path):
    env = dict(os.environ, FLEXGEN_SPARPR_CACHE=str(tmp_path / "empty"), FLEXGEN_SPARPR_REQUIRE_MODEL="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                        "tests/engine/test_real_model.py"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1 and "SmolLM2 not prepared" in r.stdout and "skipped" not in r.stdout, r.stdout[-2000:]
