"""SparPR's block selection inside upstream FlexGen's decode attention.

`apply_sparpr(keep_ratio=..., min_keep=..., block_size=...)` wraps upstream's
`TorchDevice._attention_value` — the attention over the KV cache that `mha_gen` runs at every
decode step (dense and mixed-device paths alike). The cached positions are cut into blocks of
`block_size`; each block is summarised by its mean valid key per head, scored by the sum over
heads of q . summary (as this engine's SparPR does), and each sequence attends only its
top-scoring blocks within the budget (`token_budget` and `keep_target`, this engine's rules),
plus its sink block, the last `recent_blocks` full blocks, the open block and the new token
(the engine's budgeted pick, kv/policies/scoring.py).
The rest are masked out exactly as upstream masks padding, so keep_ratio 1.0 changes nothing.

Upstream moves its whole KV cache to the compute device before attention, so the hook changes
what attention reads, not what is copied: SparPR's copy-or-recompute recovery and its measured
dynamic budget have nothing to act on there, and the keep ratio used is
`keep_target(nan, keep_ratio, min_keep)` = keep_ratio.
"""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field

import torch

from ..kv.knobs import at_least, in_unit
from ..kv.policies.base import token_budget
from ..kv.policies.scoring import budgeted_pick
from ..runtime.costs import keep_target


@dataclass
class SparPRConfig:
    keep_ratio: float = 0.5
    min_keep: float = 0.1
    block_size: int = 64
    recent_blocks: int = 1

    def __post_init__(self):  # the engine's SparPR knobs' rules (kv/knobs.py)
        in_unit(self, "keep_ratio")
        in_unit(self, "min_keep")
        if int(self.block_size) != self.block_size or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer (got {self.block_size})")
        at_least(self, "recent_blocks", 0)


@dataclass
class HookStats:
    """Summed over decode attention calls: cached positions read vs valid."""
    calls: int = 0
    tokens_read: int = 0
    tokens_valid: int = 0
    per_call: list = field(default_factory=list)  # (context length, read, valid) per call

    def effective_keep(self) -> float:
        return self.tokens_read / max(1, self.tokens_valid)


_state: dict = {"config": None, "original": None, "stats": HookStats()}


def sparpr_keep(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, n_head: int,
                config: SparPRConfig) -> torch.Tensor:
    """Positions one decode step attends, in upstream's layout.

    q: [B*H, 1, D]; k: [B*H, D, S] (position S-1 is the new token); mask: [B, S] bool (False =
    padding). Returns keep: [B, S] bool, a subset of mask that always holds the new token."""
    b, s = mask.shape
    d, bs = q.shape[-1], int(config.block_size)
    n = s - 1  # cached positions; the new token is attended on top
    sealed = n // bs
    keep = mask.clone()
    if sealed == 0:
        return keep
    valid = mask[:, :n]  # valid: [B, n]
    blk_valid = valid[:, :sealed * bs].reshape(b, sealed, bs)  # blk_valid: [B, nb, bs]
    keys = k[:, :, :sealed * bs].float().reshape(b, n_head, d, sealed, bs).permute(0, 1, 3, 4, 2)  # [B, H, nb, bs, D]
    w = blk_valid[:, None, :, :, None].float()  # w: [B, 1, nb, bs, 1]
    summary = (keys * w).sum(dim=3) / w.sum(dim=3).clamp(min=1)  # summary: [B, H, nb, D] mean valid key
    score = torch.einsum("bhd,bhnd->bn", q.float().reshape(b, n_head, d), summary)  # score: [B, nb]

    counts = blk_valid.sum(dim=2)  # counts: [B, nb]
    ids = torch.arange(sealed, device=mask.device)
    first = valid.long().argmax(dim=1)  # first valid position (left padding)
    own = (ids[None, :] == (first // bs)[:, None]) | (ids >= sealed - config.recent_blocks)[None, :]  # [B, nb]
    target = keep_target(math.nan, config.keep_ratio, config.min_keep)
    floor = bs * (1 + config.recent_blocks) + n % bs
    budget = torch.tensor([token_budget(target, int(m), floor) for m in valid.sum(dim=1).tolist()],
                          device=mask.device)
    used = (counts * own).sum(dim=1) + valid[:, sealed * bs:].sum(dim=1)  # used: [B]
    pick = budgeted_pick(score.masked_fill(counts == 0, -math.inf), counts, budget - used, own)  # [B, nb]
    keep[:, :sealed * bs] &= pick.repeat_interleave(bs, dim=1)
    return keep


def _hooked(self, q, k, v, mask, b, src_s, tgt_s, n_head, head_dim):
    """Upstream's `_attention_value` with SparPR's positions masked in (decode steps only)."""
    config, original = _state["config"], _state["original"]
    if config is None or tgt_s != 1:
        return original(self, q, k, v, mask, b, src_s, tgt_s, n_head, head_dim)
    keep = sparpr_keep(q, k, mask, n_head, config)  # keep: [B, S]
    st = _state["stats"]
    read, valid = int(keep[:, :-1].sum()), int(mask[:, :-1].sum())
    st.calls, st.tokens_read, st.tokens_valid = st.calls + 1, st.tokens_read + read, st.tokens_valid + valid
    st.per_call.append((src_s - 1, read, valid))
    return original(self, q, k, v, keep, b, src_s, tgt_s, n_head, head_dim)


def apply_sparpr(keep_ratio: float = 0.5, min_keep: float = 0.1, block_size: int = 64,
                 recent_blocks: int = 1) -> SparPRConfig:
    """Make upstream FlexGen's decode attention read only SparPR's selected blocks (this
    process; call again to change the knobs, `remove_sparpr()` to undo). Works with or without
    `apply_cpu_patches()`. keep_ratio 1.0 leaves upstream's outputs bit-identical."""
    config = SparPRConfig(keep_ratio, min_keep, block_size, recent_blocks)
    backend = importlib.import_module("flexgen.pytorch_backend")
    if _state["original"] is None:
        _state["original"] = backend.TorchDevice._attention_value
        backend.TorchDevice._attention_value = _hooked
    _state["config"] = config
    _state["stats"] = HookStats()
    return config


def remove_sparpr() -> None:
    """Restore upstream's own decode attention."""
    if _state["original"] is not None:
        importlib.import_module("flexgen.pytorch_backend").TorchDevice._attention_value = _state["original"]
        _state["original"] = None
    _state["config"] = None


def sparpr_stats() -> HookStats:
    """What the hook read since the last apply_sparpr."""
    return _state["stats"]
