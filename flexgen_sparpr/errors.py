"""The errors a user can cause or meet, at the bottom of the package so any layer may raise them.
The CLI turns each into one `error:` line and exit code 2 (cli/main.py)."""
from __future__ import annotations


class ConfigError(ValueError):
    """A bad setting; the CLI prints its message on one line and exits 2."""


class ModelNotFound(ValueError):
    """The named model has no weights on disk; the message says where they must go."""


class NoPlacementFits(ValueError):
    """No grid point fits the tiers' memory."""


class PrepareError(RuntimeError):
    """Preparing the model failed (download, unzip or conversion)."""
