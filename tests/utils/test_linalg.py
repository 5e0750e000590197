"""utils/linalg.eigh: the float64 second solve of items the float32 solver returned as NaN, and
of a batch it refused to converge on."""
from __future__ import annotations

import pytest
import torch

from flexgen_sparpr.kv.dkv.codec import DKVCodec
from flexgen_sparpr.utils import linalg


def _gram(b: int = 3, n: int = 12) -> torch.Tensor:
    x = torch.randn(b, n, 20)
    return x @ x.mT  # [b, n, n]


def test_equals_torch_eigh_when_the_solver_is_clean():
    torch.manual_seed(0)
    m = _gram()
    lam, vec = linalg.eigh(m)
    ref_lam, ref_vec = torch.linalg.eigh(m)
    assert torch.equal(lam, ref_lam) and torch.equal(vec, ref_vec)


def _nan_on(items: set[int]):
    """A float32 eigh that returns NaN for the given batch items, as MKL's did on 2 threads."""
    real = torch.linalg.eigh

    def fake(m):
        lam, vec = real(m)
        if m.dtype == torch.float32:
            lam, vec = lam.clone(), vec.clone()
            for i in items:
                lam[i, -2:], vec[i, 0, -1] = float("nan"), float("nan")
        return lam, vec
    return fake


def test_nan_items_are_solved_again_in_float64(monkeypatch):
    torch.manual_seed(1)
    m = _gram(4)
    ref_lam, ref_vec = torch.linalg.eigh(m.double())
    monkeypatch.setattr(torch.linalg, "eigh", _nan_on({1, 3}))
    lam, vec = linalg.eigh(m)
    assert lam.dtype == torch.float32 and lam.isfinite().all() and vec.isfinite().all()
    torch.testing.assert_close(lam, ref_lam.float(), rtol=1e-4, atol=1e-3)
    for i in (1, 3):  # the re-solved items: float64's eigenvectors (up to sign)
        torch.testing.assert_close((vec[i] * ref_vec[i].float()).sum(0).abs(), torch.ones(12), atol=1e-4, rtol=0)
    clean_lam, clean_vec = torch.linalg.eigh(m)  # (the fake only spoils items 1 and 3)
    assert torch.equal(vec[[0, 2]], clean_vec[[0, 2]]) and torch.equal(lam[[0, 2]], clean_lam[[0, 2]])


def test_a_matrix_that_is_not_finite_is_refused():
    m = _gram(2)
    m[1, 0, 0] = float("inf")
    with pytest.raises(FloatingPointError, match="not finite"):
        linalg.eigh(m)


def test_dkv_encode_gives_a_finite_block_when_the_solver_fails(monkeypatch):
    """The failure it guards: a NaN basis would turn the block's every score into NaN."""
    torch.manual_seed(2)
    shape = (2, 2, 3, 16, 8)  # [planes, B, Hkv, bs, D]: bs 16 < F 48, the Gram of rows
    c = DKVCodec(shape, torch.float32, rank=4, residuals=2)
    kv = torch.randn(shape)
    clean = c.decode(c.encode(kv))
    monkeypatch.setattr(torch.linalg, "eigh", _nan_on({0}))
    got = c.decode(c.encode(kv))
    assert got.isfinite().all()
    torch.testing.assert_close(got, clean, atol=1e-3, rtol=1e-3)


def _refuse_float32():
    """A float32 eigh that raises as MKL's did on a DKV block's Gram with 65 zero rows."""
    real = torch.linalg.eigh

    def fake(m):
        if m.dtype == torch.float32:
            raise torch.linalg.LinAlgError("linalg.eigh: (Batch element 1): The algorithm failed to converge")
        return real(m)
    return fake


def test_a_batch_the_solver_refuses_is_solved_in_float64(monkeypatch):
    torch.manual_seed(3)
    m = _gram(3)
    ref_lam, ref_vec = torch.linalg.eigh(m.double())
    monkeypatch.setattr(torch.linalg, "eigh", _refuse_float32())
    lam, vec = linalg.eigh(m)
    assert lam.dtype == vec.dtype == torch.float32
    torch.testing.assert_close(lam, ref_lam.float())
    torch.testing.assert_close(vec, ref_vec.float())


def test_dkv_encode_with_many_exact_rows_survives_a_refusing_solver(monkeypatch):
    """64 of 256 rows kept exact (zeroed before the refit): the encode still gives the block."""
    torch.manual_seed(4)
    shape = (2, 2, 3, 256, 64)  # F = 384 > bs: the Gram of rows, 65 of them zero at the refit
    c = DKVCodec(shape, torch.float32, rank=32, residuals=64, residual_pick="error")
    kv = torch.randn(shape)
    clean = c.decode(c.encode(kv))
    monkeypatch.setattr(torch.linalg, "eigh", _refuse_float32())
    got = c.decode(c.encode(kv))
    torch.testing.assert_close(got, clean, atol=1e-3, rtol=1e-3)
