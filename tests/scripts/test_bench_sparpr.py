"""scripts/bench_sparpr.py at a tiny size: both policies run, the files carry the run's own
facts (no speed targets here: those live in results/), and bad input is one line and exit 2."""
from __future__ import annotations

import json

import pytest

from flexgen_sparpr.config.flags import DEFAULTS
from flexgen_sparpr.kv.policies.sparpr import SparPR
from tests.scripts.resolved_check import check_resolved
from tests.scripts.runner import run_script


def run(*args):
    return run_script("bench_sparpr.py", *args)


def test_tiny_run_writes_both_policies_and_the_bound(tmp_path):
    out = tmp_path / "res"
    r = run("--contexts", "256", "--gen-len", "3", "--device", "cpu", "--min-keep-tokens", "0", "--out", str(out),
            "--offload-dir", str(tmp_path / "offload"))
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads((out / "bench.json").read_text())
    assert [(c["context"], c["policy"]) for c in data["cells"]] == [(256, "dense"), (256, "sparpr")]
    assert all(c["device"] == "cpu" and c["dtype"] == "float32" for c in data["cells"])
    (s,) = data["summary"]
    assert 0 < s["cut_if_decode_free"] < 1 and 0 < s["bytes_per_token_ratio"] < 1
    assert s["est_bytes_bound"]  # the engine's counters: at most SparPR's own estimate (the arena saves)
    for c in data["cells"]:  # each cell's own engine, as it resolved its flags
        check_resolved(c["resolved"], policy=c["policy"], block_size=DEFAULTS["block_size"], compute_dtype="float32",
                       device="cpu")
    # the flag's default is the engine's, as the policy took it
    assert data["cells"][1]["resolved"]["kv_policy"]["keep_ratio"] == SparPR.__dataclass_fields__["keep_ratio"].default
    assert data["config"]["engine_commit"] and data["command"].startswith("python scripts/bench_sparpr.py")
    stats = data["cells"][1]["kv_policy_stats"]
    assert stats["checkpoint_tables"]["asked"] == 12  # opt-125m: one table per layer
    md = (out / "bench.md").read_text()
    assert "float32 on cpu" in md and "most a decode speed-up could cut" in md
    assert not list(tmp_path.glob("offload/run-*"))  # the disk tier's run folder is removed


@pytest.mark.parametrize("args, msg", [
    (["--contexts", "abc"], "--contexts"),
    (["--gen-len", "1"], "--gen-len"),
    (["--keep-ratio", "0"], "--keep-ratio"),
    (["--min-keep-tokens", "-1"], "--min-keep-tokens: must be a whole number >= 0"),
    (["--model", "llama-7b"], "--model"),
    (["--batch", "four"], "--batch"),  # argparse's own check: one line too, not the usage
    (["--device", "tpu"], "--device"),
    (["--cache-cpu-percent", "12.5"], "whole numbers"),  # the LLM's --percent takes integers
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, msg):
    r = run(*args, "--out", str(tmp_path / "res"))
    assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr
    assert "\n" not in r.stderr.strip()
    assert not (tmp_path / "res").exists()
