"""StreamingLLM: attention sinks plus a sliding window of the most recent tokens."""
from __future__ import annotations

from dataclasses import dataclass

from ..block_table import BlockTable
from ..knobs import at_least, knob
from ..policy import Selection
from .base import BudgetPolicy, first_valid_mask, recent_mask, selection_from_tokens


@dataclass(eq=False)
class StreamingLLM(BudgetPolicy):
    """Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks" (ICLR 2024).

    Each step reads the first `num_sinks` valid tokens (the attention sinks) and the most recent
    tokens filling the rest of the budget; everything between is skipped. The choice needs no
    query, so `plan` answers it and the engine can prefetch the blocks. Blocks moved: those
    holding a kept token (the sink block, the window's blocks, the open last block); the token
    mask is exact, so a partly kept block contributes only its kept tokens. With left padding
    the sinks are the first *valid* tokens of each sequence. Tokens between sinks and window
    are never read again once the window has passed them (the cache still holds them).
    """

    name = "streaming-llm"
    num_sinks: int = knob(4, "the first valid tokens every step reads (the attention sinks)")

    def __post_init__(self):
        super().__post_init__()
        at_least(self, "num_sinks", 0)

    def floor(self, table: BlockTable) -> int:
        return self.num_sinks

    def mandatory(self, table: BlockTable, budget: int) -> tuple[int, int]:
        sinks = min(self.num_sinks, budget)
        return sinks, budget - sinks

    def plan(self, table: BlockTable, layer: int) -> Selection:
        valid = self.valid_tokens(table)  # valid: [B, L]
        parts = [self.mandatory(table, n) for n in self.budgets(table)]
        keep = first_valid_mask(valid, [s for s, _ in parts]) | recent_mask(valid, [r for _, r in parts])
        hkv = table.block_shape[2]
        return selection_from_tokens(table, keep[:, None, :].expand(-1, hkv, -1))  # [B, Hkv, L]
