"""An embedding table homed on the disk tier, looked up where it lies (engine/weights.py `load`).

A decode step embeds one token a sequence: reading the whole table for it (SmolLM2's float32 token
table is 113 MB of the 210 MB a step with int4 weights on disk moved; OPT-6.7B's float16 one,
412 MB) costs more than every layer's weights. `table[ids]` reads only the rows it is asked for,
each from the pages that hold it; a prefill's thousands of rows read the table whole, as before.
"""
from __future__ import annotations

import torch

from ..storage.tiers import Devices

WHOLE_SHARE = 0.25  # asked for rows holding more than this share of the table's bytes: read it whole


class TableRows:
    """The table of StoredWeight `w` ([rows, dim] in `dtype`, raw, in its disk file's slot 0) as an
    object that supports `table[index]`, index any integer tensor of rows -> [*index.shape, dim]."""

    def __init__(self, w, dtype: torch.dtype, devices: Devices):
        self.w, self.dtype, self.devices = w, dtype, devices
        self.shape = tuple(w.shape)

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        dev, (n, dim) = self.devices, self.shape
        row = dim * torch.empty((), dtype=self.dtype).element_size()
        rows, inv = torch.unique(index.reshape(-1).cpu(), return_inverse=True)  # rows: [U]; inv: [numel]
        if rows.numel() * row > WHOLE_SHARE * n * row:
            table = dev.empty_host((n, dim), self.dtype)
            self.w.file.read(0, table)
            got, rows = table, None
        else:
            got = dev.empty_host((rows.numel(), dim), self.dtype)  # got: [U, dim]
            for i, r in enumerate(rows.tolist()):
                self.w.file.read_at(0, r * row, got[i])
        dev.counters.add("disk", "cpu", got.nbytes)
        if got.device != dev.compute:
            got = dev.host.to_compute_new(got)
            dev.counters.add("cpu", "compute", got.nbytes)
        pick = index.reshape(-1).to(got.device) if rows is None else inv.to(got.device)
        return got[pick].view(*index.shape, dim)
