"""The results plan (bench/plan.py, plan_entries.py) names scripts that exist and take its
arguments, produces (or excuses, with a reason) every results path the docs cite, keeps quick runs
out of the published files, and its runner goes on past a failure (no benchmark runs here)."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from flexgen_sparpr.bench.plan import QUICK_ROOT, Entry, excepted, expected_batches, is_complete, produces, select
from flexgen_sparpr.bench.plan_entries import EXCEPTIONS, PLAN
from flexgen_sparpr.bench.regen import run_plan
from flexgen_sparpr.bench.render import _CITED, docs

ROOT = Path(__file__).resolve().parents[2]
_FLAG = re.compile(r"^--[a-z][\w-]*$")

_HELPS = r"""
import contextlib, io, json, runpy, sys
out = {}
for script in sys.argv[1:]:
    sys.argv = [script, "--help"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
        runpy.run_path(script, run_name="__main__")
    out[script] = buf.getvalue()
print(json.dumps(out))
"""


def test_names_are_unique_and_scripts_exist():
    names = [e.name for e in PLAN]
    assert len(names) == len(set(names))
    assert [e.script for e in PLAN if not (ROOT / e.script).is_file()] == []


def test_every_script_takes_the_plans_flags():
    scripts = sorted({e.script for e in PLAN})
    r = subprocess.run([sys.executable, "-c", _HELPS, *scripts], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    helps = json.loads(r.stdout.splitlines()[-1])
    bad = []
    for e in PLAN:
        for arg in (*e.args, *(e.quick or ())):
            if _FLAG.match(arg) and not re.search(re.escape(arg) + r"(?![\w-])", helps[e.script]):
                bad.append(f"{e.name}: {e.script} has no {arg}")
    assert bad == []


def test_inputs_named_by_path_exist_or_are_produced():
    missing = [f"{e.name}: {a}" for e in PLAN for a in e.args
               if a.startswith("results/") and a.endswith(".json") and not (ROOT / a).is_file()
               and not produces(PLAN, a)]
    assert missing == []


def _cited() -> set[str]:
    return {p for doc in docs(ROOT) for p in _CITED.findall(doc.read_text())}


def test_every_cited_results_path_is_produced_or_excepted():
    orphans = sorted(p for p in _cited() if not produces(PLAN, p) and not excepted(EXCEPTIONS, p))
    assert orphans == [], ("results paths the docs cite that no plan entry writes; add an entry to "
                           f"bench/plan_entries.py or an exception with its reason: {orphans}")


def test_every_exception_is_cited_and_has_a_reason():
    cited = _cited()
    assert [e for e in EXCEPTIONS if not any(c.startswith(e) or e.startswith(c + "/") for c in cited)] == []
    assert all(len(why) > 20 for why in EXCEPTIONS.values())


@pytest.mark.parametrize("entry", [e for e in PLAN if e.quick is not None], ids=lambda e: e.name)
def test_a_quick_run_writes_only_under_its_own_folder(entry):
    cmd = entry.command(quick=True)
    assert "--out" in cmd and cmd[cmd.index("--out") + 1] == entry.quick_dir()
    for arg in cmd[1:]:
        if "results" in arg:
            assert arg.startswith(QUICK_ROOT + "/"), arg
    assert not any(o.startswith(QUICK_ROOT) for e in PLAN for o in e.outputs)


def test_entries_that_need_more_run_only_when_named():
    needy = [e for e in PLAN if e.needs]
    assert needy and not set(select(PLAN, None, quick=False)) & set(needy)
    assert select(PLAN, [needy[0].name], quick=False) == [needy[0]]
    assert all(e.quick is not None for e in select(PLAN, None, quick=True))
    with pytest.raises(ValueError, match="no such plan entry"):
        select(PLAN, ["nope"], quick=True)


def test_expected_batches_of_both_grids():
    assert expected_batches({"tasks": ["a", "b"], "lengths": [1, 2], "trials": 10, "batch": 4}) == 12
    assert expected_batches({"windows": 3, "texts": ["x", "y"], "lengths": [1], "batch": 4}) == 2
    assert expected_batches({"windows": 12, "texts": ["x", "y"], "stream": True, "lengths": [1, 2], "batch": 6}) == 4


def test_a_grid_is_complete_only_with_all_its_batches(tmp_path):
    e = Entry("g", "scripts/x.py", (), ("results/g/needle.json",), resumable=True)
    assert not is_complete(tmp_path, e)
    (tmp_path / "results/g").mkdir(parents=True)
    plan = {"tasks": ["a"], "lengths": [8], "trials": 4, "batch": 2}
    f = tmp_path / "results/g/needle.json"
    f.write_text(json.dumps({"plan": plan, "batches": [{"id": "a:8:0"}], "skipped": []}))
    assert not is_complete(tmp_path, e)
    f.write_text(json.dumps({"plan": plan, "batches": [{"id": "a:8:0"}, {"id": "a:8:2"}], "skipped": []}))
    assert is_complete(tmp_path, e)
    f.write_text(json.dumps({"plan": plan, "batches": [{"id": "a:8:0"}], "skipped": []}))
    assert is_complete(tmp_path, Entry("g", "scripts/x.py", (), e.outputs, resumable=True, partial="kept as published"))


def test_the_published_files_are_complete_or_kept_as_partial():
    assert [e.name for e in PLAN if not e.needs and not is_complete(ROOT, e)] == []


def test_the_runner_goes_on_past_a_failure_and_skips_what_is_done(tmp_path):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts/ok.py").write_text(
        "import sys, pathlib\nout = pathlib.Path(sys.argv[sys.argv.index('--out') + 1])\n"
        "out.mkdir(parents=True, exist_ok=True)\n(out / 'r.json').write_text('{}')\n")
    (tmp_path / "scripts/bad.py").write_text("raise SystemExit(3)\n")
    (tmp_path / "scripts/render_tables.py").write_text("print('rendered')\n")
    entries = [Entry("bad", "scripts/bad.py", (), ("results/bad/r.json",), ("--out", "{out}")),
               Entry("ok", "scripts/ok.py", ("--out", "results/ok"), ("results/ok/r.json",), ("--out", "{out}"))]
    lines: list[str] = []
    assert run_plan(tmp_path, entries, quick=False, force=False, say=lambda s, **_: lines.append(s)) == 1
    assert "FAILED (exit 3" in lines[0] and " ran " in lines[1] and (tmp_path / "results/ok/r.json").is_file()
    lines.clear()
    assert run_plan(tmp_path, entries[1:], quick=False, force=False, say=lambda s, **_: lines.append(s)) == 0
    assert "skipped (complete)" in lines[0] and lines[1] == "render: ok"
    lines.clear()
    assert run_plan(tmp_path, entries[1:], quick=True, force=False, say=lambda s, **_: lines.append(s)) == 0
    assert (tmp_path / QUICK_ROOT / "ok/r.json").is_file() and lines[1] == "render --check: ok"


def test_an_entry_without_its_optional_extra_is_skipped_and_said(tmp_path):
    """llama-cpp-python is an optional bench extra: a plan run without it says so and does not fail."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts/peer.py").write_text("raise SystemExit(2)\n")  # what the script does without it
    (tmp_path / "scripts/render_tables.py").write_text("print('rendered')\n")
    entry = Entry("peer", "scripts/peer.py", (), ("results/peer/r.json",), ("--out", "{out}"),
                  extra="no_such_module_here")
    lines: list[str] = []
    assert run_plan(tmp_path, [entry], quick=True, force=False, say=lambda s, **_: lines.append(s)) == 0
    assert "skipped (no_such_module_here is not installed" in lines[0]
    assert next(e for e in PLAN if e.name == "llamacpp").extra == "llama_cpp"


