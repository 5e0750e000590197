"""`python -m flexgen_sparpr.dist_flex_opt` as users launch it: under torchrun (rank 0 reports, the
others write nothing), with upstream's --head-ip/--port/--rank flags, and its failures: a rank killed
mid-decode (the others exit non-zero within the timeout, naming it, nothing left on disk), more
stages than layers, ranks launched with different flags (one line each, exit 2). The launch flags
and the peers' bookkeeping are checked in-process too."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flexgen_sparpr.cli.launch import Launch, label, launch_from
from flexgen_sparpr.cli.main import main as cli_main
from flexgen_sparpr.cli.peers import Peers
from flexgen_sparpr.engine.pipeline import LinkFailed
from flexgen_sparpr.errors import ConfigError, PeerFailed
from tests.dist_harness import save_tiny

RUN = ["--prompt-len", "8", "--gen-len", "5", "--gpu-batch-size", "2", "--num-gpu-batches", "2", "--block-size", "4",
       "--percent", "100", "0", "0", "0", "100", "0"]  # every KV block on disk
DIST = [sys.executable, "-m", "flexgen_sparpr.dist_flex_opt"]


@pytest.fixture(scope="module")
def opt4(tmp_path_factory):
    return save_tiny("opt", tmp_path_factory.mktemp("tiny4-opt"))


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(world: int, args: list[str], cwd: Path, per_rank=None, only=None) -> list[subprocess.Popen]:
    """The ranks of a world (or only those listed) launched with upstream's flags on 127.0.0.1;
    per_rank(r) adds flags to rank r."""
    port = _free_port()
    return [subprocess.Popen([*DIST, *args, *(per_rank(r) if per_rank else []), "--head-ip", "127.0.0.1",
                              "--port", str(port), "--world-size", str(world), "--rank", str(r)],
                             cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r in (range(world) if only is None else only)]


def _finish(procs, timeout: float = 120) -> list[tuple[int, str, str]]:
    out = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a rank did not exit")
        out.append((p.returncode, so, se))
    return out


def _one_error_line(err: str, rank: int) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: rank {rank}: "), err
    return lines[0]


# --- a run under torchrun equals the single-process run -------------------------------------
def test_torchrun_two_stages_equal_one_process(opt4, tmp_path):
    off, here = tmp_path / "off", tmp_path / "cwd"
    here.mkdir()
    args = ["--model", str(opt4), *RUN, "--offload-dir", str(off), "--verbose", "1"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run
    try:
        assert cli_main(["run", *args, "--no-log", "--output-json", str(tmp_path / "single.json")]) == 0
    finally:
        torch.set_num_threads(threads)
    single = json.loads((tmp_path / "single.json").read_text())
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "flexgen_sparpr.dist_flex_opt", *args, "--output-json", "out.json"],
                       cwd=here, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads((here / "out.json").read_text())
    assert out["output_ids"] == single["output_ids"]
    # rank 0 alone wrote: the JSON and FlexGen's log; the summary printed once
    written = sorted(p.name for p in here.iterdir())
    assert len(written) == 2 and written[0].startswith("fo-") and written[0].endswith(
        "-gbs2-ngbs2-prompt8-gen5-percent-100-0-0-0-100-0-gpu-cache.log") and written[1] == "out.json", written
    assert r.stdout.count("total throughput") == 1
    pipe = out["pipeline"]
    assert (pipe["world_size"], pipe["backend"], pipe["micro_batches"], pipe["stage_layers"]) == (2, "gloo", 2, [2, 2])
    s0, s1 = pipe["stages"]
    hidden = 64 * 4 * 4 * (8 + 5 - 1)  # hidden x float32 x 4 sequences x tokens crossing
    assert s0["link"] == {"stage0->stage1": hidden} and s1["link"] == {}
    assert s0["timings"]["bytes_sent"] == s1["timings"]["bytes_received"] == hidden
    assert s0["timings"]["steps"] == s1["timings"]["steps"] == 5
    for s in (s0, s1):
        assert 0 < s["timings"]["busy_fraction"] <= 1
        assert s["peak_memory"]["host_rss_peak_bytes"] > 0
        assert s["bytes_moved"].get("cpu->disk", 0) > 0  # each stage stored its own KV blocks on disk
    assert out["bytes_moved"]["cpu->disk"] == s0["bytes_moved"]["cpu->disk"] + s1["bytes_moved"]["cpu->disk"]
    assert not list(off.glob("*"))


# --- failures ---------------------------------------------------------------------------------
def test_a_rank_killed_mid_decode_stops_the_others_naming_it(opt4, tmp_path):
    """Three stages over upstream's flags; rank 1 is SIGKILLed while decoding: ranks 0 and 2 exit 2
    within the timeout, each with one line naming rank 1, and no offload file is left (rank 1's
    folder is removed by the survivors)."""
    off = tmp_path / "off"
    timeout = 10
    args = ["--model", str(opt4), "--path", "_DUMMY_", "--max-seq-len", "4000", "--prompt-len", "8", "--gen-len",
            "3000", "--gpu-batch-size", "1", "--num-gpu-batches", "2", "--block-size", "4",
            "--percent", "100", "0", "0", "0", "100", "0", "--offload-dir", str(off), "--no-log", "--verbose", "0",
            "--warmup", "false", "--dist-timeout", str(timeout)]
    procs = _ranks(3, args, tmp_path)
    t0 = time.monotonic()
    while len([d for d in off.glob("run-*") if list(d.glob("kv-*"))]) < 3:  # every rank is generating
        if time.monotonic() - t0 > 120 or any(p.poll() is not None for p in procs):
            for p in procs:
                p.kill()
            pytest.fail("the ranks did not start generating: " + " | ".join(p.stderr.read()[-500:] for p in procs))
        time.sleep(0.05)
    time.sleep(0.5)
    procs[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    results = _finish([procs[0], procs[2]], timeout=timeout + 30)
    took = time.monotonic() - killed
    procs[1].wait()
    assert took < timeout + 10, took
    for rank, (code, _, err) in zip((0, 2), results):
        assert code == 2, err
        line = _one_error_line(err, rank)
        assert "rank 1 failed" in line and "offload files removed" in line
    assert not list(off.glob("*"))


def test_more_stages_than_layers_is_one_line_per_rank(tmp_path):
    one_layer = tmp_path / "one-layer"
    from transformers import OPTConfig, OPTForCausalLM
    OPTForCausalLM(OPTConfig(hidden_size=16, num_attention_heads=2, num_hidden_layers=1, ffn_dim=32, vocab_size=50,
                             max_position_embeddings=32, word_embed_proj_dim=16)).save_pretrained(one_layer)
    procs = _ranks(2, ["--model", str(one_layer), *RUN, "--offload-dir", str(tmp_path / "off"), "--no-log",
                       "--dist-timeout", "30"], tmp_path)
    for rank, (code, out, err) in enumerate(_finish(procs)):
        assert code == 2, err
        assert "2 pipeline stages for one-layer's 1 layers" in _one_error_line(err, rank)


def test_ranks_with_different_flags_are_refused(opt4, tmp_path):
    procs = _ranks(2, ["--model", str(opt4), *RUN, "--offload-dir", str(tmp_path / "off"), "--no-log",
                       "--dist-timeout", "30"], tmp_path, per_rank=lambda r: ["--seed", str(r)])
    for rank, (code, out, err) in enumerate(_finish(procs)):
        assert code == 2, err
        assert "rank 1 differs from rank 0 in run.seed (0 vs 1)" in _one_error_line(err, rank)
    assert not list(tmp_path.glob("fo-*"))


# --- the launch flags, in-process -------------------------------------------------------------
def test_launch_from_flags_torchrun_and_mpi():
    assert launch_from({}, env={}) == Launch(0, 1, 0, None, None, 60.0)
    flags = dict(head_ip="10.0.0.1", port=7000, world_size=4, rank=2, local_rank=1, comm_device="cpu", dist_timeout=5)
    assert launch_from(flags, env={}) == Launch(2, 4, 1, "tcp://10.0.0.1:7000", "cpu", 5.0)
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert launch_from({}, env=torchrun) == Launch(1, 2, 1, "env://", None, 60.0)
    mpi = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    assert launch_from(dict(use_mpi=True, head_ip="h", port=9), env=mpi).rank == 3
    assert label(["--rank", "3"], env={}) == "rank 3: " and label([], env={"RANK": "1"}) == "rank 1: "
    assert label([], env={}) == ""


@pytest.mark.parametrize("flags, env, msg", [
    (dict(world_size=2, rank=2, head_ip="h", port=1), {}, "outside the world"),
    (dict(world_size=2, rank=0), {}, "needs --head-ip and --port"),
    (dict(world_size=2), {}, "needs this rank's --rank"),
    (dict(world_size=0), {}, "--world-size must be >= 1"),
    (dict(dist_timeout=0), {}, "--dist-timeout must be > 0"),
    (dict(dist_timeout=float("inf")), {}, "--dist-timeout must be > 0 seconds, at most 604800"),
    (dict(dist_timeout=float("nan")), {}, "--dist-timeout must be > 0 seconds, at most 604800"),
    (dict(use_mpi=True), {}, "OMPI_COMM_WORLD_RANK"),
    (dict(world_size=2, rank=0, head_ip="h", port=70000), {}, "--port must be"),
    (dict(num_inner_iterations=0), {}, "--num-inner-iterations must be >= 1"),
    ({}, {"RANK": "x"}, "not an integer"),
])
def test_bad_launch_is_one_config_error(flags, env, msg):
    with pytest.raises(ConfigError, match=msg):
        launch_from(flags, env=env)


def test_unreachable_head_is_one_line(opt4, tmp_path):
    """A rank whose head never comes: one line after --dist-timeout, exit 2."""
    [p] = _ranks(2, ["--model", str(opt4), *RUN, "--no-log", "--dist-timeout", "2"], tmp_path, only=[1])
    code, _, err = _finish([p])[0]
    assert code == 2 and "could not meet the others" in _one_error_line(err, 1)


# --- the peers' bookkeeping, in-process ---------------------------------------------------------
@pytest.fixture
def peers():
    import datetime

    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=5))
    return Peers(store, 0, 1, 5.0, "rank 0")


def test_the_first_failure_recorded_is_named(peers, tmp_path):
    from flexgen_sparpr.utils.guard import Interrupted
    # a lost link with no record: the peer waited on is named, and recorded
    e = peers.explain(LinkFailed(2, "receive of hidden states", RuntimeError("Connection closed by peer")), None)
    assert isinstance(e, PeerFailed) and "rank 2 failed (it exited or died" in str(e)
    # later losses name the first failure, whichever link they lost
    e = peers.explain(LinkFailed(1, "broadcast of token ids", RuntimeError("Timed out waiting")), None)
    assert "rank 2 failed" in str(e)
    # a signal that interrupted a lost link counts as the lost link
    try:
        try:
            raise LinkFailed(1, "broadcast of token ids", RuntimeError("x"))
        except LinkFailed:
            raise Interrupted(signal.SIGTERM)
    except Interrupted as sig:
        assert "rank 2 failed" in str(peers.explain(sig, None))


def test_an_own_failure_is_recorded_and_kept(peers):
    own = OSError(28, "No space left on device")
    assert peers.explain(own, None) is own
    e = peers.explain(LinkFailed(1, "send of hidden states", RuntimeError("Connection closed by peer")), None)
    assert "rank 0 failed (disk full" in str(e)


def test_options_are_compared(peers):
    peers.check_same_options({"run": {"gen_len": 4, "percent": (1, 2)}})  # tuples compare as JSON lists
    peers.store.set("options/0", json.dumps({"run": {"gen_len": 5}}))  # rank 0 as a second rank sees it
    with pytest.raises(ConfigError, match=r"rank 1 differs from rank 0 in run.gen_len \(5 vs 4\)"):
        Peers(peers.store, 1, 2, 5.0, "rank 0").check_same_options({"run": {"gen_len": 4}})
