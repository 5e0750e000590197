"""What the budgeted KV policies share: the token budget, per-table state, and turning a set of
kept tokens into a Selection (the blocks to move plus the exact token mask).

Budget. For sequence b at a decode step, n_b = valid tokens cached before the step
(table.length minus b's left padding). Per KV head the step reads at most

    budget_b = min(n_b, max(ceil(keep_ratio * n_b), floor, min_keep_tokens))

cached tokens (True, non-pad entries of Selection.mask); `floor` is what the policy can never
drop (its sinks, the open block). The step's own new token is attended on top: it is computed
this step, not read from the cache, so keep_ratio = 1 reads exactly what dense attention reads.

`min_keep_tokens` (768 by default, every budgeted policy alike) is the least a budget gives: a
10 % budget of a 2k context is 205 tokens, read in blocks +6 % perplexity over dense, where 768
tokens stayed within 0.5 % (docs/fidelity.md, "The budget's token floor"). From 7680 tokens on a
0.1 keep is above it; below, a step reads 768 tokens, a few MB of KV.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

from ..block_table import BlockTable
from ..knobs import at_least, in_unit, knob
from ..policy import KVPolicy, Selection


def token_budget(keep_ratio: float, n: int, floor: int = 0) -> int:
    """min(n, max(ceil(keep_ratio * n), floor)); rounded first so 0.1 * 2040 is 204, not 205."""
    return min(n, max(math.ceil(round(keep_ratio * n, 9)), floor))


@dataclass(eq=False)  # identity semantics: two policies with equal knobs are still two policies
class BudgetPolicy(KVPolicy):
    """Base of the policies that read a fraction `keep_ratio` of the context at a decode step."""

    keep_ratio: float = knob(1.0, "KV budget: fraction of the context's tokens a decode step reads")
    # chosen on the tuning split (results/ppl-min-keep-tokens/): within 0.5 % of dense at 2k and 4k, keep 0.1
    min_keep_tokens: int = knob(768, "the least cached tokens a decode step reads per sequence, whatever "
                                "--keep-ratio (0: the ratio alone, as the SparPR paper's budget)")

    def __post_init__(self):
        in_unit(self, "keep_ratio")
        at_least(self, "min_keep_tokens", 0)
        # keyed by the table object itself, weakly: a dropped table takes its state with it
        self._pads: weakref.WeakKeyDictionary[BlockTable, torch.Tensor] = weakref.WeakKeyDictionary()
        self._host_pads: weakref.WeakKeyDictionary[BlockTable, list[int]] = weakref.WeakKeyDictionary()

    @classmethod
    def matrix_knobs(cls, keep: float) -> dict:
        return {"keep_ratio": keep, "min_keep_tokens": 0}  # the matrix's contexts are tens of tokens

    def read_share(self) -> float:
        return self.keep_ratio

    # --- what every step must read (the test matrix checks these) ---
    def floor(self, table: BlockTable) -> int:
        """Tokens the budget never drops below (sinks, the open block)."""
        return 0

    def mandatory(self, table: BlockTable, budget: int) -> tuple[int, int]:
        """(first, last): how many of the oldest / newest valid cached tokens a step with this
        budget always reads."""
        return 0, 0

    def is_dense_layer(self, layer: int) -> bool:
        """Layers the policy leaves dense (the budget does not apply there)."""
        return False

    # --- per-table facts ---
    def on_prefill(self, table: BlockTable, layer: int, q, k, valid) -> None:
        # left padding: the invalid prefix of each row
        self._pads[table] = (~valid).sum(dim=1).to(table.devices.compute)  # pads: [B]
        self._host_pads[table] = self._pads[table].tolist()  # once here: decode steps branch on them

    def pads(self, table: BlockTable) -> torch.Tensor:
        """[B] left-pad counts (zeros for a table this policy did not see prefilled)."""
        p = self._pads.get(table)
        return p if p is not None else torch.zeros(table.block_shape[1], dtype=torch.long,
                                                   device=table.devices.compute)

    def host_pads(self, table: BlockTable) -> list[int]:
        """pads(table) on the host (no sync)."""
        p = self._host_pads.get(table)
        return p if p is not None else [0] * table.block_shape[1]

    def budgets(self, table: BlockTable) -> list[int]:
        """Per sequence: cached tokens this step may read per KV head."""
        floor = self.budget_floor(table)
        return [token_budget(self.keep_ratio, table.length - p, floor) for p in self.host_pads(table)]

    def budget_floor(self, table: BlockTable) -> int:
        """The least a budget gives: what the policy never drops, or min_keep_tokens if more."""
        return max(self.floor(table), self.min_keep_tokens)

    def valid_tokens(self, table: BlockTable) -> torch.Tensor:
        """[B, L] bool over the cached positions [0, L): not left padding."""
        pos = torch.arange(table.length, device=table.devices.compute)
        return pos[None, :] >= self.pads(table)[:, None]


def gathered_positions(table: BlockTable, blocks: list[int]) -> torch.Tensor:
    """Cache positions of blocks' tokens in table.gather's order: [T]."""
    return table.positions(blocks)


def selection_from_tokens(table: BlockTable, keep: torch.Tensor) -> Selection:
    """keep: [B, Hkv, L] bool over the cached positions. Moves every block holding a kept token
    of any sequence or head, each only for the sequences that keep one of its tokens (where the
    block's home allows a part read); the mask then gives each (sequence, head) exactly its own
    tokens."""
    b, h, length = keep.shape
    nb = table.num_blocks
    padded = torch.zeros(b, h, nb * table.bs, dtype=torch.bool, device=keep.device)
    padded[..., :length] = keep
    need = padded.view(b, h, nb, table.bs).any(dim=3).any(dim=1).tolist()  # need: [B][nb], the one sync
    blocks = [i for i in range(nb) if any(row[i] for row in need)]
    seqs = table.devices.streams.on_host(torch.tensor([[row[i] for i in blocks] for row in need], dtype=torch.bool))
    return Selection(blocks, keep[..., gathered_positions(table, blocks)],  # mask: [B, Hkv, T]
                     seqs=seqs.view(b, len(blocks)))  # seqs: [B, n] on the host


def masked_mean_keys(keys: torch.Tensor, valid: torch.Tensor, parts: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """keys: [B, Hkv, n, bs, D]; valid: [B, n, bs] -> (mean [n, B, Hkv, P, D], live [n, B, P]): the
    mean valid key of each of a block's P = `parts` runs of bs / P tokens (zeros for an all-pad run)."""
    b, hkv, n, bs, d = keys.shape
    w = valid.view(b, 1, n, parts, bs // parts, 1).to(keys.dtype)  # w: [B, 1, n, P, t, 1]
    mean = (keys.view(b, hkv, n, parts, bs // parts, d) * w).sum(dim=4) / w.sum(dim=4).clamp(min=1)
    live = valid.view(b, n, parts, bs // parts).any(dim=3)  # live: [B, n, P]
    return mean.permute(2, 0, 1, 3, 4), live.permute(1, 0, 2)  # mean: [n, B, Hkv, P, D]


def recent_mask(valid: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """[B, L] bool: the last counts[b] positions of each row (all valid when counts[b] <= n_b)."""
    length = valid.shape[1]
    pos = torch.arange(length, device=valid.device)
    start = torch.tensor([length - c for c in counts], device=valid.device)
    return pos[None, :] >= start[:, None]


def first_valid_mask(valid: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """[B, L] bool: the first counts[b] valid positions of each row (the sinks)."""
    rank = valid.long().cumsum(dim=1)  # 1-based rank among valid tokens
    lim = torch.tensor(counts, device=valid.device)
    return valid & (rank <= lim[:, None])
