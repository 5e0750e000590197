"""A symmetric eigensolver that does not hand back NaN.

MKL's float32 symmetric eigensolver (behind torch.linalg.eigh on the CPU) returns NaN
eigenvalues and vectors for some ordinary Gram matrices when it runs on more than one thread:
seen with torch 2.13 (MKL 2024.2) on 2 threads of an AMD EPYC, deterministically, for a 256 x 256
Gram of one DKV block's K|V rows, which then encoded to a NaN basis and turned a whole sequence's
decode into <|endoftext|>. The same matrix solves cleanly on one thread and in float64. So
`eigh` solves as asked and solves again, in float64, only the batch items that came back
non-finite. It also refuses some rank-deficient float32 Grams outright ("failed to converge": a
256 x 256 Gram of a DKV block whose 64 exact rows and anchor were zeroed out, 65 zero rows,
on one thread as on two): then the whole batch is solved in float64."""
from __future__ import annotations

import torch


def eigh(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.linalg.eigh (ascending eigenvalues, column eigenvectors) of symmetric m: [..., n, n],
    with items whose result is not finite solved again in float64 and cast back.
    Raises FloatingPointError if an item is still not finite (m itself holds inf or NaN) or the
    float64 solve does not converge either."""
    try:
        lam, vec = torch.linalg.eigh(m)
    except torch.linalg.LinAlgError:  # an item the solver could not converge on: all again in float64
        try:
            l64, v64 = torch.linalg.eigh(m.double())
        except torch.linalg.LinAlgError as e:
            raise FloatingPointError(f"eigh: no convergence in float64 either ({e})") from None
        return l64.to(m.dtype), v64.to(m.dtype)
    flat_lam, flat_vec = lam.reshape(-1, lam.shape[-1]), vec.reshape(-1, *vec.shape[-2:])  # [N, n], [N, n, n]
    bad = ~(flat_lam.isfinite().all(-1) & flat_vec.isfinite().flatten(1).all(-1))  # bad: [N]
    if not bool(bad.any()):
        return lam, vec
    l64, v64 = torch.linalg.eigh(m.reshape(-1, *m.shape[-2:])[bad].double())
    if not (l64.isfinite().all() and v64.isfinite().all()):
        raise FloatingPointError("eigh: the matrix holds values that are not finite")
    flat_lam, flat_vec = flat_lam.clone(), flat_vec.clone()
    flat_lam[bad], flat_vec[bad] = l64.to(lam.dtype), v64.to(vec.dtype)
    return flat_lam.view(lam.shape), flat_vec.view(vec.shape)
