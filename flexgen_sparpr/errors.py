"""The errors a user can cause or meet, at the bottom of the stack so every layer can raise them.

The command line (utils/guard.py) prints any of them as one `error: ...` line and exits 2.
"""
from __future__ import annotations


class ConfigError(ValueError):
    """A bad setting, file or model; the message names it and says what to do, in one line (a
    newline inside a name the user gave, a path or a value, is shown as \\n)."""

    def __init__(self, *args):
        if len(args) == 1 and isinstance(args[0], str):
            args = (args[0].replace("\r", "\\r").replace("\n", "\\n"),)
        super().__init__(*args)


class CapacityError(ConfigError):
    """The run cannot fit: memory, disk or a position table is too small for what was asked."""


class ModelNotFound(ConfigError):
    """The named model has no weights on disk; the message says where they must go."""


class PeerFailed(ValueError):
    """Another rank of a distributed run failed, so this one stopped; the message names it."""


class NoPlacementFits(ValueError):
    """No grid point fits the tiers' memory."""


class PrepareError(RuntimeError):
    """Preparing the model failed (download, unzip or conversion)."""
