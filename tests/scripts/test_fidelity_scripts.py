"""scripts/needle.py, ppl.py, frontier.py and dkv_speed.py: bad input is one line and exit 2,
before any model is loaded (their runs are long: they live in results/, not here; the logic they
share is tested in tests/bench/)."""
from __future__ import annotations

import json

import pytest

from tests.scripts.runner import run_script


@pytest.mark.parametrize("script, args, msg", [
    ("needle.py", ["--task", "nope"], "--task"),
    ("needle.py", ["--policies", "nope"], "nope"),
    ("needle.py", ["--texts", "alice29"], "tuning split"),  # a held-out run on the tuning text
    ("needle.py", ["--split", "other"], "--split"),
    ("needle.py", ["--keep", "0"], "keep"),
    ("needle.py", ["--dkv-residuals", "300"], "--dkv-residuals"),
    ("ppl.py", ["--keep", "1.5"], "--keep"),
    ("ppl.py", ["--windows", "0"], "--windows"),
    ("ppl.py", ["--texts", "nope"], "nope"),
    ("dkv_speed.py", ["--gen-len", "1"], "--gen-len"),
    ("frontier.py", ["/nonexistent/needle.json"], "cannot read"),
    # a prompt that leaves the model no position for the answer: refused before any cell runs
    ("needle.py", ["--task", "passkey", "--lengths", "2048,8192"], "longest prompt that fits is 8180"),
    ("ppl.py", ["--lengths", "2048,8192"], "longest prompt that fits is 8127"),
    ("dkv_speed.py", ["--lengths", "8192"], "longest prompt that fits is 8176"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, script, args, msg):
    r = run_script(script, *args, "--out", str(tmp_path / "res"))
    assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "\n" not in r.stderr.strip()
    assert not (tmp_path / "res").exists()


def test_frontier_refuses_files_of_other_prompts(tmp_path):
    rec = {"trial": "passkey:2048:0:0", "task": "passkey", "length": 2048, "label": "dense", "policy": "dense",
           "keep": 1.0, "hit": True, "canon": "1", "expected": ["1"], "depth": 0.1, "text": "asyoulik"}
    plan = {"split": "held-out", "texts": ["asyoulik"], "depths": [0.1], "seed": 1, "tasks": ["passkey"],
            "trials": 1, "batch": 1, "answer_prefix": "x"}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"plan": plan, "config": {}, "records": [rec]}))
    b.write_text(json.dumps({"plan": plan, "config": {}, "records": [rec | {"expected": ["2"], "label": "x@0.1"}]}))
    r = run_script("frontier.py", str(a), str(b), "--out", str(tmp_path / "res"))
    assert r.returncode == 2 and "another prompt" in r.stderr
    ok = tmp_path / "c.json"
    ok.write_text(json.dumps({"plan": plan, "config": {}, "records": [
        rec, rec | {"label": "sparpr@0.1", "policy": "sparpr", "keep": 0.1}]}))
    r = run_script("frontier.py", str(ok), "--out", str(tmp_path / "res"))
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "res" / "frontier.json").read_text())
    assert data["frontier"]["sparpr"] == [{"task": "passkey", "length": 2048, "keep": 0.1}]
    assert (tmp_path / "res" / "frontier.png").stat().st_size > 0
    # --drop leaves a label out (an older default's keep): the frontier is then what remains
    ok.write_text(json.dumps({"plan": plan, "config": {}, "records": [
        rec, *(rec | {"label": f"sparpr@{k}", "policy": "sparpr", "keep": k} for k in (0.5, 0.1))]}))
    r = run_script("frontier.py", str(ok), "--drop", "sparpr@0.1", "--out", str(tmp_path / "res3"))
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "res3" / "frontier.json").read_text())
    assert data["frontier"]["sparpr"] == [{"task": "passkey", "length": 2048, "keep": 0.5}]
    assert data["config"]["dropped"] == ["sparpr@0.1"]
    # LABEL:LENGTH leaves a label out at one context length only
    long = {"trial": "passkey:4096:0:0", "length": 4096}
    ok.write_text(json.dumps({"plan": plan, "config": {}, "records": [
        rec, rec | long, *(rec | x | {"label": f"sparpr@{k}", "policy": "sparpr", "keep": k}
                           for k in (0.5, 0.1) for x in ({}, long))]}))
    r = run_script("frontier.py", str(ok), "--drop", "sparpr@0.1:4096", "--out", str(tmp_path / "res5"))
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "res5" / "frontier.json").read_text())
    assert data["frontier"]["sparpr"] == [{"task": "passkey", "length": 2048, "keep": 0.1},
                                          {"task": "passkey", "length": 4096, "keep": 0.5}]
    for drop, msg in (("sparpr@0.2", "sparpr@0.2"), ("sparpr@0.1,sparpr@0.5", "no frontier"),
                      ("sparpr@0.1:8192", "sparpr@0.1:8192"), ("sparpr@0.1:4k", "policy@keep:length")):
        r = run_script("frontier.py", str(ok), "--drop", drop, "--out", str(tmp_path / "res4"))
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert not (tmp_path / "res4").exists()


