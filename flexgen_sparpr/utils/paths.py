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


SHIPPED_CONFIGS = Path(__file__).resolve().parents[1] / "configs"  # policy and hardware files, package data


def config_file(path) -> Path:
    """A --config / --hardware path as given, or, when it is not there and reads `configs/...`,
    the shipped copy (so the documented `--config configs/...` works from a wheel install too)."""
    p = Path(path).expanduser()
    if p.is_file() or p.is_absolute() or not p.parts or p.parts[0] != "configs":
        return p
    shipped = SHIPPED_CONFIGS.joinpath(*p.parts[1:])
    return shipped if shipped.is_file() else p
