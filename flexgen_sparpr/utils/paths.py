"""Where the package keeps its per-user files (prepared models, the start-up probe's figures)."""
from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """``$FLEXGEN_SPARPR_CACHE``, else ``$XDG_CACHE_HOME/flexgen-sparpr``, else ``~/.cache/flexgen-sparpr``."""
    explicit = os.environ.get("FLEXGEN_SPARPR_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "flexgen-sparpr"