def test_frontier_reads_dkv_budget_as_its_bytes_per_configuration(tmp_path):
    """Two dkv runs of the same prompts (16 and 64 exact rows): each is its own budget, the bytes
    share its rank and rows give; the frontier is the smallest share that agrees with dense."""
    from flexgen_sparpr.bench.frontier_report import dkv_bytes
    plan = {"split": "held-out", "texts": ["asyoulik"], "depths": [0.1], "seed": 1, "tasks": ["passkey"],
            "trials": 2, "batch": 2, "answer_prefix": "x", "dkv_block": 256}
    base = {"task": "passkey", "length": 2048, "expected": ["1"], "depth": 0.1, "text": "asyoulik", "keep": 1.0}
    dense = [base | {"trial": f"t{i}", "label": "dense", "policy": "dense", "hit": True, "canon": "1"} for i in (0, 1)]
    dkv16 = [base | {"trial": f"t{i}", "label": "dkv", "policy": "dkv", "hit": i == 0, "canon": "1" if i == 0 else "2"}
             for i in (0, 1)]  # disagrees on one trial
    dkv64 = [r | {"hit": True, "canon": "1"} for r in dkv16]
    files = []
    for name, p, recs in (("a", plan, dense + dkv16), ("b", plan | {"dkv_args": {"residuals": 64}}, dkv64)):
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps({"plan": p, "config": {}, "records": recs}))
    r = run_script("frontier.py", *map(str, files), "--out", str(tmp_path / "res"))
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "res" / "frontier.json").read_text())
    assert data["frontier"]["dkv"] == [{"task": "passkey", "length": 2048, "keep": round(dkv_bytes(residuals=64), 4)}]
    assert sorted(data["config"]["keeps"]["dkv"]) == [round(dkv_bytes(), 4), round(dkv_bytes(residuals=64), 4)]
    assert "1/2" in (tmp_path / "res" / "frontier.md").read_text()
    # sparpr+dkv over another DKV configuration would mix its keeps with the default's: refused
    files[1].write_text(json.dumps({"plan": plan | {"dkv_args": {"residuals": 64}}, "config": {}, "records": [
        dkv64[0] | {"label": "sparpr+dkv@0.1", "policy": "sparpr+dkv", "keep": 0.1}]}))
    r = run_script("frontier.py", *map(str, files), "--out", str(tmp_path / "res2"))
    assert r.returncode == 2 and "sparpr+dkv" in r.stderr and "Traceback" not in r.stderr
    # a run with --dkv-exact-routed 2 stores the default bytes but is its own column, apart from dkv's
    files[1].write_text(json.dumps({"plan": plan | {"dkv_args": {"exact_routed": 2}}, "config": {}, "records": dkv64}))
    r = run_script("frontier.py", *map(str, files), "--out", str(tmp_path / "res3"))
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "res3" / "frontier.json").read_text())
    assert data["frontier"]["dkv"] == [{"task": "passkey", "length": 2048, "keep": None}]  # 1/2 at 16 rows
    assert data["frontier"]["dkv-exact2"] == [{"task": "passkey", "length": 2048, "keep": round(dkv_bytes(), 4)}]
    assert "dkv-exact2 bytes" in (tmp_path / "res3" / "frontier.md").read_text()


def test_needle_plot_only_with_dense_answers_to_agree_with(tmp_path):
    """A --no-dense run has no agreement to draw: no plot (an older one removed), and the md says
    why; with dense's answers the plot is drawn."""
    from flexgen_sparpr.bench.needle_report import plot
    png = tmp_path / "needle.png"
    png.write_bytes(b"old")
    row = {"task": "passkey", "length": 2048, "policy": "sparpr", "keep": 0.1, "agree_rate": None}
    assert plot([row], [2048], png) is False and not png.exists()
    assert plot([row | {"agree_rate": 0.9}], [2048], png) is True and png.stat().st_size > 0


