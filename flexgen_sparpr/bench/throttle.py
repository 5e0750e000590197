"""Disk reads throttled by the kernel, for the I/O-bound benchmarks: a cgroup (v1 blkio) whose
`blkio.throttle.read_bps_device` caps the reads of its member processes from the disk behind a
folder (the offload folder). Nothing here sleeps: the kernel holds each read until the group's
budget allows it, so O_DIRECT reads, page-cache misses and memory-mapped reads alike are paced.

    with ReadThrottle(50, "/tmp/offload") as th:   # 50 MB/s (1 MB = 10**6 bytes)
        th.attach(os.getpid())                     # this process and the children it starts next
        ...                                        # close() moves the members out and removes the group

`open_throttle` says why it cannot (not root, no blkio hierarchy, a folder on no block device)
instead of raising; the benchmarks then run unthrottled with that note. Groups are named
`flexgen-sparpr-<pid>-<n>`; one left by a process that was killed (SIGKILL) is removed by the next
`ReadThrottle` when it is empty. `python -m flexgen_sparpr.bench.throttle --read-mbps N --dir D --
CMD...` (scripts/throttle.sh) runs a command under it.
"""
from __future__ import annotations

import argparse
import itertools
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

BLKIO_ROOT = Path("/sys/fs/cgroup/blkio")
PREFIX = "flexgen-sparpr-"
_NAME = re.compile(rf"^{PREFIX}(\d+)-\d+$")
_count = itertools.count()


class ThrottleUnavailable(RuntimeError):
    """Reads cannot be throttled here; the message says why in one line."""


def block_device(path: str | Path, sys_block: Path = Path("/sys/dev/block")) -> tuple[int, int]:
    """(major, minor) of the whole disk behind the filesystem holding path (a partition maps to
    its disk: the throttle takes whole disks)."""
    st = os.stat(Path(path).expanduser())
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    node = sys_block / f"{major}:{minor}"
    if not node.exists():
        raise ThrottleUnavailable(f"{path} is on device {major}:{minor}, which is not a block device "
                                  "(tmpfs, overlay or a network filesystem); use a folder on a disk")
    if (node / "partition").exists():
        major, minor = (int(x) for x in (node.resolve().parent / "dev").read_text().split(":"))
    return major, minor


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(root: Path = BLKIO_ROOT) -> list[str]:
    """Remove empty groups of ours whose creator is gone (a run killed before its clean-up)."""
    gone = []
    for d in root.glob(f"{PREFIX}*") if root.is_dir() else ():
        m = _NAME.match(d.name)
        if m and not _alive(int(m.group(1))) and not (d / "cgroup.procs").read_text().split():
            try:
                d.rmdir()
                gone.append(d.name)
            except OSError:
                pass
    return gone


