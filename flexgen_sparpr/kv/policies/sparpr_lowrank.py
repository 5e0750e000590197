"""SparPR's low-rank key summaries (`--summary lowrank`): every cached key, projected on its KV head's
main directions, in 4 bits.

Per table and KV head, the r = `rank` directions that carry most of the keys' energy (top
eigenvectors of sum k k^T over the valid keys the basis is fitted on: a prefill's, or the first
ones summarised) and, per direction, one fixed step: the 99.9th percentile of |k . u| over those
keys / 7. A key is stored as its r coordinates, rounded to that step and clamped to [-7, 7] (later
keys outside the range saturate), two to a byte: r / 2 bytes a token and KV head, against
2 D dtype_bytes of K+V: 3/128 of a float16 cache at r = 3 D / 16. The basis (float16) and steps
(float32) are a fixed Hkv r (2 D + 4) bytes per table, whatever the context.

A query scores the cached tokens on these keys exactly as attention would (q . k~ / sqrt(D), per
query head, over its KV head's keys); a block's score sums what it holds: its share of each
query head's softmax over every valid sealed token, summed over heads ("softmax": an estimate of
the attention mass the block would get), or its best token's raw logit summed over heads ("sum").
Left padding never scores (the policy's pads say where it is, so no mask is stored).
Why this form, against the 4-token mean keys it replaced: docs/sparpr.md, "Summary memory".
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ...models.cpu_kernel import kernel as compiled_kernel
from ...utils.linalg import eigh
from .sparpr_int4 import PackedCodes

LEVELS = 7  # codes -7..7 (4 bits, symmetric); stored + 8 as a nibble
FIT_QUANTILE = 0.999  # the step: this quantile of |coordinate| over the fitted keys, not the max (sink keys are outliers)
_MAX_FIT = 1 << 20  # coordinates the quantile looks at, per KV head (torch.quantile's input is bounded)


def rank_for(head_dim: int, share: float) -> int:
    """Directions kept for keys of head_dim values: share x head_dim, rounded down to an even count >= 2."""
    return max(2, int(share * head_dim) // 2 * 2)


def summary_share(share: float, dtype_bytes: int) -> float:
    """Bytes of the summaries per byte of raw K+V (r / 2 bytes against 2 D dtype_bytes a token and
    KV head), the fixed basis left out."""
    return share / (4 * dtype_bytes)


@dataclass(eq=False)
class KeyBasis:
    u: torch.Tensor  # [Hkv, D, r] float16 (stored; used in float32): orthonormal directions per KV head
    step: torch.Tensor  # [Hkv, r] float32: the quantisation step of each direction
    # the directions as a query meets them (made once, at the first step): float32 [Hkv, D, r], the
    # even directions then (odd - 16 even), each scaled by its step and 1 / sqrt(D) (lowrank_block_scores)
    _query: torch.Tensor | None = field(default=None, repr=False)
    _plain: torch.Tensor | None = field(default=None, repr=False)  # [Hkv, D, r]: the int4 kernel's (plain_basis)
    _u32: torch.Tensor | None = field(default=None, repr=False)  # [Hkv, D, r]: u in float32, contiguous (encode_into)

    @property
    def nbytes(self) -> int:
        extra = sum(t.numel() * t.element_size() for t in (self._query, self._plain, self._u32) if t is not None)
        return self.u.numel() * self.u.element_size() + self.step.numel() * self.step.element_size() + extra

    def plain_basis(self) -> torch.Tensor:
        """[Hkv, D, r] float32: the directions scaled for scoring, in direction order (sparpr_int4.py)."""
        if self._plain is None:  # scaled: [Hkv, D, r]
            self._plain = (self.u.float() * (self.step[:, None, :] / math.sqrt(self.u.shape[1]))).contiguous()
        return self._plain

    def query_basis(self) -> torch.Tensor:
        """[Hkv, D, r] float32, contiguous: the even directions and (odd - 16 even), scaled for scoring."""
        if self._query is None:
            scaled = self.plain_basis()  # scaled: [Hkv, D, r]
            even, odd = scaled[..., 0::2], scaled[..., 1::2]
            self._query = torch.cat([even, odd - 16 * even], dim=-1).contiguous()
        return self._query


def fit_basis(keys: torch.Tensor, valid: torch.Tensor, rank: int) -> KeyBasis:
    """keys: [B, Hkv, T, D] float32; valid: [B, T] bool (no valid key: every key counts)."""
    b, hkv, t, d = keys.shape
    w = valid | ~valid.any()  # w: [B, T] the keys that count (all of them when none is valid); no host sync
    x = keys * w[:, None, :, None].to(keys.dtype)  # x: [B, Hkv, T, D], pads zeroed
    m = torch.einsum("bktd,bkte->kde", x, x)  # m: [Hkv, D, D] second moment (uncentred: scores are q . k)
    _, vecs = eigh(m)  # ascending
    u = vecs[:, :, -rank:].flip(-1).half().float()  # u: [Hkv, D, r], strongest first, as stored
    coords = torch.einsum("bktd,kdr->kbtr", keys, u).reshape(hkv, b * t, rank)  # coords: [Hkv, B*T, r]
    coords = coords.masked_fill(~w.reshape(1, -1, 1), math.nan)  # pads leave the quantile (nanquantile)
    if coords.shape[1] > _MAX_FIT:
        coords = coords[:, :: math.ceil(coords.shape[1] / _MAX_FIT)]
    q = coords.abs().transpose(1, 2).nanquantile(FIT_QUANTILE, dim=-1)  # q: [Hkv, r]
    return KeyBasis(u.half(), (q / LEVELS).clamp(min=1e-6))


def encode(keys: torch.Tensor, basis: KeyBasis) -> torch.Tensor:
    """keys: [B, Hkv, T, D] float32 -> codes [B, Hkv, T, r / 2] uint8 (two 4-bit codes a byte)."""
    c = torch.einsum("bktd,kdr->bktr", keys, basis.u.float()) / basis.step[:, None, :]
    c = (c.round().clamp(-LEVELS, LEVELS) + LEVELS + 1).to(torch.uint8)  # c: [B, Hkv, T, r] in 1..15
    return c[..., 0::2] | (c[..., 1::2] << 4)


def encode_into(codes: torch.Tensor, block: int, keys: torch.Tensor, basis: KeyBasis) -> bool:
    """One sealed block's keys [B, Hkv, bs, D] (as the cache holds them) encoded into the table's codes
    [B, Hkv, r / 2, nb, bs] at block by one compiled call (models/lowrank_kernel.cpp; what `encode`
    gives); False where that call does not apply (not the CPU, kernels not built, keys not float): the
    caller encodes with torch."""
    kernel = compiled_kernel()
    if kernel is None or codes.device.type != "cpu" or keys.device.type != "cpu":
        return False
    if basis._u32 is None:
        basis._u32 = basis.u.float().contiguous()
    return kernel.lowrank_encode(keys, basis._u32, basis.step, codes, block)


def nibbles(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes: [..., r / 2] uint8 -> (even directions' codes, odd directions'), each [..., r / 2]
    float32 in 1..15 (the stored nibbles: code + 8)."""
    return (codes & 15).float(), (codes >> 4).float()


