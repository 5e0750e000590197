"""Selecting a query-aware policy's blocks one (layer, GPU batch) ahead, so their recovery
overlaps the compute before it, like the engine's other prefetches.

The schedule runs every GPU batch of layer j before layer j+1. While (j, k) computes, the next
cell is (j, k+1), whose input is batch k+1's hidden state, or (j+1, 0), whose input is batch 0's
output of layer j, already computed when k is the last batch. Either way the next cell's query
is exact: its attention input through the query projection alone (RoPE at its positions for
Llama). With one GPU batch the next cell's input is the output still being computed, so a
query-aware selection waits for the real query (no overlap) — unless the engine speculates
(`EngineConfig.speculative_prefetch`): then the next layer's query is guessed from the current
layer's input (the residual stream changes little from one layer to the next), its blocks are
gathered while this layer computes, and at the next layer the exact selection reuses what the
guess read and reads the rest then (recovery.py `top_up`). The exact selection is what attention
uses, so the output does not change; only the bytes of wrong guesses are added.
"""
from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import NamedTuple

import torch

from ..kv.policy import Selection
from .weights import sub_weights


class Ahead(NamedTuple):
    """What the next (layer, batch) cell needs to compute its query early."""

    weights: dict | Future  # the next cell's layer weights (a Future while they load)
    x: torch.Tensor | None  # [B, 1, hidden] its input hidden state
    pos: torch.Tensor  # [B, 1] its positions
    input_ready: bool  # False: the next cell's input is still being computed (one GPU batch)


def early_selection(eng, layer, table, ahead: Ahead | None) -> Selection | None:
    """The policy's selection for the next cell from its exact query, or from a guessed one
    (Selection.guess) when the engine speculates and the next input is not computed yet; None
    when neither can be had without waiting (no input, or the weights still loading)."""
    guess = ahead is not None and not ahead.input_ready and eng.cfg.speculative_prefetch
    if ahead is None or not (ahead.input_ready or guess) or ahead.x is None or layer.kind not in ("attn", "block"):
        return None
    w = ahead.weights
    if isinstance(w, Future):
        if not w.done():  # never stall the current cell on the next layer's weights
            return None
        w = eng._adopt(w.result())
    if layer.kind == "block":
        w = sub_weights(w, "a.")
    a = eng.arch
    q = a.query(w, a.attn_input(w, eng._unpark(ahead.x)), ahead.pos)  # q: [B, H, 1, D]
    if not guess:
        return eng.kv_policy.select(table, layer.index, q)
    sel = eng.kv_policy.speculate(table, layer.index, q)
    return dataclasses.replace(sel, guess=True)
