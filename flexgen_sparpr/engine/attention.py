"""The attention step of one layer for one GPU batch: it only attends (what it reads is
engine/cell.py's; the new token joins the cache there)."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..kv.block_table import BlockTable
from ..models.cpu_kernel import usable as kernel_usable
from ..models.layers import attention_with_lse, decode_attention, kernel_decode, kernel_decode_parts, merge_attention
from ..models.topk_attention import topk_sparse_attention
from ..storage.tiers import Tier


def pads_valid(pos, pads) -> torch.Tensor | None:
    """[B, S] validity of prefill tokens under left padding (None: no padding)."""
    if pads is None:
        return None
    s = pos.shape[1]
    return torch.arange(s, device=pos.device)[None, :] >= pads[:, None]


def step_valid(pos, mask, pads) -> torch.Tensor | None:
    """Which of a step's read tokens (the new one last) each sequence attends: pos: [T+1] or [B, T+1];
    mask: [B, Hkv, T] or None; pads: [B] or None. Returns [B, T+1], [B, Hkv, T+1] or None (all)."""
    valid = None if pads is None else (pos if pos.dim() == 2 else pos[None, :]) >= pads[:, None]  # [B, T+1]
    if mask is not None:
        if valid is None:
            valid = torch.ones(mask.shape[0], pos.shape[-1], dtype=torch.bool, device=pos.device)
        keep = torch.cat([mask, mask.new_ones(*mask.shape[:2], 1)], dim=-1)  # keep: [B, Hkv, T+1]
        valid = valid[:, None, :] & keep  # valid: [B, Hkv, T+1]
    return valid


def decode_attention_step(q, kv, pos, mask, pads, *, sparsity: float = 1.0, rows=None) -> torch.Tensor:
    """One new token. q: [B, H, 1, D]; kv: [2, B, Hkv, T+1, D] the tokens read, the new one last;
    pos: [T+1] their cache positions, or [B, T+1] each sequence's own; mask: [B, Hkv, T] the tokens
    each sequence and KV head attends (None: all); pads: [B] left-pad counts or None. rows: [1|B, T+1]
    or None: kv is a whole resident cache read in place and these are the rows attended (pos).
    Returns o: [B, H, 1, D]."""
    valid = step_valid(pos, mask, pads)
    if sparsity < 1:
        return topk_sparse_attention(q, kv[0], kv[1], valid, sparsity)
    return decode_attention(q, kv[0], kv[1], valid, rows)


def with_resident_blocks(table: BlockTable, resident: list[int], q, rest: list, pads,
                         landed: tuple[list[int], torch.Tensor] | None = None) -> torch.Tensor:
    """A whole-cache read split by where the blocks live (engine/cell.py `resident_split`): the
    resident sealed blocks attended in place in the compute arena, the disk blocks where they landed
    (landed: their ids and [B, n, planes, Hkv, bs, D] as read), both by the compiled kernel reading
    their rows, and the rest: (k, v: [B, Hkv, T, D], valid: [B, T], [B, Hkv, T] or None) parts
    (`gathered_rest` or `open_block_part`), as decode_attention_step would: one softmax, one kernel
    call over the parts (merged by log-sum-exp where the rest is not the kernel's). q: [B, H, 1, D].
    Returns o: [B, H, 1, D]."""
    bs, dev = table.bs, q.device
    parts = [(k, v, valid, None) for k, v, valid in rest]
    if resident:
        arena = table.store.resident_arena()  # arena: [2, B, Hkv, cap, D]
        slots = [table.store.slots[b] for b in resident]
        if slots == list(range(slots[0], slots[0] + len(slots))):  # adjacent slots: a view, no row list
            arena, rows = arena[:, :, :, slots[0] * bs:(slots[0] + len(slots)) * bs], None
        else:
            rows = (torch.tensor(slots, device=dev)[:, None] * bs + torch.arange(bs, device=dev)).flatten()[None]
        parts.append((arena[0], arena[1], _blocks_valid(table, resident, pads), rows))
    if landed:
        k, v, rows = blockwise_kv(landed[1])
        parts.append((k, v, _blocks_valid(table, landed[0], pads), rows))
    if all(kernel_usable(q, k, v) for k, v, _ in rest):  # one kernel call over every part
        return kernel_decode_parts(q, parts)
    return merge_attention([attention_with_lse(q, k, v, valid) for k, v, valid in rest] +
                           [kernel_decode(q, *p) for p in parts[len(rest):]]).to(q.dtype)


def gathered_rest(kv, pos, mask, pads) -> list:
    """with_resident_blocks' rest as gathered: kv: [2, B, Hkv, T+1, D], the new token last (pos: [T+1];
    mask: None or [B, Hkv, T])."""
    return [(kv[0], kv[1], step_valid(pos, mask, pads))]


def open_block_part(table: BlockTable, block: int, rows: int, pads) -> list:
    """with_resident_blocks' rest read where it is filled, once the step's new token is appended:
    the first `rows` tokens of `block` (the open block before the append, the new token last) in
    its buffer or arena slot, nothing gathered. Read before the next append reuses the buffer."""
    kv = table.store.writable(block)[:, :, :, :rows]  # kv: [2, B, Hkv, rows, D]
    first = block * table.bs
    valid = None if pads is None else \
        torch.arange(first, first + rows, device=pads.device)[None, :] >= pads[:, None]  # valid: [B, rows]
    return [(kv[0], kv[1], valid)]


def blockwise_kv(blocks: torch.Tensor):
    """Blocks as read from a disk file, [B, n, 2, Hkv, bs, D] (any strides but the last two dims'
    rows of D), as the decode kernel reads them: (k, v: [B, Hkv, R, D] views of the same memory, rows:
    [1, n * bs] the row of each token, block after block)."""
    b, n, _, hkv, bs, d = blocks.shape
    sb, sn, sp, sh, st, sd = blocks.stride()
    assert st == d and sd == 1 and sn % d == 0, "each token a contiguous row of D"
    r = (n - 1) * (sn // d) + bs  # rows up to the last block's last token
    k = blocks.as_strided((b, hkv, r, d), (sb, sh, d, 1), blocks.storage_offset())
    v = blocks.as_strided((b, hkv, r, d), (sb, sh, d, 1), blocks.storage_offset() + sp)
    return k, v, _block_rows(n, sn // d, bs, blocks.device)


@functools.lru_cache(maxsize=64)
def _block_rows(n: int, stride: int, bs: int, device: torch.device) -> torch.Tensor:
    """[1, n * bs] the row of each token of n blocks `stride` rows apart (the same every layer)."""
    rows = torch.arange(n, device=device)[:, None] * stride + torch.arange(bs, device=device)  # rows: [n, bs]
    return rows.flatten()[None]


def _blocks_valid(table: BlockTable, blocks: list[int], pads) -> torch.Tensor | None:
    """[B, n * bs] validity of sealed blocks' tokens under left padding (None: no padding)."""
    return None if pads is None else table.positions(blocks, pads.device)[None] >= pads[:, None]


