"""Upstream FlexGen's --attn-sparsity as a KV policy: top-k keys by exact attention score."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..block_table import BlockTable
from ..policy import Selection
from .base import BudgetPolicy, selection_from_tokens


@dataclass(eq=False)
class FlexGenTopK(BudgetPolicy):
    """Sheng et al. 2023, "FlexGen: High-Throughput Generative Inference of Large Language Models
    with a Single GPU" (ICML 2023), approximate methods, sparse attention: score every cached key,
    keep the top k = ceil(keep_ratio * n) per head, softmax renormalised over the kept keys (the
    engine's masked softmax does the renormalising); the step's new token is always attended on
    top of the k, as upstream does.

    Upstream faults not copied (flexgen/pytorch_backend.py, `_sparse_attention_value`, read not
    run): the kept weights are the full softmax's, never renormalised (they sum to < 1); k =
    int(sparsity * (s - 1)) floors, to 0 on short contexts; the top-k V gather passes a tensor
    index that only the disk copy threads handle (vector_gather): a V cache on GPU or CPU reaches
    general_copy's `... if src_indices else ...` (truth value of a multi-element tensor), and a
    split (mixed) cache is refused by an assert in mha_gen.

    Grouped-query attention: the mask is per KV head, so a KV head's query heads share one kept
    set, ranked by the max over the group of each query head's softmax probability (a key that
    any head of the group needs survives). With one query head per KV head (OPT) this is exactly
    per-head top-k. Per-query-head exactness under GQA needs the engine's own path
    (Policy.attn_sparsity -> models/topk_attention.topk_sparse_attention, which also ranks the new token
    among the k instead of keeping it on top).

    Bytes: ranking needs every key, so `select` reads every block (on a resident cache a view,
    no copy); the engine then moves the blocks holding a kept key of any sequence or head (near
    all of them at moderate keep ratios). So an offloaded cache moves more than dense attention
    would: all blocks plus the selected ones. Upstream moved all K and only the top-k V; a block
    table stores K and V together, so that saving needs an engine change (a key-only gather, or
    handing `select` the KV it gathered).
    """

    name = "flexgen-topk"
    flexgen_flag = ("attn_sparsity", "keep_ratio")  # FlexGen's --attn-sparsity S runs as this, keep_ratio S
    scans_keys = True  # select reads every block once more (the test matrix accounts for it)

    def plan(self, table: BlockTable, layer: int) -> None:
        return None  # needs the query

    def select(self, table: BlockTable, layer: int, q: torch.Tensor) -> Selection:
        kv, _ = table.gather()  # kv: [2, B, Hkv, L, D]; a view when the cache is resident
        b, h, _, d = q.shape
        hkv, length = kv.shape[2], kv.shape[3]
        valid = self.valid_tokens(table)  # valid: [B, L]
        qg = q.float().view(b, hkv, h // hkv, d)  # qg: [B, Hkv, G, D]
        sc = torch.einsum("bkgd,bktd->bkgt", qg, kv[0].float()) / math.sqrt(d)
        p = torch.softmax(sc.masked_fill(~valid[:, None, None, :], float("-inf")), dim=-1)
        rank = p.amax(dim=2).masked_fill(~valid[:, None, :], -1.0)  # rank: [B, Hkv, L]
        mask = torch.zeros(b, hkv, length, dtype=torch.bool, device=q.device)
        for i, k in enumerate(self.budgets(table)):
            if k:
                mask[i].scatter_(-1, rank[i].topk(k, dim=-1).indices, True)
        return selection_from_tokens(table, mask)  # the second read skips blocks with no top-k key
