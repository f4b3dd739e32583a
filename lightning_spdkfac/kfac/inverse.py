"""Damped inverses of Kronecker factors: Cholesky first, a clamped eigendecomposition where it fails.

The stored factor is never modified: damping is added to a copy in the inversion dtype.
"""

from __future__ import annotations

import torch


def _damped_copy(factor: torch.Tensor, damping: float, dtype: torch.dtype) -> torch.Tensor:
    m = factor.to(dtype=dtype, copy=True)
    m.diagonal().add_(damping)
    return m


def eigh_inverse(factor: torch.Tensor, damping: float, dtype: torch.dtype) -> torch.Tensor:
    """(F + damping I)^-1 through a symmetric eigendecomposition with clamped eigenvalues.

    Negative eigenvalues (a factor made indefinite by round-off) are clamped to zero before
    damping is added; a relative floor keeps the result finite even with damping=0.
    """
    f = factor.to(torch.float64)
    f = 0.5 * (f + f.T)  # exact symmetry for eigh
    evals, evecs = torch.linalg.eigh(f)
    evals = evals.clamp(min=0.0) + damping
    floor = max(float(evals.max()) * 1e-10, torch.finfo(torch.float64).tiny)
    inv = (evecs / evals.clamp(min=floor)) @ evecs.T
    return inv.to(dtype)


def damped_inverses(
    factors: list[torch.Tensor], damping: float, dtype: torch.dtype
) -> tuple[list[torch.Tensor], list[int]]:
    """Damped inverses of several factors.

    Returns the inverses and the indices of the factors whose Cholesky failed (those were
    inverted with :func:`eigh_inverse`). One host sync for the whole batch, not one per factor.
    """
    if not factors:
        return [], []
    inverses, bad = [], []
    for f in factors:
        L, info = torch.linalg.cholesky_ex(_damped_copy(f, damping, dtype))
        failed_here = info.ne(0)
        # A failed factorization may hold zeros on its diagonal, on which cholesky_inverse
        # raises; put ones there without a host sync (that result is discarded below).
        L.diagonal().masked_fill_(failed_here, 1.0)
        inv = torch.cholesky_inverse(L)
        inverses.append(inv)
        # Cholesky can also "succeed" on a near-singular matrix whose inverse overflows
        # (one pass: a non-finite entry makes the sum non-finite).
        bad.append(failed_here | ~torch.isfinite(inv.sum()))
    failed = torch.stack(bad).nonzero().flatten().tolist()  # the one sync
    for i in failed:
        inverses[i] = eigh_inverse(factors[i], damping, dtype)
    return inverses, failed
