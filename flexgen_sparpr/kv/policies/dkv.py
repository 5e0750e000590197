"""DKV: cold KV blocks stored as anchor + low-rank delta, attended in low-rank form.

Anchor + low-rank differential compression of cold KV blocks, low-rank decode scoring,
log-sum-exp merge of partial attentions (seed 001; docs/dkv.md)."""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ...models.layers import attention_with_lse, merge_attention
from ...storage.tiers import Tier
from ...utils.threads import intra_op_threads, threads_back
from ..block_table import BlockTable
from ..dkv.attention import lowrank_blocks, lowrank_merge
from ..dkv.codec import PICKS, DKVCodec
from ..dkv.exact_routed import exact_blocks, split_route
from ..dkv.importance import FOLLOW, WINDOW, hint_sealed_blocks
from ..dkv.prefill import block_sparse_prefill
from ..dkv.state import DKVState, cache_cold, copies_window, fixed_rows
from ..knobs import KnobError, at_least, knob, knobs, one_of
from ..policy import KVPolicy
from .base import masked_mean_keys


@dataclass(eq=False)
class DKV(KVPolicy):
    """DKV, "Anchor + Low-Rank Differential KV-Cache Compression for Scalable Long-Context
    Inference" (seed 001). Every sealed block is stored encoded (kv/dkv/codec.py: anchor, rank-r
    joint K|V SVD delta, `residuals` exact rows) on its home tier; the last `recent_blocks`
    sealed blocks, the first `sink_blocks` and the open block stay exact. A decode step attends

      window:    the exact sink and recent blocks, the open block and the new token,
      residuals: every cold block's exact residual rows,
      low-rank:  the `topk` cold blocks (per sequence) whose exact mean key scores highest,
                 scored and summed in low-rank space (kv/dkv/attention.py), residual rows masked,

    and merges the three by log-sum-exp. `topk` = 0 routes every cold block. With `exact_routed`
    E > 0 the E routed blocks of most mass are read raw from copies the engine keeps on
    `exact_home` and attended exactly instead (kv/dkv/exact_routed.py). With
    `sparse_prefill` the prefill is block-sparse (kv/dkv/prefill.py). `residual_pick` says which
    rows a block keeps exact: the worst-reconstructed ("error"), the ones the prompt's last
    `pick_window` queries attend most, or follow within `pick_follow` tokens what they attend
    ("attention", kv/dkv/importance.py; prefill blocks only, blocks sealed during decode fall back
    to "error"), or half each ("mixed")."""

    name = "dkv"
    reuses_prefix = False  # its decode attention keeps its own copies of the newest rows (not built for a cut-back cache)
    knob_prefix = "dkv"  # --dkv-rank ...: the same knobs serve --cold-codec dkv
    block: int = knob(256, "tokens per DKV block; with DKV in use this is the KV block size unless "
                      "--block-size is given", block_size=True)
    rank: int = knob(32, "rank of the joint K|V SVD delta")
    residuals: int = knob(16, "exact residual tokens per block")
    topk: int = knob(8, "compressed blocks each query attends in low-rank form; 0 = all")
    recent_blocks: int = knob(1, "sealed blocks kept exact besides the open one", dest="dkv_recent")
    sink_blocks: int = knob(1, "the first sealed blocks also kept exact (the attention sinks and the chat "
                            "template every query reads)")
    sparse_prefill: bool = knob(False, "block-sparse prefill attention (sink, local and top-k blocks per "
                                "query block)")
    prefill_topk: int = knob(8, "with --dkv-sparse-prefill: top-k key blocks per query block")
    dense_layers: int = knob(0, "the first layers keep an exact cache (as Quest leaves its first two)")
    route: str = knob("lowrank", "how the top-k blocks are found: their attention mass scored in low-rank "
                      "space, or their exact mean key", choices=("lowrank", "mean"))
    residual_pick: str = knob("attention", "which rows a block keeps exact: the worst-reconstructed (error), "
                              "the ones the prompt's last queries attend most or that follow what they attend "
                              "(attention; prompt blocks only, later blocks by error), or half each (mixed)",
                              metavar="{" + ",".join(PICKS) + "}")
    pick_window: int = knob(WINDOW, "the prompt's last queries that score tokens for the attention pick")
    pick_follow: int = knob(FOLLOW, "a token inherits the attention pick's score of this many tokens before it")
    exact_routed: int = knob(0, "of the routed blocks, the ones with the most attention mass that a step reads "
                             "raw and attends exactly (per sequence; the engine keeps a raw copy of every block "
                             "on --dkv-exact-home); 0 = none, the paper's DKV")
    exact_home: str = knob("cpu", "where the raw copies for --dkv-exact-routed live (disk needs --offload-dir)",
                           choices=("cpu", "disk"))
    decode_threads: int = knob(1, "CPU threads for the decode attention's small operations (~150 torch calls "
                               "a layer-step), which lose more to splitting across threads than they gain "
                               "(its two large fused attention calls keep torch's setting); 0 = torch's "
                               "setting for all (no effect on a GPU)")

    attends = True  # the engine hands this policy the whole decode attention

    def __post_init__(self):
        for name in ("block", "rank", "residuals", "topk", "recent_blocks", "sink_blocks", "prefill_topk",
                     "dense_layers", "pick_window", "pick_follow", "decode_threads", "exact_routed"):
            at_least(self, name, 1 if name in ("block", "rank", "pick_window") else 0)
        one_of(self, "route", ("lowrank", "mean"))
        one_of(self, "residual_pick", PICKS)
        one_of(self, "exact_home", ("cpu", "disk"))
        self._state: weakref.WeakKeyDictionary[BlockTable, DKVState] = weakref.WeakKeyDictionary()
        self.counts = {"steps": 0, "cold_blocks": 0, "routed_blocks": 0, "residual_tokens": 0,
                       "window_tokens": 0, "exact_routed_blocks": 0}
        self._bytes: tuple[int, int] | None = None  # (dense, encoded) bytes of one block

    @classmethod
    def matrix_knobs(cls, keep: float) -> dict:
        """keep 1: full rank, every row exact, every block routed (what dense attention reads)."""
        return {"rank": 10 ** 6, "residuals": 10 ** 6, "topk": 0} if keep >= 1 else \
            {"rank": 2, "residuals": 1, "topk": 1}

    def check_block_size(self, block_size: int) -> None:
        """A rank or an exact-row count above the block would be clamped by the codec: refused."""
        for name in ("rank", "residuals"):
            if getattr(self, name) > block_size:
                raise KnobError(name, f"{getattr(self, name)} is above the {block_size}-token KV block "
                                f"(--dkv-block / --block-size); it can be at most {block_size}")

    def check_width(self, width: int) -> None:
        """A rank above a token's K|V row (width values) would be clamped by the codec: refused."""
        if self.rank > width:
            raise KnobError("rank", f"{self.rank} is above the model's {width} values per token (K and V "
                            f"of every KV head); it can be at most {width}")

    def exact_rows_share(self, block_size: int) -> float:
        return self.residuals / block_size

    def codec(self, block_shape: tuple[int, ...], dtype: torch.dtype, layer: int) -> DKVCodec | None:
        """How the engine stores this policy's sealed blocks (on every tier): raw in dense layers."""
        return None if layer < self.dense_layers else DKVCodec(block_shape, dtype, self.rank, self.residuals,
                                                               residual_pick=self.residual_pick,
                                                               exact_recent=self.recent_blocks,
                                                               exact_first=self.sink_blocks)

    def raw_copies(self, layer: int) -> Tier | None:
        """With exact_routed: every block of an encoded layer also raw on exact_home."""
        return Tier(self.exact_home) if self.exact_routed and layer >= self.dense_layers else None

    def host_share(self, block_size: int, dtype_bytes: int) -> float:
        """The raw copies, when they live in host memory: the whole raw K+V."""
        return 1.0 if self.exact_routed and self.exact_home == "cpu" else 0.0

    # --- state ---
    def attach(self, table: BlockTable, layer: int) -> None:
        if table in self._state:
            return
        if isinstance(table.store.codec, DKVCodec):
            self._bytes = (table.store.raw.nbytes, table.store.codec.nbytes)
        _, b, hkv, bs, d = table.block_shape
        mean = torch.zeros(table.capacity // bs, b, hkv, d, dtype=torch.float32, device=table.devices.compute)
        st = self._state[table] = DKVState(mean)
        ref = weakref.ref(st)

        def on_seal(block: int, kv: torch.Tensor) -> None:
            s = ref()
            if s is None:
                return
            s.forget_from(block)
            pos = block * bs + torch.arange(bs, device=kv.device)
            pads = s.pads if s.pads is not None else torch.zeros(b, dtype=torch.long, device=kv.device)
            valid = (pos[None, :] >= pads[:, None])[:, None]  # valid: [B, 1, bs]
            s.mean[block] = masked_mean_keys(kv[0].float()[:, :, None], valid)[0][0, :, :, 0]
        table.on_seal.append(on_seal)

    def on_prefill(self, table: BlockTable, layer: int, q, k, valid) -> None:
        self.attach(table, layer)
        st, bs = self._state[table], table.bs
        st.pads = (~valid).sum(dim=1).to(table.devices.compute)  # pads: [B]
        st.epoch += 1
        sealed = table.length // bs
        if sealed and table.length == k.shape[2]:  # means over valid tokens only, now that pads are known
            keys = k[:, :, :sealed * bs].float().unflatten(2, (sealed, bs))  # keys: [B, Hkv, n, bs, D]
            mean, _ = masked_mean_keys(keys, valid[:, :sealed * bs].unflatten(1, (sealed, bs)))  # [n, B, Hkv, 1, D]
            st.mean[:sealed] = mean[:, :, :, 0]
        hint_sealed_blocks(table, q, k, valid, self.pick_window, self.pick_follow)  # query-aware residual rows

    def _pads(self, table: BlockTable, pads: torch.Tensor | None) -> torch.Tensor:
        if pads is not None:
            return pads
        return torch.zeros(table.block_shape[1], dtype=torch.long, device=table.devices.compute)

    # --- prefill ---
    def prefill(self, table: BlockTable, layer: int, q, k, v, valid) -> torch.Tensor | None:
        """Block-sparse prefill attention when enabled and worthwhile, else None (dense causal).
        q: [B, H, S, D]; k, v: [B, Hkv, S, D]; valid: [B, S] or None."""
        if not self.sparse_prefill or q.shape[2] <= (self.prefill_topk + 2) * table.bs:
            return None
        return block_sparse_prefill(q, k, v, valid, table.bs, self.prefill_topk)

    # --- decode ---
    def attend(self, table: BlockTable, layer: int, q, k, v, pads):
        """One decode step. q: [B, H, 1, D]; k, v: [B, Hkv, 1, D] the new token; pads: [B] or None.
        Returns (o: [B, H, 1, D], store jobs)."""
        with intra_op_threads(self.decode_threads, q.device) as outside:
            return self._attend(table, layer, q, k, v, pads, outside)

    def _attend(self, table: BlockTable, layer: int, q, k, v, pads, wide: int | None = None):
        """attend's step; `wide`: the intra-op threads for its large fused attention calls."""
        if layer < self.dense_layers:
            jobs = table.append(k, v)
            kv, pos = table.gather()
            valid = pos[None, :] >= self._pads(table, pads)[:, None]  # valid: [B, T]
            with threads_back(wide, q.device):
                return merge_attention([attention_with_lse(q, kv[0], kv[1], valid)]).to(q.dtype), jobs
        if not isinstance(table.store.codec, DKVCodec):
            raise ValueError("the dkv policy attends tables the engine built with its codec "
                             "(it cannot take over a cache prefilled under another policy)")
        self.attach(table, layer)
        jobs = table.append(k, v)  # seals a block when full (its mean key kept by the hook)
        st, bs = self._state[table], table.bs
        pads = self._pads(table, pads)
        sealed = table.length // bs
        recent = list(range(max(0, sealed - self.recent_blocks), sealed))
        sinks = [b for b in range(min(self.sink_blocks, sealed)) if b not in recent]
        window = sinks + recent  # the exact sealed blocks
        fold = copies_window(q.device)  # the window blocks and the open block attended from `fixed`
        copied = window if fold else []
        live = [] if fold else window + ([table.num_blocks - 1] if table.length % bs else [])
        views = table.views(live)  # the exact blocks attended where they live: kv: [2, B, Hkv, T, D]; pos: [T]
        first = len(sinks)
        cold = list(range(first, sealed - len(recent)))
        low = []
        if cold:
            for job in jobs:  # a block sealed by this very append must be encoded before it is read
                job()
            jobs = []
            codec: DKVCodec = table.store.codec
            p = codec.parts(table.rows(cold))  # leading [n]
            self._cache_cold(st, p, first, bs, q.shape[3], pads)
            kk = len(cold) if self.topk == 0 else min(self.topk, len(cold))
            c, lse = lowrank_blocks(q, p, st.usable_mask, wide)  # c: [n, B, H, r]; lse: [B, n, H] every block alone
            route = None if kk == len(cold) else self._route(q, lse, st.mean[first:], kk)  # route: [B, K]
            if self.exact_routed and table.raw_copies is not None:  # the top routed blocks read raw
                top, rest = split_route(lse, route, self.exact_routed)  # top: [B, E]; rest: [B, K-E]
                low = [exact_blocks(q, table.raw_copies, top, first, st.usable)]
                low += [lowrank_merge(q, p, c, lse, rest)] if rest.shape[1] else []
                self.counts["exact_routed_blocks"] += top.shape[1]
            else:
                low = [lowrank_merge(q, p, c, lse, route)]  # the routed blocks merged
            self.counts["routed_blocks"] += kk
            self.counts["residual_tokens"] += st.res_k.shape[2]
            self.counts["cold_blocks"] += len(cold)
        self.counts["steps"] += 1
        self.counts["window_tokens"] += len(copied) * bs + sum(pos.shape[0] for _, pos in views) + \
            (table.length % bs if fold else 0)
        fixed = self._fixed(st, table, copied, sealed, bool(cold), pads, (k, v) if fold else None)
        with threads_back(wide, q.device):
            exact = [attention_with_lse(q, *fixed)] if fixed else []
        exact += [attention_with_lse(q, kv[0], kv[1], pos[None, :] >= pads[:, None]) for kv, pos in views]
        return merge_attention(exact + low).to(q.dtype), jobs

    _fixed = staticmethod(fixed_rows)  # (module functions: kv/dkv/state.py; tests patch them here)
    _cache_cold = staticmethod(cache_cold)

    def _route(self, q, lse: torch.Tensor, mean: torch.Tensor, kk: int) -> torch.Tensor:
        """Per sequence, the K compressed blocks to attend in low-rank form (route: [B, K] block
        indices among the n cold ones): by attention mass in low-rank space (route "lowrank", from
        every block's log mass per head lse: [B, n, H], lowrank_blocks), or by the exact mean key against
        the query summed over heads (route "mean"; mean: [>= n, B, Hkv, D] from the first cold block)."""
        if self.route == "lowrank":
            mass = lse.logsumexp(dim=2)  # mass: [B, n] summed over heads
        else:
            b, h, _, d = q.shape
            hkv = mean.shape[2]
            qg = q.float().view(b, hkv, h // hkv, d).sum(dim=2)  # qg: [B, Hkv, D]
            mass = torch.einsum("bgd,nbgd->bn", qg, mean[:lse.shape[1]])  # mass: [B, n]
        return mass.topk(kk, dim=1).indices  # route: [B, K]

    def stats(self) -> dict | None:
        """JSON-able: knobs and what the decode steps attended (summed over layers and batches)."""
        config = {k.name: getattr(self, k.name) for k in knobs(type(self))}  # every knob, as set
        blocks = {"dense_bytes": self._bytes[0], "dkv_bytes": self._bytes[1],
                  "ratio": self._bytes[0] / self._bytes[1]} if self._bytes else None
        return {"policy": self.name, "config": config, "block_bytes": blocks, "totals": dict(self.counts)}
