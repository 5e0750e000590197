"""Host facts for reports and probes: this process's resident memory, the memory available, the
core count. psutil gives them where it is installed; without it (a GPU box that has only torch)
Linux's /proc does, so a dependency used only for reporting never stops a run."""
from __future__ import annotations

import os
import resource
from pathlib import Path

try:
    import psutil
except ImportError:  # reporting only: /proc below serves instead
    psutil = None

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """This process's resident set size now (0 when nothing can tell)."""
    if psutil is not None:
        return psutil.Process().memory_info().rss
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def lifetime_peak_rss_bytes() -> int:
    """The whole process lifetime's peak RSS: ru_maxrss (KiB on Linux), or the high-water mark a
    reset (reset_rss_high_water) cleared where that was higher."""
    return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, _peak_before_resets)


_peak_before_resets = 0  # the largest high-water mark a reset cleared


def rss_high_water_bytes() -> int | None:
    """The kernel's exact peak of this process's RSS since it started or the last reset (Linux's
    VmHWM: it is raised before any page leaves the resident set, so no peak is missed); None where
    /proc does not tell."""
    return _proc_kib("/proc/self/status", "VmHWM:")


def _proc_kib(path: str, key: str) -> int | None:
    """The bytes of a "key: N kB" line of a /proc file; None where it cannot be read."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def reset_rss_high_water() -> bool:
    """Start the kernel's RSS high-water mark again from the RSS now (/proc/self/clear_refs "5",
    Linux 4.0+), its old value kept for lifetime_peak_rss_bytes; False where it cannot be reset
    (another OS, a read-only /proc)."""
    global _peak_before_resets
    mark = rss_high_water_bytes()
    if mark is None:
        return False
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    _peak_before_resets = max(_peak_before_resets, mark)
    return True


def available_memory_bytes() -> int:
    """Host memory available to new allocations without swapping (MemAvailable)."""
    if psutil is not None:
        return int(psutil.virtual_memory().available)
    got = _proc_kib("/proc/meminfo", "MemAvailable:")
    return got if got is not None else os.sysconf("SC_AVPHYS_PAGES") * _PAGE


def cpu_count() -> int:
    """Logical cores."""
    return (psutil.cpu_count(logical=True) if psutil is not None else None) or os.cpu_count() or 1


def blkio_read_limits(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup/blkio") -> str:
    """The read caps the kernel puts on this process's disk reads: its cgroup v1 blkio group's
    `blkio.throttle.read_bps_device` lines ('MAJ:MIN BYTES', joined by '; '), or '' where there are
    none (the root group, cgroup v2, no blkio hierarchy). A bandwidth measured under a cap is the
    cap's, not the disk's (bench/throttle.py sets them)."""
    try:
        groups = [line.split(":", 2)[2].strip() for line in Path(proc_cgroup).read_text().splitlines()
                  if line.split(":", 2)[1:2] == ["blkio"]]
        if not groups or groups[0] in ("", "/"):
            return ""
        caps = (Path(root) / groups[0].lstrip("/") / "blkio.throttle.read_bps_device").read_text()
    except (OSError, IndexError):
        return ""
    return "; ".join(line.strip() for line in caps.splitlines() if line.strip())


def disk_key(folder) -> str:
    """Which disk `folder` (or, not made yet, its nearest existing parent) is read from, as the
    start-up probe keys its bandwidth: the file system's device number, 'dev MAJ:MIN' (folders on one
    file system share one disk, so it is measured once, not once per offload folder), and the kernel's
    read caps on this process where it runs under some, so a figure measured under a cap never
    stands for the disk's own."""
    p = Path(folder).expanduser().resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    dev = p.stat().st_dev
    caps = blkio_read_limits()
    return f"dev {os.major(dev)}:{os.minor(dev)}" + (f" under read caps {caps}" if caps else "")
