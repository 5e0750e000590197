"""scripts/bench_llamacpp.py: this engine beside llama.cpp on the prepared SmolLM2 GGUF. Without
llama-cpp-python (an optional bench extra CI does not build) the script says so in one line;
with it, a tiny run writes both sides and where their greedy tokens part."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from flexgen_sparpr.bench.llamacpp import first_difference, gguf_path, median_step_keep
from flexgen_sparpr.bench.peers import llamacpp_greedy, llamacpp_version
from tests.scripts.runner import REPO, run_script

WITHOUT = ("import runpy, sys; sys.modules['llama_cpp'] = None; sys.argv = ['bench_llamacpp.py', '--out', {out!r}]; "
           "runpy.run_path('scripts/bench_llamacpp.py', run_name='__main__')")


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([4], [5, 6]) == 0


def test_the_floor_reads_the_median_steps_keep():
    """SparPR's floor stands for its median step: a few steps timed dense (the measured step fallback)
    must not count a run's mean into it."""
    steps = [{"effective_keep": k} for k in (0.1, 0.1, 1.0, 1.0, 0.12, 0.1, 0.11)]
    assert median_step_keep({"steps": steps, "totals": {"effective_keep": 0.36}}) == pytest.approx(0.11)


def test_without_llama_cpp_one_line_and_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-c", WITHOUT.format(out=str(tmp_path))], capture_output=True, text=True,
                       cwd=REPO)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "llama-cpp-python is not installed" in r.stderr and not list(tmp_path.iterdir())


@pytest.mark.parametrize("args", [["--gen-len", "1"], ["--lengths", "10"], ["--threads", "0"], ["--batches", "0"]])
def test_bad_flags_one_line(args):
    r = run_script("bench_llamacpp.py", *args)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr


@pytest.mark.skipif(llamacpp_version() is None, reason="llama-cpp-python is an optional bench extra, not built here")
@pytest.mark.skipif(gguf_path() is None, reason="needs the prepared SmolLM2 (`flexgen-sparpr prepare`)")
def test_tiny_run_writes_both_sides(tmp_path):
    r = run_script("bench_llamacpp.py", "--lengths", "200", "--gen-len", "4", "--batches", "1", "2", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    cells = json.loads((tmp_path / "llamacpp.json").read_text())["cells"]
    assert [c["batch"] for c in cells] == [1, 2]
    for cell in cells:
        b = cell["batch"]
        assert cell["llamacpp"]["ok"] and len(cell["llamacpp"]["tokens"]) == b and len(cell["llamacpp"]["step_s"]) == 3
        assert all(len(t) == 4 for t in cell["llamacpp"]["tokens"])
        assert set(cell["engine"]) == {f"{run}, weights {fmt}" for run in ("dense", "sparpr@0.1")
                                       for fmt in ("auto", "raw", "bfloat16", "int8")}  # every format by default
        # auto packs the prepared Q4_1 projections (and the Q8_0 head) for the int4 kernel where it is faster
        assert cell["resolved"]["auto"]["weight_format"].startswith("auto: ")
        assert all(len(row["tokens"]) == b and all(len(t) == 4 for t in row["tokens"]) and row["decode_tok_s"] > 0
                   and len(row["first_difference"]) == b for row in cell["engine"].values())
        # each format's floor is set against the bus measured right after its runs
        assert all(row["read_GBps"] > 0 and row["floor_s"] == pytest.approx(sum(row["step_bytes"].values())
                                                                            / (row["read_GBps"] * 1e9))
                   for row in cell["engine"].values())
    md = (tmp_path / "llamacpp.md").read_text()
    assert "| batch |" in md and "measured right after each weight format's runs" in md


@pytest.mark.skipif(llamacpp_version() is None, reason="llama-cpp-python is an optional bench extra, not built here")
@pytest.mark.skipif(gguf_path() is None, reason="needs the prepared SmolLM2 (`flexgen-sparpr prepare`)")
def test_llamacpp_batch_decodes_each_prompt_as_alone():
    """The batched runner keeps a KV cache per prompt: each prompt's greedy tokens in a batch are
    the ones it gets alone (prompts of different lengths, the longest over one prefill chunk)."""
    prompts = [[1, *range(100, 100 + n)] for n in (40, 530, 7)]
    both = llamacpp_greedy(gguf_path(), prompts, 5, 2)
    assert both["ok"] and len(both["step_s"]) == 4
    assert both["tokens"] == [llamacpp_greedy(gguf_path(), [p], 5, 2)["tokens"][0] for p in prompts]
