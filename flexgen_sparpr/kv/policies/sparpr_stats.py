"""SparPR's per-step statistics (`SparPR.stats()`): what each decode step selected, copied,
rebuilt and fell back on, with the bytes it estimated per link."""
from __future__ import annotations

import math

from ...storage.tiers import Tier
from ..block_table import BlockTable
from ..policy import Selection


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None  # JSON has no inf / nan


class StepStats:
    """What SparPR did at each decode step, summed over the step's layers and GPU batches
    (a step = one context length; estimated bytes per link from the selection and homes)."""

    KEYS = ("calls", "blocks_total", "blocks_selected", "blocks_copied", "blocks_recomputed", "spans",
            "fallbacks", "tokens_read", "tokens_valid", "keep_target_sum", "est_sparse_s", "est_dense_s")

    def __init__(self):
        self.steps: list[dict] = []

    def add(self, table: BlockTable, sel: Selection, rebuild: list[int], spans: int, n_valid: list[int],
            target: float, rho: float, sparse_s: float, dense_s: float, fell_back: bool,
            nseq: dict[int, int] | None = None) -> None:
        """nseq: readers(table, sel) when the caller has it already."""
        if not self.steps or self.steps[-1]["context"] != table.length:
            self.steps.append({"context": table.length, **dict.fromkeys(self.KEYS, 0), "est_bytes": {}})
        s, sealed = self.steps[-1], table.length // table.bs
        s["rho"] = _finite(rho)  # copy / recompute cost of this step's offloaded blocks (last layer)
        moved = [i for i in sel.blocks if i < sealed and table.homes[i] != Tier.COMPUTE]
        # per sequence; summed on the device, read at report time (no sync per step)
        read = sum(n_valid) if sel.mask is None else sel.mask[:, 0].sum()
        for k, v in (("calls", 1), ("blocks_total", table.num_blocks), ("blocks_selected", len(sel.blocks)),
                     ("blocks_copied", len(moved) - len(rebuild)), ("blocks_recomputed", len(rebuild)),
                     ("spans", spans), ("fallbacks", int(fell_back)), ("tokens_read", read),
                     ("tokens_valid", sum(n_valid)), ("keep_target_sum", target),
                     ("est_sparse_s", sparse_s if math.isfinite(sparse_s) else 0.0),
                     ("est_dense_s", dense_s if math.isfinite(dense_s) else 0.0)):
            s[k] += v
        nseq = readers(table, sel) if nseq is None else nseq
        for i in moved:
            n = table.checkpoints.store.codec.nbytes if i in rebuild else table.store.read_bytes(i, nseq[i])
            links = (["disk->cpu"] if table.homes[i] == Tier.DISK else []) + \
                (["cpu->compute"] if table.devices.is_cuda else [])
            for link in links:
                s["est_bytes"][link] = s["est_bytes"].get(link, 0) + n

    def report(self) -> dict:
        for s in self.steps:
            s["tokens_read"] = int(s["tokens_read"])
        steps = [{**s, "effective_keep": s["tokens_read"] / max(1, s["tokens_valid"]),
                  "keep_target": s["keep_target_sum"] / max(1, s["calls"])} for s in self.steps]
        totals = {k: sum(s[k] for s in steps) for k in self.KEYS if k != "keep_target_sum"}
        totals["effective_keep"] = totals["tokens_read"] / max(1, totals["tokens_valid"])
        totals["est_bytes"] = {}
        for s in steps:
            for link, n in s["est_bytes"].items():
                totals["est_bytes"][link] = totals["est_bytes"].get(link, 0) + n
        return {"totals": totals, "steps": steps}


def readers(table: BlockTable, sel: Selection) -> dict[int, int]:
    """Block id -> how many sequences read it (a block's copy moves only theirs, where it can)."""
    b = table.block_shape[1]
    if sel.seqs is None:
        return dict.fromkeys(sel.blocks, b)
    return dict(zip(sel.blocks, sel.seqs.sum(dim=0).tolist()))
