"""DKV's per-block basis from one eigh of the smaller Gram matrix equals the truncated SVD's:
the same subspace (so the same projection, errors, residual rows and reconstruction), whichever
of rows and columns is fewer, and rank-deficient blocks stay finite and exact."""
from __future__ import annotations

import pytest
import torch

from flexgen_sparpr.kv.dkv.codec import DKVCodec


def svd_basis(x: torch.Tensor, r: int) -> torch.Tensor:
    """The reference: top-r right singular vectors, in float64."""
    _, _, vh = torch.linalg.svd(x.double(), full_matrices=False)
    return vh[:, :r].mT


def spectrum_block(b, n, f, r, seed, gap=True):
    """[b, n, f] with singular values 10 ... 1 for the first r directions, then 1e-2 (a gap at
    r, so the top-r subspace is well defined) or a smooth tail."""
    g = torch.Generator().manual_seed(seed)
    k = min(n, f)
    u = torch.linalg.qr(torch.randn(b, n, k, generator=g, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(b, f, k, generator=g, dtype=torch.float64))[0]
    s = torch.linspace(10, 1, r, dtype=torch.float64)
    tail = torch.full((k - r,), 1e-2, dtype=torch.float64) if gap else torch.linspace(0.9, 0.1, k - r).double()
    return (u * torch.cat([s, tail]) @ v.mT).float()


def codec(bs, hkv, d, rank):
    return DKVCodec((2, 2, hkv, bs, d), torch.float32, rank=rank, residuals=4)


@pytest.mark.parametrize("bs, hkv, d", [(64, 3, 64), (256, 3, 64), (16, 2, 16), (8, 2, 16)])  # rows < and >= columns
def test_gram_basis_spans_the_svd_subspace(bs, hkv, d):
    c = codec(bs, hkv, d, rank=6)
    x = spectrum_block(2, bs, 2 * hkv * d, c.rank, seed=bs)
    got, ref = c._basis(x).double(), svd_basis(x, c.rank)
    torch.testing.assert_close(got @ got.mT, ref @ ref.mT, rtol=0, atol=1e-5)  # the same projector
    torch.testing.assert_close(got.mT @ got, torch.eye(c.rank, dtype=torch.float64).expand(2, -1, -1),
                               rtol=0, atol=1e-5)  # orthonormal columns


@pytest.mark.parametrize("bs, hkv, d", [(64, 3, 64), (16, 2, 16)])
def test_gram_basis_gives_the_svd_reconstruction_error_without_a_gap(bs, hkv, d):
    """A smooth spectrum (no gap: the subspace itself is ill-defined), as real KV blocks have:
    the per-row projection errors, which pick the residual rows, still agree."""
    c = codec(bs, hkv, d, rank=8)
    x = spectrum_block(2, bs, 2 * hkv * d, c.rank, seed=1, gap=False).double()
    err = lambda v: (x - x @ v @ v.mT).square().sum(-1)  # noqa: E731  [B, bs]
    torch.testing.assert_close(err(c._basis(x.float()).double()), err(svd_basis(x, c.rank)), rtol=1e-4, atol=1e-5)


def test_rank_deficient_block_is_exact_and_finite():
    """Fewer directions than the rank: the extra columns are zero (not noise divided by ~0)."""
    c = codec(32, 2, 16, rank=8)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 32, 3, generator=g) @ torch.randn(2, 3, 64, generator=g)  # x: [B, bs, F] of rank 3
    v = c._basis(x)
    assert torch.isfinite(v).all()
    torch.testing.assert_close(x @ v @ v.mT, x, rtol=0, atol=1e-4)


def test_codec_round_trip_equals_the_svd_codec(monkeypatch):
    """Whole encode/decode: the same residual rows and the same reconstruction as with SVD."""
    c = codec(64, 3, 64, rank=8)
    g = torch.Generator().manual_seed(5)
    kv = torch.randn(2, 2, 3, 64, 64, generator=g) @ torch.randn(64, 64, generator=g) * 0.1
    got_row = c.encode(kv)
    monkeypatch.setattr(c, "_basis", lambda x: svd_basis(x, c.rank).float())
    ref_row = c.encode(kv)
    assert torch.equal(c.parts(got_row).res_idx, c.parts(ref_row).res_idx)
    torch.testing.assert_close(c.decode(got_row), c.decode(ref_row), rtol=0, atol=1e-4)
