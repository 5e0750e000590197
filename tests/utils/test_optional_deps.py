"""Dependencies used only for reporting (psutil, nvidia-ml-py) and only by some inputs (gguf,
matplotlib, accelerate) are optional: a GPU machine that has torch and transformers alone runs
the CLI, the scripts' helpers and the profile, and still reports host memory."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flexgen_sparpr.utils import host

REPO = Path(__file__).resolve().parents[2]
MISSING = ("psutil", "pynvml", "gguf", "matplotlib", "accelerate")

CHILD = """
import sys
for name in {missing!r}:
    sys.modules[name] = None  # `import name` now raises ImportError, as if not installed
import flexgen_sparpr.bench.args, flexgen_sparpr.bench.results, flexgen_sparpr.bench.offload  # noqa: E401,F401 (the scripts' helpers)
from flexgen_sparpr.runtime.profile import free_memory
from flexgen_sparpr.cli.run import run
import torch
out = run({argv!r})
print("RESULT", __import__("json").dumps({{"rss": out["peak_memory"]["host_rss_peak_bytes"],
      "host": free_memory(torch.device("cpu"))[1], "tokens": out["output_ids"]}}))
"""


def test_cli_and_scripts_run_without_the_reporting_dependencies(tmp_path):
    argv = ["--model", "opt-125m", "--path", "_DUMMY_", "--prompt-len", "8", "--gen-len", "2",
            "--gpu-batch-size", "1", "--warmup", "false", "--no-log", "--verbose", "0", "--device", "cpu",
            "--percent", "100", "0", "0", "0", "100", "0", "--offload-dir", str(tmp_path)]
    proc = subprocess.run([sys.executable, "-c", CHILD.format(missing=MISSING, argv=argv)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    got = json.loads(line.removeprefix("RESULT "))
    assert got["rss"] > 10 << 20 and got["host"] > 0 and len(got["tokens"][0]) == 2


def test_proc_fallbacks_agree_with_psutil(monkeypatch):
    psutil = pytest.importorskip("psutil", reason="the comparison needs psutil itself")
    with_psutil = (host.rss_bytes(), host.available_memory_bytes(), host.cpu_count())
    monkeypatch.setattr(host, "psutil", None)
    rss, avail, cores = host.rss_bytes(), host.available_memory_bytes(), host.cpu_count()
    assert abs(rss - with_psutil[0]) < 64 << 20  # the same process a moment later
    assert abs(avail - with_psutil[1]) < max(1 << 30, with_psutil[1] // 5)  # other processes move it
    assert cores == with_psutil[2] == psutil.cpu_count(logical=True)