def test_frontier_joins_files_of_other_lengths_with_other_trial_counts(tmp_path):
    def file(name, length, trials):
        rec = {"trial": f"passkey:{length}:0:0", "task": "passkey", "length": length, "label": "dense",
               "policy": "dense", "keep": 1.0, "hit": True, "canon": "1", "expected": ["1"], "depth": 0.1,
               "text": "gpl3"}
        plan = {"split": "fresh", "texts": ["gpl3"], "depths": [0.1], "seed": 1, "tasks": ["passkey"],
                "trials": trials, "batch": trials, "answer_prefix": "x", "lengths": [length]}
        path = tmp_path / name
        path.write_text(json.dumps({"plan": plan, "config": {}, "records": [
            rec, rec | {"label": "sparpr@0.1", "policy": "sparpr", "keep": 0.1}]}))
        return str(path)
    r = run_script("frontier.py", file("a.json", 2048, 24), file("b.json", 8000, 12), "--out", str(tmp_path / "r"))
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "r" / "frontier.json").read_text())
    assert [c["length"] for c in data["frontier"]["sparpr"]] == [2048, 8000]
    r = run_script("frontier.py", file("a.json", 2048, 24), file("c.json", 2048, 12), "--out", str(tmp_path / "r2"))
    assert r.returncode == 2 and "trials" in r.stderr


def _passkey_file(tmp_path, n: int, rows) -> str:
    """A needle.json of n passkey trials at 2048 tokens on the fresh split: dense hits every one;
    rows(j) gives trial j's other records (label, policy, keep, hit, canon, answer?)."""
    plan = {"split": "fresh", "texts": ["gpl3"], "depths": [0.1], "seed": 1, "tasks": ["passkey"],
            "trials": n, "batch": n, "answer_prefix": "x", "lengths": [2048]}
    recs = []
    for j in range(n):
        base = {"trial": f"passkey:2048:0:{j}", "task": "passkey", "length": 2048, "expected": ["1"], "depth": 0.1,
                "text": "gpl3"}
        recs.append(base | {"label": "dense", "policy": "dense", "keep": 1.0, "hit": True, "canon": "1",
                            "answer": "1."})
        recs += [base | r for r in rows(j)]
    f = tmp_path / "n.json"
    f.write_text(json.dumps({"plan": plan, "config": {}, "records": recs}))
    return str(f)


def test_agreement_verdict_and_differing_trials(tmp_path):
    def rows(j):
        miss = j == 3  # one trial of 20 differs: 19/20 = 95 % meets the bar
        return [{"label": "sparpr@0.1", "policy": "sparpr", "keep": 0.1, "hit": not miss,
                 "canon": "7" if miss else "1", "answer": "7 | 7" if miss else "1."}]
    f = _passkey_file(tmp_path, 20, rows)
    r = run_script("agreement.py", f, "--out", str(tmp_path / "r"))
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "r" / "agreement.json").read_text())
    assert data["verdict"] == [{"task": "passkey", "length": 2048, "agree": 19, "n": 20, "need": 19,
                                "agree_lo": data["verdict"][0]["agree_lo"], "met": True}]
    assert [d["trial"] for d in data["differing"]["sparpr@0.1"]] == ["passkey:2048:0:3"]
    assert "'7 \\| 7'" in (tmp_path / "r" / "agreement.md").read_text()
    r = run_script("agreement.py", f, "--target", "quest@0.1", "--out", str(tmp_path / "r2"))
    assert r.returncode == 2 and "--target" in r.stderr


def test_agreement_pair_sets_two_configurations_side_by_side(tmp_path):
    f = _passkey_file(tmp_path, 4, lambda j: [
        {"label": "quest@0.1", "policy": "quest", "keep": 0.1, "hit": j < 2, "canon": "1" if j < 2 else "7"},
        {"label": "sparpr@0.1", "policy": "sparpr", "keep": 0.1, "hit": True, "canon": "1"}])
    r = run_script("agreement.py", f, "--pair", "quest@0.1,sparpr@0.1", "--title", "Q vs S", "--out",
                   str(tmp_path / "r"))
    assert r.returncode == 0, r.stderr
    md = (tmp_path / "r" / "agreement.md").read_text()
    assert md.startswith("# Q vs S (") and "| passkey | 2 -> 4 |" in md and "| all (tasks where both ran) | 2 -> 4 of 4 (100 %) |" in md
    r = run_script("agreement.py", f, "--pair", "quest@0.1,h2o@0.1", "--out", str(tmp_path / "r2"))
    assert r.returncode == 2 and "--pair" in r.stderr
