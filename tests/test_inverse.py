"""Damped inverses: the Cholesky path, the eigendecomposition fallback, and its single warning."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_spdkfac import KFACPreconditioner
from lightning_spdkfac.kfac.inverse import pi_split, robust_inverses


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
        pre.inverter.update(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pre.inverter.update(1)  # second failure: no second warning
    assert torch.isfinite(layer.A_inv).all()


# ---------------------------------------------------------------- the block damping convention
def _psd(n: int, scale: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g, dtype=torch.float64)  # rank 3 < n: zero eigenvalues
    return scale * (x @ x.T)


def _damped_block(A: torch.Tensor, G: torch.Tensor, damping: float) -> torch.Tensor:
    dA, dG = (float(d) for d in pi_split(A, G, damping))
    return torch.kron(A + dA * torch.eye(A.shape[0], dtype=A.dtype), G + dG * torch.eye(G.shape[0], dtype=G.dtype))


@pytest.mark.parametrize("damping", [1e-4, 1e-2, 1.0])
def test_pi_split_damps_the_block_by_lambda_not_lambda_squared(damping):
    """Where A and G are both singular, the damped block's smallest eigenvalue is the damping itself
    (per-factor damping would give damping**2), and nowhere is it below that."""
    A, G = _psd(5, 1e-2, 0), _psd(4, 30.0, 1)
    smallest = torch.linalg.eigvalsh(_damped_block(A, G, damping)).min().item()
    assert smallest == pytest.approx(damping, rel=1e-6)


def test_pi_split_depends_on_the_block_only():
    """A (x) G = (cA) (x) (G/c): the damped block is the same whichever way the scale is split."""
    A, G = _psd(5, 1.0, 2), _psd(4, 1.0, 3)
    ref = _damped_block(A, G, 1e-2)
    for c in (1e-3, 7.0, 1e4):
        torch.testing.assert_close(_damped_block(c * A, G / c, 1e-2), ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("traces", [(0.0, 3.0), (2.0, 0.0), (float("nan"), 1.0), (1.0, float("inf")), (-1.0, 2.0)])
def test_pi_split_falls_back_to_an_even_split_where_a_trace_is_unusable(traces):
    A, G = torch.eye(4) * traces[0] / 4, torch.eye(3) * traces[1] / 3
    dA, dG = pi_split(A, G, 0.04)
    assert (float(dA), float(dG)) == (pytest.approx(0.2), pytest.approx(0.2))


def test_robust_inverses_takes_one_damping_per_factor():
    A = _psd(4, 1.0, 4)
    invs, fallbacks = robust_inverses([A, A], [0.1, 2.0], torch.float64)
    assert not fallbacks
    for inv, d in zip(invs, (0.1, 2.0)):
        torch.testing.assert_close(inv, torch.linalg.inv(A + d * torch.eye(4, dtype=torch.float64)))
    with pytest.raises(ValueError, match="damping: got 1 values for 2 factors"):
        robust_inverses([A, A], [0.1], torch.float64)


def test_a_fallback_on_a_grouped_factor_names_the_range_of_its_block_dampings():
    """A grouped convolution's factors are stacks of one block per group, each pi-balanced on its own: the Cholesky
    fallback's warning shows the A dampings as their range over the blocks (computed here from the traces)."""
    model = nn.Sequential(nn.Conv2d(4, 4, 3, groups=2))
    damping = 1e-2
    pre = KFACPreconditioner(model, damping=damping, inv_update_steps=1)
    layer = pre.layers["0"]
    n = 4 // 2 * 9 + 1  # a group's input channels times the kernel, and the bias
    bad = torch.full((n,), 4.0)
    bad[0] = -50.0  # one strongly negative eigenvalue: Cholesky of the damped block fails
    layer.A = torch.stack([torch.eye(n), torch.diag(bad)])
    layer.G = torch.stack([torch.eye(2), 4.0 * torch.eye(2)])
    # pi = sqrt((tr A / n) / (tr G / 2)) per block; A's damping is pi * sqrt(damping)
    pis = [((1.0 / 1.0) ** 0.5), ((float(bad.sum()) / n / 4.0) ** 0.5)]
    low, high = sorted(p * damping**0.5 for p in pis)
    shown = f"{low:.3g}-{high:.3g} over its 2 blocks"
    assert low != high
    with pytest.warns(UserWarning) as record:
        pre.inverter.update(0)
    texts = [str(w.message) for w in record if "Cholesky of the damped A factor failed" in str(w.message)]
    assert len(texts) == 1 and "layer '0'" in texts[0], [str(w.message) for w in record]
    assert f"(damping {damping:g}, {shown} on this factor)" in texts[0], texts[0]
    assert pre.inverse_fallbacks >= 1 and torch.isfinite(layer.A_inv).all()
