"""Which format each projection weight is stored in (--weight-format; models/packed.py has them).

`auto` never changes a weight: it packs a projection in the fastest format on this machine (the
probe's timings, runtime/probe.py `weight_formats`) whose codes already hold its values exactly, as
a quantized checkpoint's do (the prepared SmolLM2's Q4_1 tensors pack as int4; a bfloat16
checkpoint's as bfloat16), and keeps the rest in the compute dtype. A format named outright packs
every projection it can hold (quantizing: that is the user's choice). The packed kernels are
torch's CPU ones, so on CUDA only raw and bfloat16 apply.
"""
from __future__ import annotations

from collections import Counter

import torch

from ..errors import ConfigError
from ..models.packed import FORMATS, on_grid, pack, packable

CPU_ONLY = ("int8", "int4")


class WeightFormat:
    """fmt: the --weight-format value; rows: the rows of a decode product (the GPU batch)."""

    def __init__(self, fmt: str, device: torch.device, dtype: torch.dtype, rows: int, timings=None):
        if fmt not in FORMATS:
            raise ConfigError(f"--weight-format must be one of {', '.join(FORMATS)} (got {fmt})")
        if fmt in CPU_ONLY and device.type != "cpu":
            raise ConfigError(f"--weight-format {fmt} runs on the CPU only (torch's packed CPU kernels); "
                              "use raw or bfloat16 on CUDA")
        self.fmt, self.device, self.dtype, self.rows = fmt, device, dtype, rows
        self._timings = timings  # {format: seconds per product}; None: asked of the probe when needed
        self.chosen: Counter = Counter()  # format -> weights stored in it
        self._order: list[str] | None = None  # auto's candidates, asked once (the probe)

    def candidates(self) -> list[str]:
        """auto: the formats faster than raw on this machine, fastest first."""
        if self.device.type != "cpu" or self.dtype not in (torch.float32, torch.bfloat16):
            return []
        if self._timings is None:
            from ..runtime.probe import weight_formats
            self._timings = weight_formats(self.rows)
        raw = self._timings.get("raw", float("inf"))
        return sorted((f for f, s in self._timings.items() if f in ("int4", "bfloat16") and s < raw),
                      key=self._timings.get)

    def choose(self, w: torch.Tensor, head: bool = False) -> str:
        """The format w [out, in] will be stored in ("raw": as it is)."""
        fmt = self.fmt
        if fmt == "auto":
            fmt = next((f for f in self._auto_order(w) if on_grid(w, f, head)), "raw")
        return fmt if fmt != "raw" and packable(fmt, tuple(w.shape)) else "raw"

    def store(self, w: torch.Tensor, head: bool, fmt: str | None = None, parts: int = 1):
        """w [out, in] as it will be multiplied: packed, or w itself (raw). fmt: choose()'s answer,
        if already asked; parts: the weights w fuses (each counted)."""
        fmt = fmt or self.choose(w, head)
        self.chosen[fmt] += parts
        return w if fmt == "raw" else pack(w, fmt, head)

    def _auto_order(self, w: torch.Tensor) -> list[str]:
        if self._order is None:
            self._order = self.candidates()
        return [f for f in self._order if packable(f, tuple(w.shape))]

    def describe(self) -> str:
        """The formats the matmul weights were stored in, e.g. 'int4 (211)' or 'int4 (210), raw (1)'."""
        parts = ", ".join(f"{f} ({n})" for f, n in self.chosen.most_common())
        return f"{self.fmt}: {parts}" if self.fmt == "auto" else parts or self.fmt
