"""SparPR inside upstream FlexGen: its decode cache loading moves only the selected blocks.

`apply_sparpr(keep_ratio=..., min_keep=..., block_size=...)` wraps two methods of upstream's
`SelfAttention` (flexgen/flex_opt.py, also reached through `TransformerLayer`):

- `load_cache`, which at every decode step copies a layer's whole KV cache [0, context) from its
  home (upstream's GPU, CPU, disk or mixed device) to the compute device, one layer ahead. Hooked,
  it copies nothing for a decode step: the choice needs the layer's query, which exists only once
  the layer computes.
- `forward`. Hooked, at a decode step it first computes the layer's query (its layer norm and
  query projection: the one product SparPR adds), scores the cached blocks by their key
  summaries, picks the blocks within the budget and copies only those — adjacent blocks as one
  span, through upstream's own `general_copy` (its disk copy threads for a disk home) — into a
  compact cache of the selected positions plus the new token's slot; then upstream's own forward
  attends it with the matching compact mask. After every forward (prefill and decode) the new
  keys update the summaries.

Summaries (hook_selection.py): the mean valid key per head of each run of `summary_tokens` tokens
(SparPR's default), on upstream's compute device, in the cache's dtype; scored as SparPR scores
them (per-head softmax over the runs, `kv/policies/sparpr_mean.py block_scores`; a block scores its best run). Upstream keeps
a position's keys for every sequence in one row ([S, B*H, D]), so a block moved for one sequence
moves for all: the batch reads one set of blocks, each scoring the sum of its sequences' scores,
taken while every sequence's valid tokens fit its budget (`token_budget`, the engine's rule), on
top of each sequence's sink block, the last `recent_blocks` full blocks and the open block. With
no cost model in upstream the budget is the ceiling (`keep_target(nan, ...)`); there are no
checkpoints, so nothing is rebuilt. keep_ratio 1.0 selects everything and copies it as upstream
does: outputs stay bit-identical.

Not hooked (upstream's own path runs): --compress-cache, --compress-weight, --cpu-cache-compute
and --attn-sparsity < 1. `sparpr_stats()` counts calls, tokens, and the bytes and requests moved
per home device.
"""
from __future__ import annotations

import importlib
import weakref
from dataclasses import dataclass, field

import torch

from ..kv.policies.sparpr import SparPR
from .hook_selection import Summaries as _Summaries, pick_blocks  # noqa: F401 (the hook's names, as tests use them)


@dataclass
class SparPRConfig:
    """The hook's settings: the engine's own SparPR policy (its knobs, defaults and checks, one
    home: kv/policies/sparpr.py) and upstream's KV block size, which is not a SparPR knob."""

    policy: SparPR = field(default_factory=SparPR)
    block_size: int = 64

    def __post_init__(self):
        if int(self.block_size) != self.block_size or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer (got {self.block_size})")
        st = self.summary_tokens
        if 0 < st < self.block_size and self.block_size % st:
            raise ValueError(f"summary_tokens must be 0 or divide block_size {self.block_size} (got {st})")

    keep_ratio = property(lambda self: self.policy.keep_ratio)
    min_keep = property(lambda self: self.policy.min_keep)
    recent_blocks = property(lambda self: self.policy.recent_blocks)
    summary_tokens = property(lambda self: self.policy.summary_tokens)

    @property
    def run(self) -> int:
        """Tokens per summary (a block when summary_tokens is 0 or not below it)."""
        st = self.summary_tokens
        return st if 0 < st < self.block_size else self.block_size


@dataclass
class HookStats:
    """Summed over hooked decode calls (one per layer, GPU batch and step)."""
    calls: int = 0
    tokens_read: int = 0  # cached positions attended, summed over sequences
    tokens_valid: int = 0
    blocks_total: int = 0  # sealed blocks of the batch's cache
    blocks_selected: int = 0
    spans: int = 0
    bytes_moved: dict = field(default_factory=dict)  # home device ("disk", "cpu", "gpu") -> bytes of K and V
    requests: dict = field(default_factory=dict)  # home device -> copies issued (a span of K or of V each)
    summary_bytes: int = 0  # the summaries' bytes on the compute device, at their largest
    per_call: list = field(default_factory=list)  # (context length, read, valid) per call

    def effective_keep(self) -> float:
        return self.tokens_read / max(1, self.tokens_valid)

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in ("calls", "tokens_read", "tokens_valid", "blocks_total",
                                              "blocks_selected", "spans", "summary_bytes")}
        return {**out, "bytes_moved": dict(self.bytes_moved), "requests": dict(self.requests),
                "effective_keep": self.effective_keep()}


