"""DKV's block codec: one KV block as an exact anchor token, a rank-r joint K|V truncated-SVD
delta, and exact residual tokens (DKV, seed 001; docs/dkv.md).

A block kv: [2, B, Hkv, bs, D] is, per sequence, a matrix X: [bs, F] with F = 2 * Hkv * D
(the K of every KV head, then the V of every KV head: one basis serves both). With a the anchor
row (the row nearest the block's mean), X - a ~= C @ W^T, C: [bs, r] coefficients, W: [F, r] the
top-r right singular vectors of X - a with its K and V halves each scaled to unit RMS (scales
folded back into W's rows). m rows are kept exact (residuals), and the basis is then fit again to
the other rows (`refit`). Which rows (`residual_pick`): "error", the m rows the first fit
reconstructs worst; "attention" (default), the m rows with the largest query-aware importance
handed to encode (kv/dkv/importance.py: the attention mass the prompt's last queries give a
token or the few tokens before it); "mixed", ceil(m/2) by importance, the rest by error. Without
an importance (blocks sealed during decode) every pick is "error".

Bytes of one encoded block (the `nbytes` formula; e = the dtype's size, 4-byte indices):
    B * [ (F + F * r + bs * r + m * F) * e  [padded to 8]  +  (m + 1) * 4 ]  [padded to 8]
The row is B sub-rows, one per sequence, each holding that sequence's fields: over n rows, a
field's (block, sequence) axes then merge into one axis of stride sub-row (kv/dkv/attention.py
reads every block of every sequence with one batched matmul, in place).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...storage.codec import Codec
from ...utils.linalg import eigh


@dataclass
class DKVParts:
    """Views into encoded rows; every field has the rows' leading dims `...`."""

    anchor: torch.Tensor  # [..., B, F]
    basis: torch.Tensor  # [..., B, F, r]
    coeffs: torch.Tensor  # [..., B, bs, r]
    res_rows: torch.Tensor  # [..., B, m, F]
    res_idx: torch.Tensor  # [..., B, m] int32 token index within the block (ascending)
    anchor_idx: torch.Tensor  # [..., B] int32


