"""Cost models the planners reason with: one collective (alpha-beta) and one factor inversion.

The models and their fits are pure functions of plain Python numbers, so every rank that is given the
same measurements (broadcast by rank 0) derives bit-identical models and therefore identical plans.
Only :func:`measure_inverse_seconds` touches torch, to time real inversions on this process's device.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import validation as val
from ..factor_shapes import ShapeLike, as_shape, blocks
from ..vocabulary import INVERSE_METHODS

__all__ = [
    "AlphaBeta",
    "InverseCost",
    "fit_alpha_beta",
    "fit_inverse_cost",
    "measure_inverse_cost",
    "measure_inverse_seconds",
]


@dataclass(frozen=True)
class AlphaBeta:
    """Time of one collective (all-reduce or broadcast) of ``nbytes``: ``alpha + beta * nbytes``.

    ``alpha`` is the start-up latency in seconds, ``beta`` the seconds per byte. The paper's fit for
    fp32 all-reduce on 64 GPUs is alpha = 9.29e-4 s and beta = 1.4335e-9 s per *element*, that is
    ``AlphaBeta(9.29e-4, 1.4335e-9 / 4)`` per byte.
    """

    alpha: float
    beta: float

    def __post_init__(self) -> None:
        val.check_real("alpha", self.alpha, val.Bound(low=0.0))
        val.check_real("beta", self.beta, val.Bound(low=0.0))

    def time(self, nbytes: float) -> float:
        """Modelled seconds of one collective of ``nbytes`` bytes."""
        return self.alpha + self.beta * val.check_real("nbytes", nbytes, val.Bound(low=0.0))


def fit_alpha_beta(nbytes: Sequence[float], seconds: Sequence[float]) -> AlphaBeta:
    """Least-squares fit of :class:`AlphaBeta` to measured (message size, seconds) pairs.

    Both parameters are constrained to be non-negative: when the unconstrained line has a negative
    intercept (or slope), that parameter is set to 0 and the other one is refitted alone, which is the
    exact non-negative least-squares solution for two parameters. At least two distinct sizes are needed.
    """
    x = val.check_reals("nbytes", nbytes, val.Bound(low=0.0))
    y = val.check_reals("seconds", seconds, val.Bound(low=0.0))
    val.check_same_length("nbytes", x, "seconds", y)
    if len(set(x)) < 2:
        raise ValueError(f"nbytes must hold at least 2 distinct sizes to fit alpha and beta, got {sorted(set(x))}")
    m = len(x)
    scale = max(x)  # sizes in [0, 1] keep the sums well conditioned
    x = [a / scale for a in x]
    mx, my = sum(x) / m, sum(y) / m
    sxx = sum((a - mx) ** 2 for a in x)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    beta = sxy / sxx
    alpha = my - beta * mx
    if beta < 0.0:  # times do not grow with size: a constant is the best non-negative fit
        alpha, beta = my, 0.0
    elif alpha < 0.0:  # a line through the origin: minimise sum (beta*x - y)^2
        alpha, beta = 0.0, max(sum(a * b for a, b in zip(x, y)) / sum(a * a for a in x), 0.0)
    if not math.isfinite(beta / scale):
        raise ValueError(f"nbytes span too small a range to fit beta (largest size {scale!r})")
    return AlphaBeta(alpha=alpha, beta=beta / scale)


@dataclass(frozen=True)
class InverseCost:
    """Seconds to invert one damped ``n x n`` factor: ``c0 + c1 * n + c2 * n**2 + c3 * n**3``.

    Why a polynomial with non-negative coefficients rather than interpolating the measurements:

    * it is monotone in ``n`` by construction (all terms are non-negative and increasing), so a larger
      factor is never modelled as cheaper, which the greedy placement relies on;
    * it extrapolates with the right asymptotics (Cholesky plus triangular inverse is ``Theta(n^3)``
      flops), whereas a piecewise interpolation has no principled answer outside the profiled sizes;
    * ``c0`` absorbs fixed per-call overhead (kernel launches, allocator), which dominates small factors
      on a GPU, and ``c2`` absorbs the memory-bound middle range where time grows roughly like ``n^2``.

    ``c1`` is not fitted by :func:`fit_inverse_cost`; it exists so that the simulator can plan with the
    original SPD-KFAC code's load metric, which was linear in ``n`` (``InverseCost(c1=1.0)``).
    """

    c0: float = 0.0
    c2: float = 0.0
    c3: float = 0.0
    c1: float = 0.0

    def __post_init__(self) -> None:
        for name in ("c0", "c1", "c2", "c3"):
            val.check_real(name, getattr(self, name), val.Bound(low=0.0))

    @classmethod
    def cubic(cls, n_ref: int, seconds_ref: float, overhead: float = 0.0) -> InverseCost:
        """The model ``overhead + c3 * n**3`` that takes ``seconds_ref`` at ``n_ref``."""
        n = val.check_int("n_ref", n_ref, low=1)
        s = val.check_real("seconds_ref", seconds_ref, val.Bound(low=0.0))
        o = val.check_real("overhead", overhead, val.Bound(low=0.0))
        if o > s:
            raise ValueError(f"overhead must be <= seconds_ref, got overhead={overhead!r} > seconds_ref={seconds_ref!r}")
        return cls(c0=o, c3=(s - o) / float(n) ** 3)

    def time(self, n: int) -> float:
        """Modelled seconds to invert one ``n x n`` damped factor (Cholesky + inverse)."""
        v = float(val.check_int("n", n, low=0))
        return self.c0 + self.c1 * v + self.c2 * v * v + self.c3 * v * v * v

    def time_of(self, shape: ShapeLike) -> float:
        """Modelled seconds to invert one factor of ``shape`` (:mod:`lightning_spdkfac.factor_shapes`; an int n
        is ``(n, n)``): :meth:`time` for a dense factor; ``c0 + c1 * n`` for a diagonal ``(n,)`` one (an
        elementwise reciprocal: one call, linear in n); ``c0 + b * (c1 n + c2 n^2 + c3 n^3)`` for a grouped
        ``(b, n, n)`` one (its b blocks inverted in one batched call: one call's overhead, b blocks' work)."""
        if isinstance(shape, int) and not isinstance(shape, bool):
            return self.time(shape)
        dims = as_shape(shape, "shape")
        v = float(dims[-1])
        if len(dims) == 1:
            return self.c0 + self.c1 * v
        if len(dims) == 2:
            return self.time(dims[-1])
        return self.c0 + blocks(dims) * (self.c1 * v + self.c2 * v * v + self.c3 * v * v * v)


def _solve(mat: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting for a tiny system; None when (nearly) singular."""
    k = len(rhs)
    a = [row[:] + [r] for row, r in zip(mat, rhs)]
    scale = max((abs(a[i][i]) for i in range(k)), default=0.0)
    if scale == 0.0:
        return None
    for col in range(k):
        piv = max(range(col, k), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) <= 1e-12 * scale:
            return None
        a[col], a[piv] = a[piv], a[col]
        for r in range(col + 1, k):
            f = a[r][col] / a[col][col]
            for c in range(col, k + 1):
                a[r][c] -= f * a[col][c]
    out = [0.0] * k
    for r in range(k - 1, -1, -1):
        out[r] = (a[r][k] - sum(a[r][c] * out[c] for c in range(r + 1, k))) / a[r][r]
    return out


