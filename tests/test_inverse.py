"""Damped inverses: the Cholesky path, the eigendecomposition fallback, and its single warning."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_spdkfac import KFACPreconditioner
from lightning_spdkfac.kfac.inverse import robust_inverses


def damped_inverses(factors, damping, dtype):
    """robust_inverses with only the indices of the factors Cholesky did not invert."""
    inverses, fallbacks = robust_inverses(factors, damping, dtype)
    return inverses, [fb.index for fb in fallbacks]


def spd(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3 * n, n, generator=g)
    return x.T @ x / (3 * n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cholesky_path_matches_dense_inverse(dtype):
    f = spd(7)
    (inv,), failed = damped_inverses([f], 0.01, dtype)
    assert failed == [] and inv.dtype == dtype
    want = torch.linalg.inv(f.double() + 0.01 * torch.eye(7, dtype=torch.float64))
    torch.testing.assert_close(inv.double(), want, rtol=1e-4, atol=1e-5)
    assert torch.equal(f, spd(7))  # the stored factor is not damped in place


def test_indefinite_factor_falls_back_to_clamped_eigendecomposition():
    q, _ = torch.linalg.qr(torch.randn(4, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    evals = torch.tensor([2.0, 1.0, 0.0, -0.5], dtype=torch.float64)
    f = (q * evals) @ q.T  # one negative eigenvalue: Cholesky of f + 0.1 I fails
    good = spd(4)
    invs, failed = damped_inverses([good, f.float()], 0.1, torch.float32)
    assert failed == [1]
    want = (q / (evals.clamp(min=0) + 0.1)) @ q.T  # negative eigenvalue clamped to 0, then damped
    torch.testing.assert_close(invs[1].double(), want, rtol=1e-4, atol=1e-4)
    assert torch.isfinite(invs[1]).all()


def test_singular_factor_without_damping_stays_finite():
    f = torch.zeros(5, 5)
    f[0, 0] = 1.0  # rank one, damping 0
    (inv,), failed = damped_inverses([f], 0.0, torch.float32)
    assert failed == [0] and torch.isfinite(inv).all()


def test_fallback_warns_once_per_layer():
    model = nn.Sequential(nn.Linear(3, 2))
    pre = KFACPreconditioner(model, damping=0.0, inv_update_steps=1)
    layer = pre.layers["0"]
    layer.A = torch.diag(torch.tensor([1.0, -1.0, 1.0, 1.0]))
    layer.G = torch.eye(2)
    with pytest.warns(UserWarning, match=r"layer '0'.*Cholesky of the damped A factor failed"):
        pre._update_inverses(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pre._update_inverses(1)  # second failure: no second warning
    assert torch.isfinite(layer.A_inv).all()
