"""The disk kept busy beside a benchmark: another process reads a scratch file with O_DIRECT, 4 MiB
at a time, from end to end and again, until the benchmark is done (scripts/bench_step.py's
"resident-busy" cells: the KV resident, the disk read at full speed meanwhile).

Why: on a VM the host's work for a guest's disk reads is not free for the guest's cores. A dense
step with its KV on disk cannot be faster than the resident step run while the disk reads at the
same time, and how much slower that is (this machine's, not the engine's) is what this measures.

Run as `python -m flexgen_sparpr.bench.busy_disk FILE` it reads FILE until SIGTERM, then prints
"<bytes> <seconds>" and exits 0. Only the standard library: the child starts in a moment.
"""
from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

CHUNK = 4 << 20  # bytes a read (as `dd bs=4M` and the bandwidth probe)


def write_scratch(path: Path, nbytes: int) -> None:
    """`nbytes` (whole MiB) of random bytes at `path`, on the disk (fsync'd): a file for a read
    benchmark that no page cache or compressing device shortcuts."""
    with open(path, "wb") as f:
        for _ in range(nbytes >> 20):
            f.write(os.urandom(1 << 20))
        f.flush()
        os.fsync(f.fileno())


class BusyDisk:
    """with BusyDisk(folder) as busy: ... -- a reader process runs through the block; afterwards
    busy.read_Bps is the rate it read at (None: O_DIRECT or the reader was not there, nothing ran).
    The scratch file (`nbytes` of random bytes) is written at entry and removed at exit."""

    def __init__(self, folder: Path, nbytes: int = 256 << 20):
        self.path = Path(folder) / f"busy-{os.getpid()}.bin"
        self.nbytes = nbytes // CHUNK * CHUNK
        self.proc: subprocess.Popen | None = None
        self.read_Bps: float | None = None

    def __enter__(self) -> "BusyDisk":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            write_scratch(self.path, self.nbytes)
            self.proc = subprocess.Popen([sys.executable, "-m", __name__, str(self.path)],
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            time.sleep(0.5)  # the reader under way before the benchmark's first step
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self.proc is not None:
                if self.proc.poll() is None:
                    self.proc.send_signal(signal.SIGTERM)
                try:
                    out, _ = self.proc.communicate(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    out, _ = self.proc.communicate()
                said = out.split() if self.proc.returncode == 0 and out else []
                if len(said) == 2 and float(said[1]) > 0 and int(said[0]) > 0:
                    self.read_Bps = int(said[0]) / float(said[1])
        finally:
            self.path.unlink(missing_ok=True)


def read_until_stopped(path: str) -> int:
    """Read `path` with O_DIRECT in CHUNK reads, over and over, until SIGTERM; print bytes and
    seconds. Exit 2 where the file or O_DIRECT is refused (nothing printed)."""
    stopped = False

    def stop(*_):
        nonlocal stopped
        stopped = True

    signal.signal(signal.SIGTERM, stop)
    if not hasattr(os, "O_DIRECT"):
        return 2
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return 2
    buf = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT wants
    total, off, start = 0, 0, time.perf_counter()
    try:
        while not stopped:
            try:
                n = os.preadv(fd, [buf], off)
            except InterruptedError:
                continue
            except OSError:
                return 2
            total += n
            off = off + n if n == CHUNK else 0
    finally:
        os.close(fd)
    print(total, time.perf_counter() - start, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(read_until_stopped(sys.argv[1]))
