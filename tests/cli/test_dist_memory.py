"""Ranks of one run on one host share its memory and disk: each counts its 1/LOCAL_WORLD_SIZE share
(runtime/capacity.py live_capacity), so two ranks that fit alone but not together are refused,
and every rank stops before loading when any rank is refused (cli/peers.py Peers.ready)."""
from __future__ import annotations

import datetime
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from flexgen_sparpr.config import preflight
from flexgen_sparpr.cli.parser import build_parser
from flexgen_sparpr.config.options import resolve
from flexgen_sparpr.cli.peers import Peers
from flexgen_sparpr.errors import CapacityError, ConfigError
from flexgen_sparpr.runtime import capacity
from flexgen_sparpr.runtime.hardware import GiB
from flexgen_sparpr.runtime.stages import stage_spec
from flexgen_sparpr.models.spec import opt_spec
from tests.dist_harness import save_tiny

HOST = 23.0 * GiB  # this project's VM: 22.7 GiB free with nothing running


@pytest.fixture
def host_of(monkeypatch):
    """A host with HOST bytes of memory free and 70 GiB of disk; returns a setter of LOCAL_WORLD_SIZE."""
    monkeypatch.setattr(capacity, "host_available", lambda: HOST)
    monkeypatch.setattr(capacity.shutil, "disk_usage", lambda p: SimpleNamespace(free=70 * GiB))
    monkeypatch.delenv(capacity.SKIP_ENV, raising=False)

    def ranks(n):
        if n is None:
            monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("LOCAL_WORLD_SIZE", str(n))
    return ranks


def test_each_local_rank_counts_its_share(host_of, tmp_path):
    for n, share in ((None, 1), ("1", 1), ("2", 2), ("4", 4), ("x", 1), ("0", 1)):
        host_of(n)
        cap = capacity.live_capacity(torch.device("cpu"), tmp_path)
        assert cap.ranks == share
        assert cap.cpu_memory == cap.compute_memory == pytest.approx(HOST / share)
        assert cap.disk_free == pytest.approx(70 * GiB / share)


def test_two_ranks_that_fit_alone_are_refused_together(host_of, tmp_path):
    """The README's OPT-6.7B pipeline with every weight in host memory: half the layers (13 GB of
    float32) fit a 23 GB host alone, not twice."""
    opts, pol, eng = resolve(build_parser().parse_args([
        "--model", "facebook/opt-6.7b", "--path", "_DUMMY_", "--device", "cpu", "--offload-dir", str(tmp_path),
        "--gpu-batch-size", "4", "--num-gpu-batches", "4", "--percent", "50", "50", "0", "100", "100", "0"]))
    held = stage_spec(opt_spec("opt-6.7b"), 16)  # one rank's stage: 16 of 32 layers
    host_of(None)
    preflight.check_capacity(opts, pol, eng, held, opts.prompt_len)  # alone: fits
    host_of(2)
    with pytest.raises(CapacityError, match=r"1/2 share: 2 processes on this host\) would need") as e:
        preflight.check_capacity(opts, pol, eng, held, opts.prompt_len)
    assert "\n" not in str(e.value)


@pytest.fixture
def store():
    import torch.distributed as dist
    return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=5))


def test_a_rank_refused_stops_the_others_before_loading(store):
    Peers(store, 1, 2, 5.0, "rank 0").ready("--percent 50 50 0 100 100 0 does not fit: ...")
    with pytest.raises(ConfigError, match=r"rank 1 cannot run \(--percent 50 50 .* no rank loaded anything"):
        Peers(store, 0, 2, 5.0, "rank 0").ready(None)


def test_ranks_that_all_pass_go_on(store):
    import threading

    import torch.distributed as dist
    other_store = dist.TCPStore("127.0.0.1", store.port, 1, is_master=False, timeout=datetime.timedelta(seconds=5))
    failures = []

    def rank1():
        try:
            Peers(other_store, 1, 2, 5.0, "rank 0").ready(None)
        except BaseException as e:  # noqa: BLE001  (reported below)
            failures.append(e)
    other = threading.Thread(target=rank1)
    other.start()  # waits for rank 0's word
    Peers(store, 0, 2, 5.0, "rank 0").ready(None)
    other.join(10)
    assert not other.is_alive() and not failures


def test_every_rank_refuses_in_one_line(tmp_path):
    """Two real ranks told they share their host with a million others: each refuses in one line,
    exit 2, and nothing is written to the offload folder."""
    model = save_tiny("opt", tmp_path / "tiny")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1",
           "LOCAL_WORLD_SIZE": "1000000"}
    env.pop(capacity.SKIP_ENV, None)
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    off = tmp_path / "off"
    procs = [subprocess.Popen([sys.executable, "-m", "flexgen_sparpr.dist_flex_opt", "--model", str(model),
                               "--prompt-len", "8", "--gen-len", "3", "--gpu-batch-size", "2", "--num-gpu-batches",
                               "2", "--percent", "100", "0", "100", "0", "100", "0", "--offload-dir", str(off),
                               "--no-log", "--dist-timeout", "30", "--head-ip", "127.0.0.1", "--port", str(port),
                               "--world-size", "2", "--rank", str(r)],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    for rank, p in enumerate(procs):
        try:
            _, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a rank did not exit")
        lines = err.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1, err
        assert lines[0].startswith(f"error: rank {rank}: ") and "1000000 processes on this host" in lines[0]
    assert not off.exists() or not list(off.glob("*"))
