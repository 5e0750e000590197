"""DKV's per-table state: what a decode step would otherwise rebuild from the encoded rows every
step (the cold blocks' residual rows and usable tokens, the exact rows attended as one tensor),
brought up to date only when a block seals, a prefill changes the blocks or the table is rewound."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...models.layers import KeyMask, key_mask
from ..block_table import BlockTable
from .attention import residual_kv
from .codec import DKVParts


def copies_window(device: torch.device) -> bool:
    """Whether a step attends a copy of the exact sink and recent blocks, the residual rows and the
    open block together (one attention call instead of three; each step writes its new token into
    the copy): on the CPU, where a call's fixed cost is that of ~200 attended tokens; not on a GPU,
    where the call is cheap and the copy's memory is not."""
    return device.type == "cpu"


@dataclass(eq=False)
class DKVState:
    """Per table: exact mean keys of sealed blocks (routing), and what a decode step would
    otherwise rebuild from the encoded rows every step (the cold blocks' exact residual rows and
    which of their tokens the low-rank part attends): it changes only when a block is encoded, so
    it grows by one block at a time and is cut back when a rewind re-seals a block."""

    mean: torch.Tensor  # [num_blocks, B, Hkv, D] float32
    pads: torch.Tensor | None = None  # [B]
    cached: int = 0  # cold blocks held below
    first: int = 0  # the first of them (after the exact sink blocks)
    res_k: torch.Tensor | None = None  # [B, Hkv, n*m, D] their residual rows' keys ...
    res_v: torch.Tensor | None = None  # [B, Hkv, n*m, D] ... values
    res_ok: torch.Tensor | None = None  # [B, n*m] valid (not left padding)
    usable: torch.Tensor | None = None  # [n, B, bs] valid tokens that are not residual rows
    usable_mask: KeyMask | None = None  # of usable, for the low-rank attention
    res_pos: torch.Tensor | None = None  # [B, n*m] their positions
    # the exact rows a step reads, as one tensor made again when a block seals: the residual rows
    # (res_k, res_v are views into it) and, where copies_window, a copy of the exact blocks and
    # room for the open block's bs tokens at its end (`tail`), filled one token a step
    fixed: tuple[torch.Tensor, torch.Tensor, KeyMask] | None = None  # k, v: [B, Hkv, T, D]; ok of [B, T]
    fixed_key: tuple | None = None  # what `fixed` was made for
    tail: int = 0  # where the open block's room starts in `fixed`
    tail_at: int = -1  # the table's length when its open block was last written there
    epoch: int = 0  # seals and prefills so far (either may rewrite what `fixed` holds)

    def forget_from(self, block: int) -> None:
        self.epoch += 1
        if block < self.cached:
            self.cached = 0  # a re-sealed block: rebuild from the rows (rare: rewinds)


def fixed_rows(st: DKVState, table: BlockTable, window: list[int], sealed: int, cold: bool, pads: torch.Tensor,
           new: tuple[torch.Tensor, torch.Tensor] | None = None):
    """A copy of the exact sealed blocks `window`, (cold) the cold blocks' residual rows and
    (new given) room for the open block as one k, v: [B, Hkv, T, D] and a KeyMask of [B, T] (not
    padding, written), made again only when a block seals, the blocks change or the table is
    rewound; None when there is nothing. new: k, v [B, Hkv, 1, D], the token this step just
    appended, written into the open block's room (one token a step)."""
    bs = table.bs
    key = (st.epoch, sealed, tuple(window), st.cached if cold else -1, st.first, table.rewinds, new is None)
    if st.fixed_key == key and (new is None or st.tail_at == table.length - 1):
        if new is not None:  # the step's token into its slot
            fk, fv, mask = st.fixed
            j = st.tail + (table.length - 1) % bs
            fk[:, :, j:j + 1].copy_(new[0])
            fv[:, :, j:j + 1].copy_(new[1])
            mask.valid[:, j] = True
            if mask.additive is not None:  # (None: no fused CPU kernel; the valid mask serves)
                mask.additive[..., j] = 0.0
            st.tail_at = table.length
        return st.fixed
    runs = table.views(window)  # [(kv: [2, B, Hkv, T, D], pos: [T])]
    ks, vs = [kv[0] for kv, _ in runs], [kv[1] for kv, _ in runs]
    oks = [pos[None, :] >= pads[:, None] for _, pos in runs]  # each [B, T]
    dt = ks[0].dtype if ks else table.store.raw.dtype
    if cold:
        ks, vs, oks = ks + [st.res_k.to(dt)], vs + [st.res_v.to(dt)], oks + [st.res_ok]
    st.tail = sum(x.shape[2] for x in ks)
    if new is not None:  # the open block's room: its tokens so far, then unwritten (masked)
        b, hkv, _, d = new[0].shape
        tk, tv = (torch.zeros(b, hkv, bs, d, dtype=dt, device=pads.device) for _ in range(2))
        tok = torch.zeros(b, bs, dtype=torch.bool, device=pads.device)
        for kv, pos in table.views([table.num_blocks - 1] if table.length % bs else []):
            tk[:, :, :pos.shape[0]], tv[:, :, :pos.shape[0]] = kv[0], kv[1]
            tok[:, :pos.shape[0]] = pos[None, :] >= pads[:, None]
        ks, vs, oks = ks + [tk], vs + [tv], oks + [tok]
        st.tail_at = table.length
    st.fixed = None if not ks else (ks[0], vs[0], key_mask(oks[0])) if len(ks) == 1 else \
        (torch.cat(ks, dim=2), torch.cat(vs, dim=2), key_mask(torch.cat(oks, dim=1)))  # one piece: no copy
    if cold:  # the residual rows held once: in `fixed`, just before the open block's room
        fk, fv, _ = st.fixed
        start, end = st.tail - st.res_k.shape[2], st.tail
        st.res_k, st.res_v = fk[:, :, start:end], fv[:, :, start:end]
    st.fixed_key = key
    return st.fixed


def cache_cold(st: DKVState, p, first: int, bs: int, d: int, pads: torch.Tensor) -> None:
    """Bring the per-table cache of cold blocks' residual rows and usable tokens up to the n
    blocks of p (parts with leading [n], blocks first .. first + n - 1): only the blocks encoded
    since the last step."""
    n = p.anchor.shape[0]
    if st.cached > n or st.first != first:
        st.cached, st.first = 0, first
    if st.cached == n:
        return
    c0 = st.cached
    ids = torch.arange(first + c0, first + n, device=pads.device)
    sub = DKVParts(*(getattr(p, f)[c0:] for f in DKVParts.__dataclass_fields__))  # leading [n - c0]
    rk, rv, rpos = residual_kv(sub, ids, bs, d)  # rk, rv: [B, Hkv, (n-c0)*m, D]; rpos: [B, (n-c0)*m]
    tok = ids[:, None] * bs + torch.arange(bs, device=pads.device)  # tok: [n-c0, bs]
    usable = (tok[:, None] >= pads[None, :, None]).scatter_(  # usable: [n-c0, B, bs]
        2, sub.res_idx.long(), False)  # residual rows are attended exactly
    if c0:
        rk, rv = torch.cat([st.res_k, rk], dim=2), torch.cat([st.res_v, rv], dim=2)
        rpos, usable = torch.cat([st.res_pos, rpos], dim=1), torch.cat([st.usable, usable], dim=0)
    st.res_k, st.res_v, st.res_pos, st.usable = rk.contiguous(), rv.contiguous(), rpos, usable
    st.res_ok = rpos >= pads[:, None]
    st.usable_mask = key_mask(usable)
    st.cached = n
