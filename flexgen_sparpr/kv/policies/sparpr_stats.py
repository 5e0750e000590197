"""SparPR's per-step statistics (`SparPR.stats()`): what each decode step selected, copied,
rebuilt and fell back on, with the bytes it estimated per link."""
from __future__ import annotations

import math

import torch

from ..block_table import BlockTable


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None  # JSON has no inf / nan


class StepStats:
    """What SparPR did at each decode step, summed over the step's layers and GPU batches
    (a step = one context length; estimated bytes per link from the selection and homes)."""

    KEYS = ("calls", "blocks_total", "blocks_selected", "blocks_copied", "blocks_recomputed", "spans",
            "fallbacks", "tokens_read", "tokens_valid", "keep_target_sum", "est_sparse_s", "est_dense_s",
            "dense_floor_s")

    def __init__(self):
        self.steps: list[dict] = []
        self._picked: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # this step's, not yet counted

    def add(self, table: BlockTable, *, blocks_selected: int, copied: int, rebuilt: int, spans, n_valid: list[int],
            tokens_read, target: float, rho: float, sparse_s: float, dense_s: float, fell_back: bool,
            est_bytes: dict[str, int], picked: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
            dense_floor_s: float = math.nan) -> None:
        """One layer's selection. spans and tokens_read may be device tensors: they are summed
        there and read at report time (no sync per step). picked (pick [B, nb] bool, counts [B, nb],
        open tokens []): count spans and tokens read from it instead, all of a step's layers at once
        when the step ends (a few tensor calls a step, not a layer). dense_floor_s: the least reading
        every offloaded block could cost (CostModel.least_copy_s; the measured step fallback's floor)."""
        if not self.steps or self.steps[-1]["context"] != table.length or \
                picked is not None and self._picked and self._picked[0][0].shape != picked[0].shape:
            self._count_picked()
        if not self.steps or self.steps[-1]["context"] != table.length:
            self.steps.append({"context": table.length, **dict.fromkeys(self.KEYS, 0), "est_bytes": {}})
        s = self.steps[-1]
        if picked is not None:
            self._picked.append(picked)
            spans = tokens_read = 0
        s["rho"] = _finite(rho)  # copy / recompute cost of this step's offloaded blocks (last layer)
        for k, v in (("calls", 1), ("blocks_total", table.num_blocks), ("blocks_selected", blocks_selected),
                     ("blocks_copied", copied), ("blocks_recomputed", rebuilt), ("spans", spans),
                     ("fallbacks", int(fell_back)), ("tokens_read", tokens_read), ("tokens_valid", sum(n_valid)),
                     ("keep_target_sum", target), ("est_sparse_s", sparse_s if math.isfinite(sparse_s) else 0.0),
                     ("est_dense_s", dense_s if math.isfinite(dense_s) else 0.0),
                     ("dense_floor_s", dense_floor_s if math.isfinite(dense_floor_s) else 0.0)):
            s[k] += v
        for link, n in est_bytes.items():
            s["est_bytes"][link] = s["est_bytes"].get(link, 0) + n

    def _count_picked(self) -> None:
        """The spans (runs of blocks some sequence picked) and tokens read of the picks held, into
        the step they belong to (the last)."""
        if not self._picked:
            return
        picks = torch.stack([p for p, _, _ in self._picked])  # picks: [n, B, nb]
        counts = torch.stack([c for _, c, _ in self._picked])  # counts: [n, B, nb]
        col = picks.any(dim=1)  # col: [n, nb] blocks some sequence read
        s = self.steps[-1]
        s["spans"] += (col[:, 1:] & ~col[:, :-1]).sum() + col[:, :1].sum()
        s["tokens_read"] += (counts * picks).sum() + torch.stack([o for _, _, o in self._picked]).sum()
        self._picked.clear()

    def report(self) -> dict:
        self._count_picked()
        for s in self.steps:
            s["tokens_read"], s["spans"] = int(s["tokens_read"]), int(s["spans"])
        steps = [{**s, "effective_keep": s["tokens_read"] / max(1, s["tokens_valid"]),
                  "keep_target": s["keep_target_sum"] / max(1, s["calls"])} for s in self.steps]
        totals = {k: sum(s[k] for s in steps) for k in self.KEYS if k != "keep_target_sum"}
        totals["effective_keep"] = totals["tokens_read"] / max(1, totals["tokens_valid"])
        totals["est_bytes"] = {}
        for s in steps:
            for link, n in s["est_bytes"].items():
                totals["est_bytes"][link] = totals["est_bytes"].get(link, 0) + n
        return {"totals": totals, "steps": steps}