def _align(n: int, to: int = 8) -> int:
    return -(-n // to) * to


PICKS = ("error", "attention", "mixed")
# a Gram eigenvalue below this share of the largest is float32 rounding, not a direction (a
# direction that weak holds under 1e-5 of the block's energy)
_GRAM_EPS = 1e-5


class DKVCodec(Codec):
    """Encodes a KV block into one flat uint8 row of fixed size `nbytes` (see the module doc)."""

    compressed = True

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, rank: int = 32, residuals: int = 16,
                 refit: bool = True, residual_pick: str = "attention", exact_recent: int = 0,
                 exact_first: int = 0):
        planes, b, hkv, bs, d = shape
        if planes != 2:
            raise ValueError("DKV encodes K and V together (planes = 2)")
        if rank < 1 or residuals < 0:
            raise ValueError(f"DKV needs rank >= 1 and residuals >= 0 (got {rank}, {residuals})")
        if residual_pick not in PICKS:
            raise ValueError(f"DKV residual_pick must be one of {', '.join(PICKS)} (got {residual_pick!r})")
        self.residual_pick = residual_pick
        self.takes_hints = residual_pick != "error"  # the other picks read the token importance (encode)
        self.exact_recent = exact_recent  # the newest sealed blocks also kept exact (lossy: the recency window)
        self.exact_first = exact_first  # ... and the first ones (the attention sinks every query reads)
        self.shape, self.dtype, self.refit = tuple(shape), dtype, refit
        self.batch, self.hkv, self.bs, self.head_dim = b, hkv, bs, d
        self.width = 2 * hkv * d  # F
        self.rank = min(rank, bs, self.width)  # more directions than rows or columns adds nothing
        self.residuals = min(residuals, bs)
        f, r, m, e = self.width, self.rank, self.residuals, torch.empty((), dtype=dtype).element_size()
        counts = [("anchor", (f,)), ("basis", (f, r)), ("coeffs", (bs, r)), ("res_rows", (m, f))]
        self._layout, off = [], 0  # one sequence's sub-row: (field, its shape, dtype, byte offset)
        for name, shp in counts:
            self._layout.append((name, shp, dtype, off))
            off += torch.Size(shp).numel() * e
        off = _align(off)
        for name, shp in (("res_idx", (m,)), ("anchor_idx", ())):
            self._layout.append((name, shp, torch.int32, off))
            off += torch.Size(shp).numel() * 4
        self.seq_nbytes = _align(off)
        self.nbytes = b * self.seq_nbytes

    @staticmethod
    def formula(b: int, hkv: int, bs: int, d: int, rank: int, residuals: int, itemsize: int) -> int:
        """The module doc's byte count, for reports and tests."""
        f = 2 * hkv * d
        r, m = min(rank, bs, f), min(residuals, bs)
        return b * _align(_align((f + f * r + bs * r + m * f) * itemsize) + (m + 1) * 4)

    def dense_nbytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()

    # --- layout ---
    def to_rows(self, kv: torch.Tensor) -> torch.Tensor:
        """kv: [2, B, Hkv, bs, D] -> X: [B, bs, F] (K heads, then V heads)."""
        return kv.permute(1, 3, 0, 2, 4).reshape(self.batch, self.bs, self.width)

    def from_rows(self, x: torch.Tensor) -> torch.Tensor:
        """X: [B, bs, F] -> kv: [2, B, Hkv, bs, D]."""
        return x.view(self.batch, self.bs, 2, self.hkv, self.head_dim).permute(2, 0, 3, 1, 4)

    def parts(self, rows: torch.Tensor) -> DKVParts:
        """rows: [..., nbytes] uint8 -> typed views [..., B, ...] (no copy)."""
        lead = rows.shape[:-1]
        seqs = rows.unflatten(-1, (self.batch, self.seq_nbytes))  # seqs: [..., B, sub-row]
        out = {}
        for name, shp, dt, off in self._layout:
            n = torch.Size(shp).numel() * torch.empty((), dtype=dt).element_size()
            out[name] = seqs[..., off:off + n].view(dt).view(*lead, self.batch, *shp)
        return DKVParts(**out)

    # --- encode / decode ---
    def encode(self, kv: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
        """kv: [2, B, Hkv, bs, D] -> [nbytes] uint8 on kv's device. importance: [B, bs] per-token
        importance for the "attention" and "mixed" picks (None: the rows are picked by error)."""
        x = self.to_rows(kv).float()  # x: [B, bs, F]
        b, bs = self.batch, self.bs
        ar = torch.arange(b, device=x.device)
        anchor_idx = (x - x.mean(dim=1, keepdim=True)).square().sum(-1).argmin(dim=1)  # [B]
        anchor = x[ar, anchor_idx]  # anchor: [B, F]
        delta = x - anchor[:, None]  # delta: [B, bs, F]
        # K and V weigh the same in the SVD and in the residual pick: each half is scaled to unit
        # RMS first; the scale goes back into the basis rows, so X - a ~= C @ basis^T still holds
        half = delta.view(b, bs, 2, self.width // 2)
        scale = half.square().mean(dim=(1, 3), keepdim=True).sqrt().clamp(min=1e-12)  # scale: [B, 1, 2, 1]
        norm = (half / scale).view(b, bs, self.width)
        pick = "error" if importance is None else self.residual_pick
        if importance is not None:
            importance = importance.to(device=x.device, dtype=torch.float32)  # importance: [B, bs]
        ortho = err = None
        if pick != "attention" or not (self.residuals and self.refit):  # the first fit is needed
            ortho = self._basis(norm)  # ortho: [B, F, r]
            err = (norm - norm @ ortho @ ortho.mT).square().sum(-1)  # err: [B, bs] per-row (scaled) squared error
        res_idx = self._pick(pick, err, importance)  # res_idx: [B, m] ascending
        if self.residuals and self.refit:  # the basis need not fit the rows kept exact: fit it to the rest
            ortho = self._basis(norm.scatter(1, res_idx[..., None].expand(-1, -1, self.width), 0.0))
        coeffs = norm @ ortho  # coeffs: [B, bs, r]
        basis = (ortho.view(b, 2, self.width // 2, -1) * scale.view(b, 2, 1, 1)).view(b, self.width, -1)
        res_rows = x[ar[:, None], res_idx]  # res_rows: [B, m, F]
        row = torch.empty(self.nbytes, dtype=torch.uint8, device=kv.device)
        p = self.parts(row)
        p.anchor.copy_(anchor)
        p.basis.copy_(basis)
        p.coeffs.copy_(coeffs)
        p.res_rows.copy_(res_rows)
        p.res_idx.copy_(res_idx)
        p.anchor_idx.copy_(anchor_idx)
        return row

    def _pick(self, pick: str, err: torch.Tensor | None, importance: torch.Tensor | None) -> torch.Tensor:
        """The m residual rows per sequence, ascending: [B, m]. err: [B, bs] reconstruction error
        (None for pick "attention"); importance: [B, bs] (None for pick "error")."""
        m = self.residuals
        if pick == "error":
            return err.topk(m, dim=1).indices.sort(dim=1).values  # the worst-reconstructed rows
        n_imp = m if pick == "attention" else m - m // 2
        top = importance.topk(n_imp, dim=1).indices  # top: [B, n_imp] the rows the prompt's queries read most
        if n_imp < m:  # mixed: the rest are the worst-reconstructed of the other rows
            rest = err.scatter(1, top, float("-inf")).topk(m - n_imp, dim=1).indices  # rest: [B, m - n_imp]
            top = torch.cat([top, rest], dim=1)
        return top.sort(dim=1).values

    def _basis(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, bs, F] -> its top-r right singular vectors [B, F, r] (a zero column for each
        direction past x's numerical rank: it adds nothing to a projection, as SVD's would not).

        From one batched eigh of the smaller Gram matrix, not an SVD: the same subspace
        (tests/kv/test_dkv_basis.py), 7-20x faster on the CPU, and on CUDA a batched Jacobi
        kernel instead of an SVD that loops over the batch with host syncs."""
        r = self.rank
        if x.shape[1] >= x.shape[2]:  # F <= bs: the eigenvectors of x^T x are the right singular vectors
            return eigh(x.mT @ x)[1][..., -r:].flip(-1)  # eigh ascends: the top r, largest first
        lam, u = eigh(x @ x.mT)  # lam: [B, bs] = sigma^2; u: [B, bs, bs] left singular vectors
        lam, u = lam[..., -r:].flip(-1), u[..., -r:].flip(-1)  # lam: [B, r]; u: [B, bs, r]
        live = lam > lam[..., :1] * _GRAM_EPS  # past the rank, u is noise: its v would be too
        v = (x.mT @ u) / lam.clamp(min=torch.finfo(lam.dtype).tiny).sqrt()[..., None, :]  # v = x^T u / sigma
        return v * live[..., None, :]  # v: [B, F, r]

    def exact_rows(self, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[nbytes] uint8 -> (idx: [B, m] int64 token index within the block, kv: [2, B, Hkv, m, D])
        the rows the block keeps exact, copied out of the row (so the row itself can be let go)."""
        p = self.parts(row)
        kv = p.res_rows.view(self.batch, self.residuals, 2, self.hkv, self.head_dim).permute(2, 0, 3, 1, 4)
        return p.res_idx.long(), kv.contiguous()  # kv: [2, B, Hkv, m, D]

    def decode(self, row: torch.Tensor) -> torch.Tensor:
        """[nbytes] uint8 -> kv: [2, B, Hkv, bs, D] (low-rank reconstruction, residual rows exact)."""
        p = self.parts(row)
        x = p.anchor.float()[:, None] + p.coeffs.float() @ p.basis.float().mT  # x: [B, bs, F]
        idx = p.res_idx.long()
        x.scatter_(1, idx[..., None].expand(-1, -1, self.width), p.res_rows.float())
        return self.from_rows(x.to(self.dtype)).contiguous()
