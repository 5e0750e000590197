"""Faults a run can meet, each ending in one line with nothing left behind: a stop signal mid-run
(SIGTERM, SIGHUP, SIGINT), SIGKILL and the next run's clean-up, two runs sharing an offload folder, a
full or size-limited disk, an output that cannot be written at the end (the results survive),
and a placement too large for the machine (refused before any weight is read)."""
from __future__ import annotations

import errno
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flexgen_sparpr.cli.main import main

TINY = ["--prompt-len", "8", "--gen-len", "4", "--gpu-batch-size", "1", "--verbose", "0", "--warmup", "false",
        "--no-log"]
DISK_KV = ["--percent", "100", "0", "0", "0", "100", "0"]  # the KV cache on the disk tier
# a long run: OPT-125m with dummy weights decoding 3000 tokens, its cache on disk
LONG = [sys.executable, "-m", "flexgen_sparpr", "run", "--model", "opt-125m", "--path", "_DUMMY_", "--prompt-len", "8",
        "--gen-len", "3000", "--gpu-batch-size", "1", "--verbose", "0", "--warmup", "false", "--no-log", *DISK_KV]


def _start_long(off: Path, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([*LONG, "--offload-dir", str(off)], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_generating(proc: subprocess.Popen, off: Path, timeout: float = 120) -> Path:
    """The run folder of `proc`, once its KV files exist (the prefill has begun)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        for d in off.glob(f"run-{proc.pid}-*"):
            if list(d.glob("kv-*")):
                return d
        if proc.poll() is not None:
            pytest.fail(f"the long run ended early: {proc.returncode} {proc.stderr.read()[-2000:]}")
        time.sleep(0.05)
    proc.kill()
    pytest.fail("the long run never started generating")


def _run_here(llama: str, off: Path, capsys) -> tuple[int, str]:
    code = main(["run", "--model", llama, *TINY, *DISK_KV, "--offload-dir", str(off)])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=["SIGTERM", "SIGHUP", "SIGINT"])
def test_a_stop_signal_cleans_up_with_one_line_while_a_neighbour_runs(sig, tmp_path, tiny_llama_dir, capsys):
    off = tmp_path / "off"
    proc = _start_long(off, tmp_path)
    run_dir = _wait_generating(proc, off)
    if sig == signal.SIGTERM:  # two runs sharing the folder: the second leaves the live one's folder alone
        code, err = _run_here(str(tiny_llama_dir), off, capsys)
        assert code == 0 and "removed" not in err, err
        assert run_dir.is_dir()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err[-2000:]
    assert err.strip() == f"error: stopped by {sig.name}; offload files removed"
    assert not list(off.glob("run-*")), "the stopped run left its offload folder"


def test_sigkill_leaves_a_folder_the_next_run_removes(tmp_path, tiny_llama_dir, capsys):
    off = tmp_path / "off"
    proc = _start_long(off, tmp_path)
    run_dir = _wait_generating(proc, off)
    proc.kill()
    proc.wait(timeout=60)
    assert run_dir.is_dir() and json.loads((run_dir / "owner.json").read_text())["pid"] == proc.pid
    code, err = _run_here(str(tiny_llama_dir), off, capsys)
    assert code == 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"note: removed 1 offload folder(s) left in {off} by runs that "
                                                   f"died (pid {proc.pid}; "), err
    assert not list(off.glob("run-*"))


def _tmpfs(path: Path, size: str) -> bool:
    if os.geteuid() != 0:
        return False
    path.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root (the RLIMIT_FSIZE test runs anyway)")
def test_a_full_disk_is_refused_up_front_and_enospc_is_one_line(tmp_path, monkeypatch, capsys):
    disk = tmp_path / "small"
    if not _tmpfs(disk, "2m"):
        pytest.skip("this root cannot mount tmpfs (a container without CAP_SYS_ADMIN)")
    try:
        argv = ["run", "--model", "opt-125m", "--path", "_DUMMY_", *TINY, "--percent", "0", "0", "100", "0", "100", "0",
                "--offload-dir", str(disk / "off")]
        assert main(argv) == 2  # the weights' disk share is predicted, and cannot fit 2 MB
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "does not fit: disk in" in err, err
        monkeypatch.setenv("FLEXGEN_SPARPR_NO_MEMORY_CHECK", "1")  # past the check, the disk really fills
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith(f"error: disk full writing {disk / 'off'}/run-"), err
        assert not disk.joinpath("off").exists() or not list(disk.joinpath("off").iterdir())
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def _limit_file_size():
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead


def test_a_file_size_limit_is_one_line(tmp_path):
    off = tmp_path / "off"
    argv = [sys.executable, "-m", "flexgen_sparpr", "run", "--model", "opt-125m", "--path", "_DUMMY_", *TINY,
            "--percent", "0", "0", "100", "0", "100", "0", "--offload-dir", str(off)]
    r = subprocess.run(argv, capture_output=True, text=True, preexec_fn=_limit_file_size, cwd=tmp_path,
                       env=dict(os.environ, FLEXGEN_SPARPR_NO_MEMORY_CHECK="1"), timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: file too large: {off}/run-"), r.stderr
    assert not off.exists() or not list(off.iterdir())


def test_results_survive_an_output_that_fails_at_the_end(tmp_path, tiny_llama_dir, monkeypatch, capsys):
    import flexgen_sparpr.cli.outputs as outputs
    real = outputs.write_json_atomic
    target = tmp_path / "out" / "results.json"

    def fail_there(path, data):  # the output's disk fills during the run; the fallback still writes
        if Path(path) == target:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)
    monkeypatch.setattr(outputs, "write_json_atomic", fail_there)
    monkeypatch.setattr(outputs.tempfile, "tempdir", str(tmp_path))
    argv = ["run", "--model", str(tiny_llama_dir), *TINY, "--offload-dir", str(tmp_path / "off"),
            "--output-json", str(target)]
    assert main(argv) == 2
    cap = capsys.readouterr()
    err = cap.err.strip()
    fallback = Path(err.split(" and ")[-1])
    assert err.startswith(f"error: cannot write --output-json {target} (No space left on device); the results are "
                          "on stdout and ") and "\n" not in err
    shown = json.loads(cap.out.strip().splitlines()[-1])
    saved = json.loads(fallback.read_text())
    assert shown["output_ids"] == saved["output_ids"] and len(saved["output_ids"][0]) == 4
    assert saved["timings"]["decode_s"] > 0 and not target.exists()


def test_output_path_is_checked_before_any_work(tmp_path, tiny_llama_dir, monkeypatch, capsys):
    """A folder where the output should go is refused before a weight is read."""
    from flexgen_sparpr.weights import sources
    monkeypatch.setattr(sources.HFDirSource, "get", lambda *a: pytest.fail("a weight was read"))
    (tmp_path / "out.json").mkdir()
    assert main(["run", "--model", str(tiny_llama_dir), *TINY, "--output-json", str(tmp_path / "out.json")]) == 2
    assert "is a folder" in capsys.readouterr().err


def test_a_placement_over_capacity_is_refused_before_any_weight_is_read(tmp_path, monkeypatch, capsys):
    """OPT-175B all on the compute tier (350 GB even in float16): refused with the numbers, and no
    weight made; scripts/bench_refusal.py times such a refusal (results/refusal/)."""
    from flexgen_sparpr.weights import sources
    monkeypatch.setattr(sources.DummySource, "get", lambda *a: pytest.fail("a weight was made"))
    argv = ["run", "--model", "opt-175b", "--path", "_DUMMY_", "--percent", "100", "0", "100", "0", "100", "0",
            "--no-log", "--offload-dir", str(tmp_path / "off")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: --percent 100 0 100 0 100 0 does not fit: ") and "GiB" in err
    assert list(tmp_path.iterdir()) == []
