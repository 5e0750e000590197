"""The one error path of every command and script: any failure ends in one `error: ...` line.

Expected failures (bad flag, file, config value or model, memory or disk that cannot fit, an
unwritable output) exit 2; SIGINT, SIGTERM and SIGHUP unwind the run like an exception (so its
`finally` blocks remove the offload files) and exit 128 + the signal's number; anything else is a
bug: one line naming it and the environment variable that shows the traceback, exit 1.
"""
from __future__ import annotations

import errno
import os
import signal
import sys
from contextlib import contextmanager

TRACEBACK_ENV = "FLEXGEN_SPARPR_TRACEBACK"
STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")
_DISK_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


class Interrupted(KeyboardInterrupt):
    """A stop signal, raised in the main thread where the signal arrived."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


@contextmanager
def stop_signals_unwind():
    """While inside, SIGINT/SIGTERM/SIGHUP raise Interrupted once (the unwinding cleans up);
    a second signal during that clean-up is ignored rather than cutting it short."""
    import threading
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = []

    def handler(signum, frame):
        if fired:
            return
        fired.append(signum)
        raise Interrupted(signum)

    sigs = [getattr(signal, n) for n in STOP_SIGNALS if hasattr(signal, n)]
    old = {s: signal.signal(s, handler) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def describe(e: BaseException) -> tuple[int, str]:
    """(exit code, the message after `error: `) for a failure."""
    from ..errors import ConfigError
    if isinstance(e, Interrupted):
        return 128 + e.signum, f"stopped by {e.name}; offload files removed"
    if isinstance(e, KeyboardInterrupt):
        return 128 + signal.SIGINT, "stopped by SIGINT; offload files removed"
    if isinstance(e, ConfigError):
        return 2, one_line(e)
    if isinstance(e, OSError):
        return 2, _os_error(e)
    if isinstance(e, MemoryError) or _is_torch_oom(e):
        return 2, ("out of memory: " + one_line(str(e) or type(e).__name__)[:200] + " (put more of --percent on "
                   "the CPU or disk tiers, or lower the batch or the lengths)")
    if isinstance(e, ValueError):  # the package's own checks raise ValueError with a readable message
        return 2, one_line(e)
    return 1, (f"internal error {type(e).__name__}: {one_line(e)[:300]} (a bug; set {TRACEBACK_ENV}=1 "
               "for the traceback and report it)")


def _os_error(e: OSError) -> str:
    where = f": {e.filename}" if e.filename else ""
    if e.errno in _DISK_FULL:
        return (f"disk full writing {e.filename or 'a file'} ({e.strerror}); free space there, or move "
                "--offload-dir or put less of --percent on disk")
    if e.errno == errno.EFBIG:
        return f"file too large{where} ({e.strerror}; a file-size limit, `ulimit -f`?)"
    return f"{e.strerror or one_line(e)}{where}"


def _is_torch_oom(e: BaseException) -> bool:
    text = str(e)
    return type(e).__name__ == "OutOfMemoryError" or (
        isinstance(e, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower()))


def guarded(fn, *args, label: str = "") -> int:
    """Run fn(*args) as a command: its int return (None: 0) is the exit code; a failure prints
    one line on stderr (see the module doc), after `label` (a distributed run's `rank N: `).
    FLEXGEN_SPARPR_TRACEBACK=1 re-raises instead."""
    try:
        with stop_signals_unwind():
            rc = fn(*args)
        return rc if isinstance(rc, int) else 0
    except SystemExit:  # argparse's one-line errors and scripts' die() already printed theirs
        raise
    except BaseException as e:  # noqa: BLE001  (the one place every failure is turned into a line)
        if os.environ.get(TRACEBACK_ENV) and not isinstance(e, KeyboardInterrupt):
            raise
        code, msg = describe(e)
        print(f"error: {label}{msg}", file=sys.stderr, flush=True)
        return code