def append_attention(table: BlockTable, q, k, v) -> torch.Tensor:
    """A prefill onto a kept cache (engine/reuse.py): q: [B, H, S, D] and the new k, v: [B, Hkv, S, D]
    attend every cached token (read from its tier) and, causally, each other; no left padding (one
    sequence). Returns o: [B, H, S, D]."""
    kv, _ = table.gather()  # kv: [2, B, Hkv, T, D]
    t, s = kv.shape[3], q.shape[2]
    keys, values = torch.cat([kv[0], k], dim=2), torch.cat([kv[1], v], dim=2)  # [B, Hkv, T+S, D]
    mask = torch.ones(s, t + s, dtype=torch.bool, device=q.device).tril(diagonal=t)  # mask: [S, T+S]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def split_by_home(table: BlockTable, q, k, v, pads):
    """FlexGen's --cpu-cache-compute: attend the CPU-homed blocks on the CPU (only the query
    crosses the link), the rest on the compute device with the new token k, v: [B, Hkv, 1, D]
    (not yet appended), and merge by log-sum-exp. Returns o: [B, H, 1, D]."""
    nb = table.num_blocks
    on_cpu = [b for b in range(nb) if table.homes[b] == Tier.CPU and table.block_len(b) == table.bs]
    cpu_set = set(on_cpu)
    rest = [b for b in range(nb) if b not in cpu_set]
    parts = []
    kv, pos = table.gather(rest)
    kv = torch.cat([kv, torch.stack([k, v])], dim=3)  # + the new token
    pos = torch.cat([pos, torch.tensor([table.length], device=pos.device)])
    if pads is None:
        pads = torch.zeros(q.shape[0], dtype=torch.long, device=q.device)
    parts.append(attention_with_lse(q, kv[0], kv[1], pos[None, :] >= pads[:, None]))
    if on_cpu:
        qc, pc = q.cpu(), pads.cpu()
        table.devices.counters.add("compute", "cpu", qc.nbytes)
        for b in on_cpu:
            blk = table.store.on_host(b)  # blk: [2, B, Hkv, bs, D] on the host
            bpos = torch.arange(b * table.bs, (b + 1) * table.bs)
            o, lse = attention_with_lse(qc, blk[0], blk[1], bpos[None, :] >= pc[:, None])
            parts.append((o.to(q.device), lse.to(q.device)))
    return merge_attention(parts).to(q.dtype)

