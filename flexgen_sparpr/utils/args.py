"""An argparse parser whose errors are one line: `prog: error: ...`, exit 2 (the project's rule
for bad input), instead of the whole usage."""
from __future__ import annotations

import argparse


class OneLineParser(argparse.ArgumentParser):
    """Bad flags give one `prog: error: ...` line and exit 2, not the whole usage (see --help)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")
