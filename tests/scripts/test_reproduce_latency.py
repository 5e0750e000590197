"""scripts/reproduce_latency.py --quick: every system and the model run end to end; the files
have their structure and positive numbers (no speed targets here: those live in results/)."""
from __future__ import annotations

import json

import pytest

from tests.scripts.resolved_check import check_resolved
from tests.scripts.runner import run_script


def run(*args):
    return run_script("reproduce_latency.py", *args)


def test_quick_run_writes_measured_and_modeled_results(tmp_path):
    out = tmp_path / "results"
    r = run("--quick", "--out", str(out), "--offload-dir", str(tmp_path / "offload"))
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads((out / "latency_measured.json").read_text())
    assert data["config"]["contexts"] == [128] and data["config"]["batch"] == 4
    assert data["machine"]["load_average"] is not None and data["load_average_end"] is not None
    cells = {c["system"]: c for c in data["cells"]}
    assert set(cells) == {"upstream", "dense", "sparpr", "hf"}
    for name in ("dense", "sparpr", "hf"):
        c = cells[name]
        assert c["ok"], c
        assert c["prefill_s"] > 0 and c["decode_s"] > 0 and c["e2e_s"] > 0 and c["throughput_tok_s"] > 0
        assert c["peak_rss_bytes"] > 0
    up = cells["upstream"]
    assert up["ok"] and up["e2e_s"] > 0 or up["error"]  # reported either way, never silently dropped
    if up["ok"]:  # its peak RSS reaches the memory table (the child once wrote it under another key)
        assert up["peak_rss_bytes"] > 0
        row = next(l for l in (out / "latency_measured.md").read_text().split("## Memory under the cap")[1]
                   .splitlines() if l.startswith("| 128 |"))
        assert row.split("|")[1 + data["config"]["systems"].index("upstream") + 1].strip() != "n/a"
    for name in ("dense", "sparpr"):
        c = cells[name]
        assert [s["kind"] for s in c["trace"]] == ["prefill", "decode"]
        assert c["trace"][1]["bytes"]["disk->cpu"] > 0  # the KV cache lives on disk
        assert c["model"]["model_trace_s"] > 0 and c["model"]["analytic_over_trace_bytes"]["cpu->disk"] == 1.0
        check_resolved(c["resolved"], policy=name, block_size=data["config"]["block_size"])
    assert "resolved" not in cells["hf"] and "resolved" not in up  # no LLM of this engine there
    assert all(check_resolved(c["resolved"], policy=c["system"]) for c in data["calibration_runs"])
    assert data["config"]["engine_commit"] and data["command"].startswith("python scripts/reproduce_latency.py")
    cal = data["calibration"]
    assert cal["prefill_eff"] > 0 and cal["decode_eff"] > 0 and cal["io_eff"] > 0
    md = (out / "latency_measured.md").read_text()
    for heading in ("## End-to-end latency and throughput", "## SparPR's reduction and ratio",
                    "## Memory under the cap", "## Time model vs measurement"):
        assert heading in md
    assert "31/52/63" in md and "Load average" in md  # the paper's numbers and the load sit beside ours
    assert (out / "latency_measured.png").stat().st_size > 0
    assert (out / "latency_hardware_this_machine.yaml").is_file()
    for stem in ("latency_modeled_rtx3070ti", "latency_modeled_t4"):
        m = json.loads((out / f"{stem}.json").read_text())
        assert [r["context"] for r in m["rows"]] == [1024, 2048, 4096, 8192]
        for row in m["rows"]:
            if row.get("placement"):  # SparPR runs on its own placement (summaries in host memory)
                assert set(row["sparpr_placement"]) == {"0.5", "0.1"}
                assert 0 < row["sparpr_keep0.1"]["total_s"] and 0 < row["dense"]["total_s"]
                # the host's scoring of the summaries is in SparPR's time, dense has none
                assert row["sparpr_keep0.1"]["host_scoring_s_per_step"] > 0 == row["dense"]["host_scoring_s_per_step"]
        assert m["host_scan_GBps"] > 0
        assert m["kv_policy"]["name"] == "sparpr" and m["block_size"] and m["engine_commit"]  # what it models
        last = m["rows"][-1]  # at 8k the KV cache dominates a step: reading a tenth of it must pay
        assert last["sparpr_keep0.1"]["total_s"] < last["dense"]["total_s"]
        assert "*modeled*" in (out / f"{stem}.md").read_text()
    assert not list(out.glob(".*tmp*"))  # nothing half-written left behind


@pytest.mark.parametrize("args, msg", [
    (["--contexts", "1k"], "--contexts"),
    (["--systems", "dense,deepspeed"], "--systems"),
    (["--keep-ratio", "0"], "--keep-ratio"),
    (["--model", "smollm2-135m"], "--model"),
    (["--predict-hardware", "nope.yaml"], "hardware file not found"),
])
def test_bad_input_is_one_error_line_and_exit_2(tmp_path, args, msg):
    r = run(*args, "--out", str(tmp_path / "r"))
    assert r.returncode == 2
    assert r.stderr.strip().startswith("error:") and msg in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "r").exists()
