"""Progress bars (tqdm) on stderr, only where someone watches: never when stderr is not a
terminal (logs, pipes, CI) or the user asked for quiet, so they never mix into JSON or JSONL."""
from __future__ import annotations

import sys


def bars_wanted(quiet: bool = False) -> bool:
    """Bars on: not --quiet, and stderr is a terminal."""
    return not quiet and sys.stderr.isatty()


class _NoBar:
    """What a bar that is off does: nothing (an iterable passes through)."""

    def __init__(self, iterable=None):
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable)

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str = "", refresh: bool = True) -> None:
        pass

    @staticmethod
    def write(text: str) -> None:
        print(text, flush=True)

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def progress(iterable=None, *, enabled: bool, **kwargs):
    """A tqdm bar over `iterable` (or a bar to update by hand) when enabled, else one that does
    nothing; tqdm's keyword arguments (desc, total, unit, leave, initial, ...) pass through.
    `bar.write(line)` prints a line to stdout above the bar (or plainly when it is off)."""
    if not enabled:
        return _NoBar(iterable)
    from tqdm import tqdm
    return tqdm(iterable, file=sys.stderr, dynamic_ncols=True, **kwargs)