def test_ctrl_c_stops_the_plan_in_one_line(tmp_path):
    # Python's own Ctrl-C handler, as a terminal gives it: a job started in the background (`make
    # test` under nohup, say) inherits SIGINT ignored, and Python then leaves it ignored
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _ctrl_c_stops_the_plan(tmp_path)
    finally:
        signal.signal(signal.SIGINT, old)


def _ctrl_c_stops_the_plan(tmp_path):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts/int.py").write_text("import os, signal\nos.kill(os.getppid(), signal.SIGINT)\nimport time\n"
                                             "time.sleep(5)\n")
    entries = [Entry("int", "scripts/int.py", (), ("results/int/r.json",)),
               Entry("next", "scripts/int.py", (), ("results/next/r.json",))]
    lines: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        run_plan(tmp_path, entries, quick=False, force=False, say=lambda s, **_: lines.append(s))
    assert len(lines) == 1 and lines[0].startswith("stopped (Ctrl-C) during int;")


def test_a_results_file_names_the_command_that_made_it(tmp_path, monkeypatch):
    from flexgen_sparpr.bench.results import write_results
    monkeypatch.setattr(sys, "argv", [str(ROOT / "scripts/ppl.py"), "--lengths", "2048", "--out", "a b"])
    write_results(tmp_path, "r", {"config": {}})
    assert json.loads((tmp_path / "r.json").read_text())["command"] == "python scripts/ppl.py --lengths 2048 --out 'a b'"
    write_results(tmp_path, "s", {"command": "kept"})
    assert json.loads((tmp_path / "s.json").read_text())["command"] == "kept"
