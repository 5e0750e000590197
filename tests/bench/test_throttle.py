"""The read throttle: a blkio cgroup made, joined, removed (also on a stop signal and after a
killed run), and the paths where it cannot be made (not root, no blkio, no block device)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flexgen_sparpr.bench import throttle as th
from flexgen_sparpr.bench.throttle import ReadThrottle, ThrottleUnavailable, block_device, open_throttle

REAL = os.geteuid() == 0 and (th.BLKIO_ROOT / "cgroup.procs").exists()
needs_blkio = pytest.mark.skipif(not REAL, reason="needs root and a cgroup v1 blkio hierarchy at "
                                 f"{th.BLKIO_ROOT} (the kernel's read throttle)")
READ = ("import os, sys, time, mmap\n"
        "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECT)\n"
        "buf = mmap.mmap(-1, 1 << 20)\n"
        "t0 = time.perf_counter()\n"
        "for i in range(int(sys.argv[2])):\n"
        "    os.preadv(fd, [buf], i << 20)\n"
        "print(time.perf_counter() - t0)\n")


@pytest.fixture
def disk_dir():
    """A folder on a real disk (/var/tmp), with an 8 MiB file written past the page cache."""
    d = Path("/var/tmp") / f"fgsp-throttle-{os.getpid()}"
    d.mkdir(exist_ok=True)
    f = d / "data"
    f.write_bytes(os.urandom(8 << 20))
    yield d
    f.unlink()
    d.rmdir()


def ours() -> list[str]:
    return sorted(p.name for p in th.BLKIO_ROOT.glob(f"{th.PREFIX}{os.getpid()}-*"))


def timed_read(path: Path, mib: int, preexec=None) -> float:
    out = subprocess.run([sys.executable, "-c", READ, str(path), str(mib)], capture_output=True, text=True,
                         check=True, preexec_fn=preexec)
    return float(out.stdout)


@needs_blkio
def test_a_child_in_the_group_reads_at_the_cap_and_the_group_goes_away(disk_dir):
    try:
        block_device(disk_dir)
    except ThrottleUnavailable as e:
        pytest.skip(str(e))
    with ReadThrottle(16, disk_dir) as t:  # 16 MB/s: 8 MiB take ~0.52 s
        assert t.dir.is_dir() and ours() == [t.dir.name]
        assert (t.dir / "blkio.throttle.read_bps_device").read_text().split()[1] == "16000000"
        slow = timed_read(disk_dir / "data", 8, preexec=lambda: t.attach(os.getpid()))
        t.set(1000)
        fast = timed_read(disk_dir / "data", 8, preexec=lambda: t.attach(os.getpid()))
    assert ours() == []
    assert slow > 0.35 and fast < slow / 3


@needs_blkio
def test_close_moves_members_out_and_a_dead_runs_group_is_removed(disk_dir):
    t = ReadThrottle(100, disk_dir).open()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                             preexec_fn=lambda: t.attach(os.getpid()))
    try:
        assert t.members() == [child.pid]
        t.close()
        t.close()  # twice is fine
        assert ours() == []
    finally:
        child.kill()
        child.wait()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    (th.BLKIO_ROOT / f"{th.PREFIX}{dead}-0").mkdir()  # left by a run that was killed
    with ReadThrottle(100, disk_dir) as t2:
        assert f"{th.PREFIX}{dead}-0" in t2.stale_removed
    assert not (th.BLKIO_ROOT / f"{th.PREFIX}{dead}-0").exists()


@needs_blkio
def test_the_command_runner_removes_its_group_on_a_stop_signal(disk_dir):
    p = subprocess.Popen([sys.executable, "-m", "flexgen_sparpr.bench.throttle", "--read-mbps", "50", "--dir",
                          str(disk_dir), "--", sys.executable, "-c", "import time; time.sleep(30)"],
                         stderr=subprocess.PIPE, text=True)
    mine = f"{th.PREFIX}{p.pid}-"
    for _ in range(100):
        if any(d.name.startswith(mine) for d in th.BLKIO_ROOT.iterdir()):
            break
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    assert p.wait(20) == 128 + signal.SIGTERM
    assert not any(d.name.startswith(mine) for d in th.BLKIO_ROOT.iterdir())
    assert "capped at 50 MB/s" in p.stderr.read()


def test_not_root_runs_unthrottled_with_a_note(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(th, "block_device", lambda path: (254, 0))
    t, note = open_throttle(50, tmp_path)
    assert t is None and note == "reads NOT throttled: throttling disk reads needs root (a cgroup is created)"
    assert open_throttle(None, tmp_path) == (None, None)


def test_no_blkio_hierarchy_or_no_block_device_is_a_note(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(th, "block_device", lambda path: (254, 0))
    _, note = open_throttle(50, tmp_path, root=tmp_path / "nowhere")
    assert "no cgroup v1 blkio hierarchy" in note
    with pytest.raises(ThrottleUnavailable, match="not a block device"):
        block_device(tmp_path, sys_block=tmp_path / "no-sys")


def test_a_partition_maps_to_its_disk(tmp_path):
    st = os.stat(tmp_path)
    disk = tmp_path / "devices" / "vda"
    part = disk / "vda1"
    part.mkdir(parents=True)
    (disk / "dev").write_text("254:0\n")
    (part / "partition").write_text("1\n")
    (tmp_path / "block").mkdir()
    (tmp_path / "block" / f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}").symlink_to(part)
    assert block_device(tmp_path, sys_block=tmp_path / "block") == (254, 0)


def test_bad_values_and_commands(tmp_path):
    with pytest.raises(ValueError, match="> 0 MB/s"):
        ReadThrottle(0, tmp_path)
    r = subprocess.run([sys.executable, "-m", "flexgen_sparpr.bench.throttle", "--read-mbps", "5", "--dir",
                        str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 2 and "no command given" in r.stderr
