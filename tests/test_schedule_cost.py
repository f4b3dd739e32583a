"""Cost models of the planners: alpha-beta fits, the inversion-time model and its measurement."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_spdkfac.schedule import (
    AlphaBeta,
    InverseCost,
    fit_alpha_beta,
    fit_inverse_cost,
    measure_inverse_seconds,
)

# ----------------------------------------------------------------------------------------- AlphaBeta


def test_alpha_beta_time_is_affine() -> None:
    ab = AlphaBeta(alpha=1e-3, beta=2e-9)
    assert ab.time(0) == 1e-3
    assert ab.time(1e6) == pytest.approx(1e-3 + 2e-3)


@pytest.mark.parametrize("kwargs, name", [({"alpha": -1.0, "beta": 0.0}, "alpha"),
                                          ({"alpha": 0.0, "beta": float("nan")}, "beta")])
def test_alpha_beta_rejects_bad_parameters(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        AlphaBeta(**kwargs)


def test_alpha_beta_rejects_negative_size() -> None:
    with pytest.raises(ValueError, match="nbytes"):
        AlphaBeta(1.0, 1.0).time(-1)


def test_fit_recovers_exact_line() -> None:
    sizes = [0, 1e3, 1e5, 1e6, 1e7, 1e8]
    fit = fit_alpha_beta(sizes, [9.29e-4 + 3.58e-10 * s for s in sizes])
    assert fit.alpha == pytest.approx(9.29e-4, rel=1e-9)
    assert fit.beta == pytest.approx(3.58e-10, rel=1e-9)


def test_fit_recovers_line_from_noisy_data() -> None:
    rng = random.Random(0)
    sizes = [2**k for k in range(10, 28) for _ in range(4)]
    seconds = [(5e-4 + 4e-10 * s) * (1 + rng.uniform(-0.03, 0.03)) for s in sizes]
    fit = fit_alpha_beta(sizes, seconds)
    assert fit.beta == pytest.approx(4e-10, rel=0.05)
    assert fit.alpha == pytest.approx(5e-4, rel=0.2)  # the intercept is the noisier of the two


def test_fit_clamps_negative_intercept_and_refits_slope() -> None:
    # Unconstrained: beta = 0.7, alpha = -0.3. Clamped: alpha = 0, beta = sum(xy)/sum(xx) = 8/14.
    fit = fit_alpha_beta([0, 1, 2, 3], [0.0, 0.0, 1.0, 2.0])
    assert fit.alpha == 0.0
    assert fit.beta == pytest.approx(8 / 14)


def test_fit_clamps_negative_slope_to_a_constant() -> None:
    fit = fit_alpha_beta([1, 2, 3], [3.0, 2.0, 1.0])
    assert fit.beta == 0.0
    assert fit.alpha == pytest.approx(2.0)


@pytest.mark.parametrize(
    "nbytes, seconds, match",
    [
        ([1, 2, 3], [1.0, 2.0], "same length"),
        ([5, 5, 5], [1.0, 2.0, 3.0], "2 distinct"),
        ([1], [1.0], "2 distinct"),
        ([1, 2], [1.0, -2.0], r"seconds\[1\]"),
        ([-1, 2], [1.0, 2.0], r"nbytes\[0\]"),
        ([1, 2], [1.0, float("inf")], r"seconds\[1\]"),
    ],
)
def test_fit_alpha_beta_rejects_bad_input(nbytes: list, seconds: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fit_alpha_beta(nbytes, seconds)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 10**10), min_size=2, max_size=20),
    st.lists(st.floats(0, 10), min_size=20, max_size=20),
)
def test_fit_alpha_beta_is_never_negative(sizes: list[int], seconds: list[float]) -> None:
    if len(set(sizes)) < 2:
        return
    fit = fit_alpha_beta(sizes, seconds[: len(sizes)])
    assert fit.alpha >= 0.0 and fit.beta >= 0.0


# --------------------------------------------------------------------------------------- InverseCost


def test_inverse_cost_cubic_reference_point() -> None:
    model = InverseCost.cubic(4096, 0.08)
    assert model.time(4096) == pytest.approx(0.08)
    assert model.time(2048) == pytest.approx(0.01)
    assert InverseCost.cubic(100, 1.0, overhead=0.5).time(0) == 0.5
    with pytest.raises(ValueError, match="overhead"):
        InverseCost.cubic(100, 1.0, overhead=2.0)
    with pytest.raises(ValueError, match="c3"):
        InverseCost(c3=-1.0)
    with pytest.raises(ValueError, match="n must"):
        model.time(-3)


def test_fit_inverse_cost_recovers_cubic_plus_overhead() -> None:
    ns = [64, 128, 256, 512, 1024, 2048, 4096]
    fit = fit_inverse_cost(ns, [2e-5 + 1.2e-12 * n**3 for n in ns])
    assert fit.c0 == pytest.approx(2e-5, rel=1e-6)
    assert fit.c3 == pytest.approx(1.2e-12, rel=1e-6)
    assert fit.c2 == pytest.approx(0.0, abs=1e-15)
    cubic_only = fit_inverse_cost(ns, [2e-5 + 1.2e-12 * n**3 for n in ns], quadratic=False)
    assert cubic_only.c2 == 0.0 and cubic_only.c3 == pytest.approx(1.2e-12, rel=1e-6)


def test_fit_inverse_cost_recovers_all_three_terms() -> None:
    ns = [32, 100, 300, 1000, 3000]
    fit = fit_inverse_cost(ns, [1e-4 + 3e-9 * n**2 + 5e-13 * n**3 for n in ns])
    assert (fit.c0, fit.c2, fit.c3) == pytest.approx((1e-4, 3e-9, 5e-13), rel=1e-5)


def test_fit_inverse_cost_never_goes_negative() -> None:
    # Times that fall with n would need a negative coefficient; NNLS keeps a constant instead.
    fit = fit_inverse_cost([10, 20, 40], [3.0, 2.0, 1.0])
    assert fit.c0 > 0 and fit.c2 == 0.0 and fit.c3 == 0.0


@pytest.mark.parametrize(
    "ns, seconds, error, match",
    [
        ([1, 2], [1.0], ValueError, "same length"),
        ([8, 8], [1.0, 1.0], ValueError, "2 distinct"),
        ([0, 8], [1.0, 1.0], ValueError, r"ns\[0\]"),
        ([4, 8], [1.0, 0.0], ValueError, r"seconds\[1\]"),
        ([4.5, 8], [1.0, 2.0], TypeError, r"ns\[0\] must be an integer"),  # a wrong type: TypeError
    ],
)
def test_fit_inverse_cost_rejects_bad_input(ns: list, seconds: list, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        fit_inverse_cost(ns, seconds)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 8192), st.floats(1e-6, 10.0)), min_size=2, max_size=12))
def test_fitted_inverse_cost_is_monotone(pairs: list[tuple[int, float]]) -> None:
    ns = [n for n, _ in pairs]
    if len(set(ns)) < 2:
        return
    model = fit_inverse_cost(ns, [s for _, s in pairs])
    grid = [model.time(n) for n in range(0, 9000, 97)]
    assert all(a <= b for a, b in zip(grid, grid[1:]))
    assert fit_inverse_cost(ns, [s for _, s in pairs]) == model  # deterministic


def test_measure_inverse_seconds_is_positive_and_fits() -> None:
    # No comparison of measured times here: this machine is shared and noisy (timings belong in
    # benchmarks). The fit is monotone by construction whatever the measurements are.
    ns = [16, 128, 512]
    seconds = measure_inverse_seconds(ns, repeats=3)
    assert len(seconds) == 3
    assert all(s > 0 for s in seconds)
    model = fit_inverse_cost(ns, seconds)
    assert model.time(512) >= model.time(128) >= model.time(16) > 0


def test_measure_inverse_seconds_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="repeats"):
        measure_inverse_seconds([8], repeats=0)
    with pytest.raises(ValueError, match=r"ns\[0\]"):
        measure_inverse_seconds([0])