def decode(codes: torch.Tensor, basis: KeyBasis) -> torch.Tensor:
    """codes: [B, Hkv, T, r / 2] uint8 -> coordinates [B, Hkv, T, r] float32 (in the basis)."""
    c = torch.stack(nibbles(codes), dim=-1).flatten(-2) - (LEVELS + 1)  # c: [B, Hkv, T, r]
    return c * basis.step[None, :, None, :]


def kernel_scores(q: torch.Tensor, codes: torch.Tensor, head_score: str) -> bool:
    """Whether the compiled CPU kernel scores the blocks (head_score "softmax", the CPU, at most 8
    query heads per KV head, codes read in place: [B, Hkv, r / 2, T] or the table's [B, Hkv, r / 2, nb, bs],
    tokens contiguous; models/cpu_kernel.py says where it is built)."""
    inner = codes.stride(-1) == 1 and (codes.dim() == 4 or codes.stride(3) == codes.shape[4])
    return (head_score == "softmax" and q.device.type == "cpu" and q.shape[1] // codes.shape[1] <= 8
            and inner and compiled_kernel() is not None)


def compiled_block_scores(q: torch.Tensor, codes: torch.Tensor, sealed: int, bs: int, basis: KeyBasis,
                          pad_bias: torch.Tensor | None = None, live: torch.Tensor | None = None) -> torch.Tensor:
    """The compiled kernel's block scores (models/lowrank_kernel.cpp; `kernel_scores` must hold) of the
    first `sealed` blocks of codes [B, Hkv, r / 2, T] or the table's [B, Hkv, r / 2, nb, bs] as they lie,
    for q [B, H, 1, D] as the model gives it: one call, no view made -> [B, sealed]."""
    qk = q if q.dtype == torch.float32 and q.is_contiguous() else q.float().contiguous()
    score = compiled_kernel().lowrank_scores(qk, basis.plain_basis(), codes, pad_bias, bs, sealed)  # score: [B, nb]
    return score if live is None else score.masked_fill(~live, -math.inf)


