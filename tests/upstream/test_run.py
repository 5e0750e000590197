"""run_upstream: the subprocess runner the latency scripts call."""
from __future__ import annotations

import json
import os

import pytest
import torch

from flexgen_sparpr.models.spec import opt_spec
from flexgen_sparpr.upstream import patches
from flexgen_sparpr.upstream.run import (main, parse_child, prefill_scores_bytes, prepare_upstream, run_upstream,
                                         upstream_command)


def test_run_upstream_in_a_subprocess(tmp_path):
    r = run_upstream(batch=2, prompt_len=16, gen_len=3, offload_dir=str(tmp_path / "off"))
    assert r["ok"], r
    assert r["prefill_s"] > 0 and r["decode_s"] > 0
    assert abs(r["total_s"] - r["prefill_s"] - r["decode_s"]) < 1e-9
    assert r["decode_tok_s"] == 2 * (3 - 1) / r["decode_s"]
    assert len(r["tokens"]) == 2 and all(len(t) == 3 for t in r["tokens"])
    assert r["config"]["weights"] == "ones"  # upstream's own _DUMMY_ weights
    assert r["config"]["threads"] == torch.get_num_threads()  # the caller's thread count
    assert list((tmp_path / "off").iterdir()) == []  # upstream's offload files are gone
    # the child's peak RSS, under the key the latency report reads (it once wrote peak_rss_mb, so the
    # report showed n/a): at least its float32 weights (an independent count), at most the machine
    weights = opt_spec("opt-125m").num_params() * 4
    assert "peak_rss_mb" not in r and weights < r["peak_rss_bytes"] < os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_bad_input_is_one_error_line_and_exit_2(capsys, tmp_path):
    out = tmp_path / "r.json"
    for argv, words in ((["--model", "opt-unknown"], "opt-unknown"),
                        (["--sparpr", '{"keep_ratio": 2.0}'], "keep_ratio"),
                        (["--sparpr", "[1]"], "JSON object"),
                        (["--percent", "60", "60", "100", "0", "100", "0"], "percent"),
                        (["--threads", "0"], "threads")):
        assert main(argv + ["--batch", "1", "--prompt-len", "8", "--gen-len", "2", "--output", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and words in err
        assert json.loads(out.read_text())["ok"] is False
    assert main(["--json", "--model", "opt-unknown"]) == 2  # --json: the failure is the one JSON line
    assert json.loads(capsys.readouterr().out) == {"ok": False, "error": "ValueError: Invalid model name: opt-unknown"}


def test_command_and_parse():
    cmd = upstream_command(batch=3, prompt_len=64, gen_len=5, percent=(0, 100, 0, 100, 100, 0),
                           cut_gen_len=2, sparpr={"keep_ratio": 0.5}, threads=1)
    assert cmd[1:3] == ["-m", "flexgen_sparpr.upstream.run"]
    assert cmd[cmd.index("--percent") + 1:cmd.index("--percent") + 7] == ["0", "100", "0", "100", "100", "0"]
    assert cmd[cmd.index("--sparpr") + 1] == '{"keep_ratio": 0.5}'
    assert cmd[cmd.index("--threads") + 1] == "1"
    assert parse_child(0, 'noise\n{"ok": true, "x": 1}\n', "") == {"ok": True, "x": 1}
    assert parse_child(-9, "", "") == {"ok": False, "error": "killed (out of memory?)"}
    assert parse_child(1, "", "Traceback...\nKeyError: 'x'\n") == {"ok": False, "error": "exit 1: KeyError: 'x'"}


def test_a_prefill_that_cannot_fit_is_refused_before_it_starts(capsys):
    assert prefill_scores_bytes(4, 8192, 12, 4) == 2 * 4 * 12 * 8192 * 8192 * 4  # 24 GiB at 8k, batch 4
    assert main(["--json", "--batch", "4096", "--prompt-len", "16384", "--gen-len", "2"]) == 1
    err = json.loads(capsys.readouterr().out)["error"]
    assert err.startswith("MemoryError: OOM (predicted)") and "GiB available" in err


def test_upstream_runs_unpatched_on_cuda_and_patched_on_the_cpu(monkeypatch):
    """The peer on a GPU is upstream as shipped: the CPU patches only where there is no CUDA or
    when asked (before, they were applied always, so a GPU run measured the CPU)."""
    calls = []
    monkeypatch.setattr(patches, "apply_cpu_patches", lambda: calls.append("cpu") or ["cpu-patches"])
    monkeypatch.setattr(patches, "use_float32_compute", lambda on=True: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert prepare_upstream() == {"device": "cuda", "dtype": "float16", "patches": []} and not calls
    assert prepare_upstream("cpu") == {"device": "cpu", "dtype": "float32",
                                       "patches": ["cpu-patches", "use_float32_compute"]} and calls
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert prepare_upstream()["device"] == "cpu"
    with pytest.raises(ValueError, match="no CUDA device"):
        prepare_upstream("cuda")
    with pytest.raises(ValueError, match="gpu-mem"):
        prepare_upstream("cpu", gpu_mem=8)
