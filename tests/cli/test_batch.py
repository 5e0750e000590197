"""`flexgen-sparpr batch`: killed after its first output line and run again, every id is written
once with the tokens of an uninterrupted run; bad input lines are one error line naming them."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flexgen_sparpr.cli.main import main

REPO = Path(__file__).resolve().parents[2]


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (n,), generator=g).tolist()


def _write_input(path: Path, n: int) -> list[str]:
    ids = [f"q{i}" for i in range(n)]
    lines = [{"id": q, "prompt_ids": _prompt(2 + (i * 7) % 19, i)} for i, q in enumerate(ids)]
    lines[3]["max_new_tokens"] = 3  # a batch of its own
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return ids


def _argv(model_dir, inp, out, off, *extra) -> list[str]:
    return ["--model", str(model_dir), "--input", str(inp), "--output", str(out), "--gen-len", "8",
            "--gpu-batch-size", "2", "--percent", "100", "0", "50", "0", "100", "0", "--block-size", "4",
            "--offload-dir", str(off), *extra]


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(tiny_llama_dir, tmp_path_factory):
    """The job's input, and its output run whole: {id: line}."""
    tmp = tmp_path_factory.mktemp("batch")
    inp, whole = tmp / "in.jsonl", tmp / "whole.jsonl"
    ids = _write_input(inp, 16)
    assert main(["batch", *_argv(tiny_llama_dir, inp, whole, tmp / "off", "--verbose", "0")]) == 0
    reference = {r["id"]: r for r in _lines(whole)}
    assert sorted(reference) == sorted(ids)
    return inp, reference


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_killed_after_the_first_line_and_rerun(tiny_llama_dir, tmp_path, uninterrupted, sig):
    inp, reference = uninterrupted
    ids, out, off = list(reference), tmp_path / "out.jsonl", tmp_path / "off"

    cmd = [sys.executable, "-m", "flexgen_sparpr", "batch", *_argv(tiny_llama_dir, inp, out, off)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not (out.exists() and out.read_bytes().count(b"\n") >= 1) and proc.poll() is None:
        assert time.monotonic() < deadline, "no output line in time"
        time.sleep(0.002)
    os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=120)
    kept = out.read_bytes().count(b"\n")
    assert 1 <= kept < len(ids), f"the kill came after {kept} of {len(ids)} lines: nothing to resume"
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
        with open(out, "a") as f:  # as a kill in the middle of a write leaves it
            f.write('{"id": "q9", "token_ids": [1')
    else:  # unwound: one error line, a note of what is kept, and no offload files
        assert proc.returncode == 128 + sig
        assert err.strip().splitlines()[-1] == "error: stopped by SIGTERM; offload files removed"
        assert f"note: {kept} of {len(ids)} prompts are in {out}; the same command finishes the rest" in err
        assert not list(off.glob("run-*"))

    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    if sig == signal.SIGKILL:
        assert "partly written last line" in r.stderr and "runs that died" in r.stderr
    rows = _lines(out)
    assert sorted(x["id"] for x in rows) == sorted(ids)  # every id exactly once
    assert all(x == reference[x["id"]] for x in rows)  # the tokens of the uninterrupted run
    assert next(x for x in rows if x["id"] == "q3")["finish_reason"] == "length" and \
        len(reference["q3"]["token_ids"]) == 3
    assert not list(off.glob("run-*"))


BAD_LINES = [
    ('{"id": "c", "prompt_ids": [1, 2', "line 3: not valid JSON"),
    ('{"id": "a", "prompt_ids": [1, 2]}', "line 3: duplicate id 'a' (first on line 1)"),
    ('{"prompt_ids": [1, 2]}', 'line 3: no "id"'),
    ('{"id": "c", "prompt_ids": [1, 999]}', 'line 3: "prompt_ids" must be a non-empty list of token ids in [0, 300)'),
    ('{"id": "c", "prompt": "hello"}', "line 3: this model has no tokenizer"),
    ('{"id": "c", "promt": "hello"}', "line 3: unknown keys promt"),
    ('{"id": "c", "prompt_ids": [1], "max_new_tokens": 0}', 'line 3: "max_new_tokens" must be an integer >= 1'),
    ('[1, 2]', "line 3: expected an object"),
]


@pytest.mark.parametrize("bad, fragment", BAD_LINES, ids=[f for _, f in BAD_LINES])
def test_a_bad_input_line_is_one_error_naming_it(tiny_opt_dir, tmp_path, capsys, bad, fragment):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"id": "a", "prompt_ids": [5, 6]}\n\n' + bad + '\n{"id": "d", "prompt_ids": [7]}\n')
    assert main(["batch", *_argv(tiny_opt_dir, inp, out, tmp_path / "off")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --input {inp} {fragment}") and "\n" not in err, err
    assert not out.exists()  # refused before any work


def test_skip_bad_leaves_bad_lines_out(tiny_opt_dir, tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"id": "a", "prompt_ids": [5, 6]}\n{"id": "b", "prompt_ids": [1\n'
                   '{"id": "a", "prompt_ids": [8]}\n{"id": 4, "prompt_ids": [7], "max_new_tokens": 2}\n')
    assert main(["batch", *_argv(tiny_opt_dir, inp, out, tmp_path / "off", "--skip-bad", "--verbose", "0")]) == 0
    err = capsys.readouterr().err
    assert "note: skipped --input" in err and "line 2: not valid JSON" in err and "line 3: duplicate id 'a'" in err
    rows = {r["id"]: r for r in _lines(out)}
    assert set(rows) == {"a", 4} and len(rows["a"]["token_ids"]) == 8 and len(rows[4]["token_ids"]) == 2


def test_an_output_of_another_job_is_refused(tiny_opt_dir, tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"id": "a", "prompt_ids": [5, 6]}\n')
    out.write_text('{"id": "zz", "token_ids": [1], "text": null, "finish_reason": "length"}\n')
    assert main(["batch", *_argv(tiny_opt_dir, inp, out, tmp_path / "off")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: --output {out} line 1 has id 'zz', which is not in --input (the file is left as it is): give another --output, "
                   "or remove the file to start over")


def test_run_flags_that_a_batch_replaces_are_refused(tiny_opt_dir, tmp_path, capsys):
    argv = _argv(tiny_opt_dir, tmp_path / "in.jsonl", tmp_path / "o.jsonl", tmp_path / "off", "--prompt", "hi")
    assert main(["batch", *argv]) == 2
    assert "--prompt is a `run` flag" in capsys.readouterr().err