def _nnls_small(columns: list[list[float]], target: list[float]) -> list[float]:
    """Exact non-negative least squares for a handful of columns, by trying every support.

    The NNLS optimum is the unconstrained least-squares fit on its own support, so the best feasible
    (all coefficients >= 0) support fit is the optimum. Fits within round-off of each other prefer the
    smaller support, and supports are visited in a fixed order, so the result is deterministic.
    """
    k = len(columns)
    norm = sum(t * t for t in target)
    best: list[float] = [0.0] * k
    best_res = norm
    for size in range(1, k + 1):
        for support in itertools.combinations(range(k), size):
            cols = [columns[j] for j in support]
            gram = [[sum(u * v for u, v in zip(ci, cj)) for cj in cols] for ci in cols]
            rhs = [sum(u * t for u, t in zip(ci, target)) for ci in cols]
            sol = _solve(gram, rhs)
            if sol is None or any(c < 0.0 for c in sol):
                continue
            coef = [0.0] * k
            for j, c in zip(support, sol):
                coef[j] = c
            res = sum((sum(coef[j] * columns[j][i] for j in range(k)) - t) ** 2 for i, t in enumerate(target))
            if res < best_res - 1e-12 * norm:
                best, best_res = coef, res
    return best


def fit_inverse_cost(ns: Sequence[int], seconds: Sequence[float], *, quadratic: bool = True) -> InverseCost:
    """Fit :class:`InverseCost` to measured (factor side, seconds) pairs by non-negative least squares.

    The fit minimises the *relative* error ``sum(((model(n) - t) / t) ** 2)``: inversion times span
    orders of magnitude across factor sizes, and an absolute fit would ignore every small factor, which
    is exactly where the replicate-or-broadcast decision is made. ``quadratic=False`` drops the ``n^2``
    term. Needs at least two distinct sizes and positive times.
    """
    n = val.check_ints("ns", ns, low=1)
    t = val.check_reals("seconds", seconds, val.Bound(low=0.0, low_open=True))
    val.check_same_length("ns", n, "seconds", t)
    if len(set(n)) < 2:
        raise ValueError(f"ns must hold at least 2 distinct sizes to fit an inverse cost, got {sorted(set(n))}")
    scale = float(max(n))  # features in [0, 1] keep the normal equations well conditioned
    powers = (0, 2, 3) if quadratic else (0, 3)
    columns = [[(v / scale) ** p / s for v, s in zip(n, t)] for p in powers]
    coef = _nnls_small(columns, [1.0] * len(t))
    c = {p: cj / scale**p for p, cj in zip(powers, coef)}
    return InverseCost(c0=c[0], c2=c.get(2, 0.0), c3=c[3])