_state: dict = {"config": None, "originals": None, "stats": HookStats()}


_sums: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # cache_read_buf holder -> _Summaries


class _Deferred:
    """What the hooked load_cache leaves for a decode step: the cache's homes, read in forward."""

    def __init__(self, k_home, v_home):
        self.k_home, self.v_home = k_home, v_home


def _spans(rows: list[int]) -> list[tuple[int, int]]:
    """Ascending positions -> [start, end) runs."""
    out = []
    for r in rows:
        if out and r == out[-1][1]:
            out[-1][1] = r + 1
        else:
            out.append([r, r + 1])
    return [tuple(x) for x in out]


def _home_name(tensor) -> str:
    """"gpu", "cpu" or "disk": upstream's tier a tensor lives on."""
    return {"CUDA": "gpu"}.get(tensor.device.device_type.name, tensor.device.device_type.name.lower())


def _gather(attn, d: _Deferred, positions: list[int], n_rows: int, stats: HookStats):
    """Copy the cached `positions` (ascending) from the homes into fresh compute tensors of
    n_rows rows ([n_rows, B*H, D]; the rows after them are left for the new token), span by span;
    returns (k, v) TorchTensors on upstream's attention compute device."""
    from flexgen.pytorch_backend import DeviceType, general_copy
    import numpy as np
    dst = attn.attention_compute
    bh, dd = d.k_home.shape[1], d.k_home.shape[2]
    k = dst.allocate((n_rows, bh, dd), np.float16)
    v = dst.allocate((n_rows, bh, dd), np.float16)
    at = 0
    homes = d.k_home.data[0] if d.k_home.device.device_type == DeviceType.MIXED else [d.k_home]
    seg = d.k_home.data[1] if d.k_home.device.device_type == DeviceType.MIXED else [0, bh]
    for s0, s1 in _spans(positions):
        rows = (slice(at, at + s1 - s0), slice(0, bh))
        general_copy(k, rows, d.k_home, (slice(s0, s1), slice(0, bh)))
        general_copy(v, rows, d.v_home, (slice(s0, s1), slice(0, bh)))
        at += s1 - s0
        for part, c0, c1 in zip(homes, seg[:-1], seg[1:]):
            if part is None or c1 == c0 or part.device is dst:
                continue  # nothing on that device, or already on the compute device: no copy crosses a link
            name = _home_name(part)
            stats.bytes_moved[name] = stats.bytes_moved.get(name, 0) + 2 * (s1 - s0) * (c1 - c0) * dd * 2
            stats.requests[name] = stats.requests.get(name, 0) + 2
    stats.spans += len(_spans(positions))
    attn.env.disk.synchronize()  # the disk copy threads' spans are in
    importlib.import_module("flexgen.flex_opt").torch.cuda.synchronize()  # (a no-op under the CPU patches)
    return k, v