class ReadThrottle:
    """A blkio group capping reads from the disk behind `folder` at `read_mbps` MB/s."""

    def __init__(self, read_mbps: float, folder: str | Path, root: Path = BLKIO_ROOT):
        if not read_mbps > 0:
            raise ValueError(f"the read throttle must be > 0 MB/s (got {read_mbps})")
        self.root, self.folder = Path(root), Path(folder)
        self.device = block_device(self.folder)
        self.dir: Path | None = None
        self.read_mbps = read_mbps
        self.stale_removed: list[str] = []

    def open(self) -> "ReadThrottle":
        if os.geteuid() != 0:
            raise ThrottleUnavailable("throttling disk reads needs root (a cgroup is created)")
        if not (self.root / "cgroup.procs").exists():
            raise ThrottleUnavailable(f"no cgroup v1 blkio hierarchy at {self.root}")
        self.stale_removed = remove_stale(self.root)
        self.dir = self.root / f"{PREFIX}{os.getpid()}-{next(_count)}"
        self.dir.mkdir()
        try:
            self.set(self.read_mbps)
        except BaseException:
            self.close()
            raise
        return self

    def set(self, read_mbps: float) -> None:
        """Change the cap (the members stay)."""
        if not read_mbps > 0:
            raise ValueError(f"the read throttle must be > 0 MB/s (got {read_mbps})")
        major, minor = self.device
        (self.dir / "blkio.throttle.read_bps_device").write_text(f"{major}:{minor} {int(read_mbps * 1e6)}\n")
        self.read_mbps = read_mbps

    def attach(self, pid: int) -> None:
        """Move process pid (all its threads) into the group; children it starts later follow."""
        (self.dir / "cgroup.procs").write_text(f"{pid}\n")

    def read_bytes(self) -> int:
        """Bytes the members read from the throttled disk so far (the kernel's count)."""
        major, minor = self.device
        total = 0
        for line in (self.dir / "blkio.throttle.io_service_bytes").read_text().splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == f"{major}:{minor}" and parts[1] == "Read":
                total += int(parts[2])
        return total

    def members(self) -> list[int]:
        return [int(p) for p in (self.dir / "cgroup.procs").read_text().split()] if self.dir else []

    def close(self) -> None:
        """Move every member back to the root group and remove the group; safe to call twice."""
        if self.dir is None or not self.dir.exists():
            self.dir = None
            return
        for pid in self.members():
            try:
                (self.root / "cgroup.procs").write_text(f"{pid}\n")
            except ProcessLookupError:
                pass
        self.dir.rmdir()
        self.dir = None

    def describe(self) -> dict:
        major, minor = self.device
        return {"read_mbps": self.read_mbps, "device": f"{major}:{minor}", "cgroup": str(self.dir),
                "mechanism": "cgroup v1 blkio.throttle.read_bps_device"}

    def __enter__(self) -> "ReadThrottle":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()


def open_throttle(read_mbps: float | None, folder: str | Path,
                  root: Path = BLKIO_ROOT) -> tuple[ReadThrottle | None, str | None]:
    """(an open throttle, None), or (None, a note saying why reads run unthrottled): no cap
    asked for, not root, no blkio hierarchy, or a folder on no block device."""
    if read_mbps is None:
        return None, None
    try:
        return ReadThrottle(read_mbps, folder, root).open(), None
    except ThrottleUnavailable as e:
        return None, f"reads NOT throttled: {e}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="throttle", description="Run a command with its disk reads capped by "
                                 "the kernel (cgroup v1 blkio); unthrottled, with a note, where that is impossible.")
    ap.add_argument("--read-mbps", type=float, required=True, help="read cap in MB/s (10**6 bytes/s)")
    ap.add_argument("--dir", required=True, help="a folder on the disk whose reads are capped (the offload folder)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.exit(2, "throttle: error: no command given (throttle --read-mbps N --dir D -- CMD ...)\n")
    if not args.read_mbps > 0:
        ap.exit(2, f"throttle: error: --read-mbps must be > 0 (got {args.read_mbps})\n")
    if not Path(args.dir).expanduser().is_dir():
        ap.exit(2, f"throttle: error: --dir {args.dir} is not a folder\n")
    th, note = open_throttle(args.read_mbps, args.dir)
    print(f"note: {note}" if note else f"note: reads from {th.describe()['device']} capped at "
          f"{args.read_mbps:g} MB/s ({th.dir.name})", file=sys.stderr, flush=True)
    stops = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}

    def child_setup(mask):  # in the child: join the group, then take stop signals again
        if th is not None:
            th.attach(os.getpid())
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    try:
        # a stop signal held while the child starts: one landing inside Popen would leave the child
        # running, unknown to us, inside the group we are about to remove
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, stops)
        try:
            proc = subprocess.Popen(cmd, preexec_fn=lambda: child_setup(mask))
        except BaseException:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            raise
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a held signal lands here, proc known
            return proc.wait()
        except BaseException:  # a stop signal: pass it on, then clean up
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    finally:
        if th is not None:
            th.close()


if __name__ == "__main__":
    from ..utils.guard import guarded
    sys.exit(guarded(main))
