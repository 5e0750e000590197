"""Dense: full attention over every cached token (the default policy)."""
from __future__ import annotations

from dataclasses import dataclass

from ..policy import KVPolicy


@dataclass(eq=False)
class Dense(KVPolicy):
    """Every block (full attention)."""

    name = "dense"