def _query(attn, hidden, weight_read_buf) -> torch.Tensor:
    """The layer's query for the step, q: [B, H, 1, D] (layer norm, then the query projection)."""
    import torch.nn.functional as F
    w = [x[0].data for x in weight_read_buf.val]  # w_q, b_q, w_k, b_k, w_v, b_v, w_out, b_out, w_ln, b_ln
    x = hidden.val.data  # x: [B, 1, h]
    b, _, h = x.shape
    heads = attn.config.n_head
    xn = F.layer_norm(x.float(), (h,), weight=w[8].float(), bias=w[9].float())
    q = F.linear(xn, w[0].float(), bias=w[1].float())  # q: [B, 1, h] (unscaled: the softmax is per head)
    return q.view(b, 1, heads, h // heads).transpose(1, 2)


def _supported(attn) -> bool:
    p = attn.policy
    return not (p.compress_cache or p.compress_weight or p.cpu_cache_compute) and p.attn_sparsity >= 1.0


def _load_cache(self, cache_home, cache_read_buf, i):
    """Hooked SelfAttention.load_cache: a decode step's cache is read in forward, once selected."""
    if _state["config"] is None or i == 0 or not _supported(self):
        return _state["originals"]["load_cache"](self, cache_home, cache_read_buf, i)
    k_home, v_home = cache_home.val
    cache_read_buf.store(((_Deferred(k_home, v_home), False), (None, False)))


def _forward(self, hidden, cache_read_buf, weight_read_buf, attention_mask, cache_write_buf, i, k):
    """Hooked SelfAttention.forward: select and copy a decode step's blocks, attend them with
    upstream's own forward, then add the new keys to the summaries."""
    from flexgen.pytorch_backend import TorchTensor
    from flexgen.utils import ValueHolder
    config, original = _state["config"], _state["originals"]["forward"]
    if config is None or not _supported(self):
        return original(self, hidden, cache_read_buf, weight_read_buf, attention_mask, cache_write_buf, i, k)
    mask = attention_mask.val.data  # mask: [B, S] on the compute device
    b, s = mask.shape
    if i == 0:  # prefill: fresh summaries for this cache
        _sums[cache_read_buf] = _Summaries(self.task.prompt_len + self.task.gen_len, b * self.config.n_head,
                                           self.config.input_dim // self.config.n_head, b, config.run,
                                           torch.float16, self.compute.dev)
    summ = _sums[cache_read_buf]
    st = _state["stats"]
    st.summary_bytes = max(st.summary_bytes, sum(x.nbytes for x in _sums.values()))
    deferred = cache_read_buf.val[0][0] if i > 0 and cache_read_buf.val else None
    if isinstance(deferred, _Deferred):
        cache_read_buf.pop()
        blocks = pick_blocks(_query(self, hidden, weight_read_buf), summ, mask, config)
        bs, sealed = config.block_size, (s - 1) // config.block_size
        rows = [p for blk in blocks for p in range(blk * bs, blk * bs + bs)] + list(range(sealed * bs, s - 1))
        kk, vv = _gather(self, deferred, rows, len(rows) + 1, st)
        cache_read_buf.store(((kk, True), (vv, True)))
        keep = rows + [s - 1]
        compact = ValueHolder()
        compact.store(TorchTensor.create_from_torch(mask[:, keep].contiguous(), attention_mask.val.device))
        read, valid = int(mask[:, rows].sum()), int(mask[:, :s - 1].sum())
        st.calls, st.tokens_read, st.tokens_valid = st.calls + 1, st.tokens_read + read, st.tokens_valid + valid
        st.blocks_total, st.blocks_selected = st.blocks_total + sealed, st.blocks_selected + len(blocks)
        st.per_call.append((s - 1, read, valid))
        attention_mask = compact
    out = original(self, hidden, cache_read_buf, weight_read_buf, attention_mask, cache_write_buf, i, k)
    k_new = cache_write_buf.val[0].data  # k_new: [n, B*H, D] (the prompt, or the step's token)
    new = mask if i == 0 else torch.ones(b, 1, dtype=torch.bool, device=mask.device)
    summ.add(k_new, new, 0 if i == 0 else s - 1)
    return out


def apply_sparpr(policy: SparPR | None = None, block_size: int = 64, **knobs) -> SparPRConfig:
    """Make upstream FlexGen's decode steps move and attend only SparPR's selected blocks (this
    process; call again to change the knobs, `remove_sparpr()` to undo). policy: the engine's SparPR
    object, or its knobs as keyword arguments (keep_ratio, min_keep, recent_blocks, summary_tokens;
    SparPR's own defaults and checks). Works with or without `apply_cpu_patches()`. keep_ratio 1.0
    leaves upstream's outputs bit-identical."""
    if policy is not None and knobs:
        raise ValueError("give a SparPR policy or its knobs, not both")
    config = SparPRConfig(policy if policy is not None else SparPR(**knobs), block_size)
    flex = importlib.import_module("flexgen.flex_opt")
    if _state["originals"] is None:
        _state["originals"] = {"load_cache": flex.SelfAttention.load_cache, "forward": flex.SelfAttention.forward}
        flex.SelfAttention.load_cache, flex.SelfAttention.forward = _load_cache, _forward
    _state["config"] = config
    _state["stats"] = HookStats()
    return config


def remove_sparpr() -> None:
    """Restore upstream's own cache loading and attention."""
    if _state["originals"] is not None:
        flex = importlib.import_module("flexgen.flex_opt")
        flex.SelfAttention.load_cache = _state["originals"]["load_cache"]
        flex.SelfAttention.forward = _state["originals"]["forward"]
        _state["originals"] = None
    _state["config"] = None
    _sums.clear()


def sparpr_stats() -> HookStats:
    """What the hook read since the last apply_sparpr."""
    return _state["stats"]