def lowrank_block_scores(q: torch.Tensor, codes: torch.Tensor, basis: KeyBasis, bs: int, head_score: str,
                         pad_bias: torch.Tensor | None = None, live: torch.Tensor | None = None,
                         packed: PackedCodes | None = None, compiled: bool = False,
                         per_head: bool = False) -> torch.Tensor:
    """q: [B, H, 1, D]; codes: [B, Hkv, r / 2, T] (tokens innermost) of T = nb * bs sealed tokens;
    pad_bias: [B, T] 0 or -inf (None: no left padding); live: [B, nb] blocks holding a valid token
    (None: all); packed: the same codes in the CPU int4 kernel's layout, synced (sparpr_int4.py),
    or None; compiled: score by the compiled CPU kernel (`kernel_scores` must hold; packed unused;
    not per_head) -> [B, nb] (-inf: a block with no valid token), or per_head (head_score
    "softmax"): [B, Hkv, nb], each KV head's query heads' mass alone."""
    b, h, _, d = q.shape
    hkv, t = codes.shape[1], codes.shape[3]
    half = codes.shape[2]
    if compiled:  # one compiled call (models/lowrank_kernel.cpp), the query's coordinates too, float32 throughout
        return compiled_block_scores(q, codes, t // bs, bs, basis, pad_bias, live)
    qg = q.float().view(b, hkv, h // hkv, d)  # qg: [B, Hkv, G, D]
    if packed is not None:  # the kernel reads the packed codes as c - 8: no offset to take off
        logit = packed.logits(torch.matmul(qg, basis.plain_basis()), t)  # logit: [B, Hkv, G, T] bfloat16
    else:
        qs = torch.matmul(qg, basis.query_basis())  # qs: [B, Hkv, G, r] = [qe | qo - 16 qe]
        # q . k~ = sum_j qs_j (c_j - 8), c_j the nibble of direction j (even j low, odd j high). With the
        # byte v = lo + 16 hi: qe . lo + qo . hi = qe . v + (qo - 16 qe) . hi: one product over the stored
        # bytes and their high nibbles (one conversion; no decoded [B, Hkv, T, r] copy)
        logit = torch.matmul(qs, torch.cat([codes, codes >> 4], dim=2).float())  # logit: [B, Hkv, G, T]
        if head_score == "sum":  # the -8 offset is one constant per head: softmax does not see it
            qe, rest = qs[..., :half], qs[..., half:]  # qo = rest + 16 qe
            logit -= (LEVELS + 1) * (17 * qe.sum(dim=-1, keepdim=True) + rest.sum(dim=-1, keepdim=True))
    if pad_bias is not None:
        logit += pad_bias[:, None, None]
    if head_score == "softmax":  # each query head's estimated attention mass per block, summed
        mass = logit.softmax(dim=-1, dtype=torch.float32)  # mass: [B, Hkv, G, T] (float32 whatever logit's dtype)
        if per_head:
            score = mass.sum(dim=2).view(b, hkv, t // bs, bs).sum(dim=-1)  # score: [B, Hkv, nb]
            return score if live is None else score.masked_fill(~live[:, None], -math.inf)
        score = mass.sum(dim=(1, 2)).view(b, t // bs, bs).sum(dim=-1)  # [B, nb] (two sums: 2x faster than one over (1, 3))
    else:  # the block's best token, its logits summed over the query heads
        score = logit.sum(dim=(1, 2), dtype=torch.float32).view(b, t // bs, bs).amax(dim=-1)  # [B, nb]
    return score if live is None else score.masked_fill(~live, -math.inf)
