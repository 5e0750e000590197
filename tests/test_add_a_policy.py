"""docs/design.md's "Add a policy" walkthrough, executed: its code block, written as one file into
a copy of the package's kv/policies/, is a working policy with no other edit — through the CLI
with its own flag, in --help, refused on a bad value in one line, and in the test matrix."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PROMPTS = [list(range(3, 43)), list(range(50, 79))]


def walkthrough() -> str:
    """The python block of docs/design.md's "Add a policy" section."""
    text = (REPO / "docs/design.md").read_text()
    section = text[text.index("## Add a policy"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    """A copy of the repository's package and the test matrix, with the walkthrough's file added."""
    root = tmp_path_factory.mktemp("added")
    shutil.copytree(REPO / "flexgen_sparpr", root / "flexgen_sparpr", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "flexgen_sparpr/kv/policies/recent_blocks.py").write_text(walkthrough())
    (root / "tests/kv").mkdir(parents=True)
    for f in ("conftest.py", "kv/test_policies.py"):
        shutil.copy(REPO / "tests" / f, root / "tests" / f)
    return root


def python(root: Path, *args, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd or root,
                          timeout=600)


def run(root: Path, model: Path, tmp: Path, *flags) -> subprocess.CompletedProcess:
    ids = tmp / "ids.json"
    ids.write_text(json.dumps(PROMPTS))
    return python(root, "-m", "flexgen_sparpr", "run", "--model", str(model), "--path", "", "--prompt-ids-file",
                  str(ids), "--gpu-batch-size", "2", "--gen-len", "6", "--block-size", "8", "--device", "cpu",
                  "--percent", "100", "0", "0", "0", "100", "0", "--offload-dir", str(tmp / "offload"),
                  "--warmup", "false", "--verbose", "0", "--no-log", "--output-json", str(tmp / "out.json"), *flags)


def test_the_walkthrough_policy_runs_through_the_cli_with_its_own_flag(package, tiny_llama_dir, tmp_path):
    moved = {}
    for window in (1, 3):
        r = run(package, tiny_llama_dir, tmp_path, "--kv-policy", "recent-blocks", "--window-blocks", str(window))
        assert r.returncode == 0, r.stderr
        out = json.loads((tmp_path / "out.json").read_text())
        assert out["engine"]["kv_policy"] == "recent-blocks"
        assert out["engine"]["policy_args"] == {"window_blocks": window}
        moved[window] = out["bytes_moved"]["disk->cpu"]
    assert 0 < moved[1] < moved[3]  # the flag reaches the policy: a wider window reads more blocks


def test_its_flag_is_in_the_help_and_a_bad_value_is_one_line(package, tiny_llama_dir, tmp_path):
    r = python(package, "-m", "flexgen_sparpr", "run", "--help")
    assert r.returncode == 0 and "--window-blocks" in r.stdout and "--kv-policy recent-blocks: Recent blocks" in r.stdout
    r = run(package, tiny_llama_dir, tmp_path, "--kv-policy", "recent-blocks", "--window-blocks", "-1")
    assert r.returncode == 2 and r.stderr.strip() == "error: --window-blocks must be >= 0 (got -1)"


def test_it_joins_the_test_matrix(package):
    r = python(package, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kv/test_policies.py", "-k", "recent-blocks")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert re.search(r"(\d+) passed", r.stdout) and int(re.search(r"(\d+) passed", r.stdout).group(1)) >= 8