def _sync(device: torch.device, result: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu":
        result[-1, -1].item()  # any other backend: reading a value waits for the work


def _invert_once(spd: torch.Tensor, method: str) -> torch.Tensor:
    """What K-FAC does to one factor: Cholesky and its inverse, or (``"eigen"``) a symmetric eigendecomposition."""
    if method == "eigen":
        evals, evecs = torch.linalg.eigh(spd)
        return torch.cat([evecs, evals.unsqueeze(0)])
    chol, _ = torch.linalg.cholesky_ex(spd)
    return torch.cholesky_inverse(chol)


def measure_inverse_seconds(
    ns: Sequence[int],
    repeats: int = 3,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    method: str = "cholesky",
) -> list[float]:
    """Measured seconds of inverting one damped SPD ``n x n`` matrix, for each ``n`` in ``ns``.

    Times ``torch.linalg.cholesky_ex`` followed by ``torch.cholesky_inverse`` (what the K-FAC layer does
    with ``inverse_method="cholesky"``), or ``torch.linalg.eigh`` (``method="eigen"``, what it does then),
    on a random, well-conditioned SPD matrix built from a fixed seed, after one warm-up call per size;
    returns the median of ``repeats`` runs. Uses no collective: each rank measures its own device, and
    rank 0's numbers should be broadcast before fitting so that every rank plans alike.
    """
    sizes = val.check_ints("ns", ns, low=1)
    reps = val.check_int("repeats", repeats, low=1)
    val.check_choice("method", method, INVERSE_METHODS)
    dev = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    out: list[float] = []
    for n in sizes:
        x = torch.randn(n, n, generator=gen, dtype=torch.float64)
        spd = (x @ x.T / n + 0.1 * torch.eye(n, dtype=torch.float64)).to(device=dev, dtype=dtype)
        _sync(dev, _invert_once(spd, method))  # warm-up: kernels, workspaces, allocator
        runs = []
        for _ in range(reps):
            start = time.perf_counter()
            inv = _invert_once(spd, method)
            _sync(dev, inv)
            runs.append(time.perf_counter() - start)
        out.append(max(statistics.median(runs), math.ulp(0.0)))
    return out


def measure_inverse_cost(
    ns: Sequence[int],
    repeats: int = 3,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    method: str = "cholesky",
) -> InverseCost:
    """:func:`fit_inverse_cost` of :func:`measure_inverse_seconds` (one rank; broadcast before planning)."""
    return fit_inverse_cost(ns, measure_inverse_seconds(ns, repeats=repeats, dtype=dtype, device=device,
                                                        method=method))
