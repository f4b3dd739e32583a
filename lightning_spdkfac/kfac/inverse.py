"""Damped inverses of Kronecker factors, with a fallback ladder for ill-conditioned or indefinite ones.

Each factor F is inverted as (F + damping I)^-1, with its own damping (the preconditioner passes the
pi-balanced split of the layer's damping, :func:`pi_split`), by the first of these levels that gives
a usable result (finite in the inversion dtype):

``"cholesky"``
    Cholesky of the damped copy in the inversion dtype: the healthy path. The factors of a batch
    are grouped by shape (dense ``n x n``, grouped ``b x n x n``, diagonal ``n``); each group is
    stacked, factorized and inverted by one batched call, and the checks of every group are read
    together with one host sync per batch. A factorization is rejected
    when it fails, when its inverse is not finite, or when the damped factor M = F + damping I is
    too ill-conditioned for the inversion dtype: ``max_i M_ii (M^-1)_ii`` above 0.1/eps. That is a
    lower bound (within a factor n) of the condition number of the diagonally scaled matrix
    D^-1/2 M D^-1/2, D = diag(M), which is what governs the accuracy of Cholesky (Demmel 1989; the
    plain condition number of a badly scaled factor can be far larger while Cholesky stays exact),
    so above it the Cholesky inverse's error reaches tens of percent. For PSD F each term is at
    most ``(F_ii + damping) / damping``: healthy factors stay on this path.
``"eigh"``
    A symmetric eigendecomposition in float64 of the symmetrized factor: negative eigenvalues (a
    factor made indefinite by round-off) are clamped to zero, damping is added, and eigenvalues
    below 1e-10 of the largest are raised to that floor, so a singular factor with damping 0 still
    gives a finite inverse.
``"damping"``
    Where the eigendecomposition raises (``torch.linalg.eigh`` can fail to converge) or its inverse
    is not finite in the inversion dtype: the damping is multiplied by 10, up to
    :data:`DAMPING_RETRIES` times, each time trying a float64 Cholesky and then the clamped
    eigendecomposition with that damping. A damping of 0 starts from eps (of the inversion dtype)
    times the factor's mean eigenvalue.
``"identity"``
    Where even that fails (e.g. a factor with non-finite entries, or a zero factor with damping 0):
    ``I / (trace(F)/n + damping)``, the inverse of the factor's isotropic part; ``I / damping`` (or
    ``I``) if that is not a positive finite number.

Every level returns a finite inverse; with damping > 0 its eigenvalues are at most 1/damping, so
the preconditioned gradient stays finite too.

The stored factor is never modified: damping is added to a copy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from . import factors as fx
from .inverse_memory import ALIGNMENT, MAX_STACK_BYTES

LEVELS = ("cholesky", "eigh", "damping", "identity")
DAMPING_RETRIES = 3  # damping x 10, x 100, x 1000
DAMPING_GROWTH = 10.0
COND_LIMIT = 0.1  # Cholesky is rejected where the condition-number bound exceeds COND_LIMIT / eps
EIGH_FLOOR = 1e-10  # eigenvalues of the damped factor below this fraction of the largest are raised to it


# What the preconditioner reports it did instead of Cholesky, per fallback level (messages).
FALLBACK_ACTION = {
    "eigh": "using a clamped eigendecomposition (consider a larger damping)",
    "damping": "the clamped eigendecomposition failed too, so this factor was inverted with damping "
               "{damping:g} (raise damping)",
    "identity": "no damped inverse was finite, so this factor uses a scaled identity I / (trace/n + damping), "
                "which drops its curvature (raise damping; check the factor for non-finite values)",
}


@dataclass(frozen=True)
class Fallback:
    """A factor the Cholesky path did not invert: which, how it was inverted instead, and why."""

    index: int  # position of the factor in the batch
    level: str  # "eigh", "damping" or "identity" (see the module docstring)
    damping: float  # the damping the returned inverse used
    reason: str  # why the previous levels failed, for messages


def pi_split(A: torch.Tensor, G: torch.Tensor,
             damping: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The dampings of A and of G whose Kronecker product is damped by ``damping`` (pi-balanced).

    (A + pi sqrt(damping) I) (x) (G + sqrt(damping) / pi I) = A (x) G + damping I + sqrt(damping)
    (pi I (x) G + A (x) I / pi): in every direction the block's curvature is raised by at least
    ``damping`` (more only where a factor is large), never by just ``damping**2``.
    pi = sqrt((tr A / dim A) / (tr G / dim G)), the ratio of the factors' mean eigenvalues, minimizes
    the cross terms (Martens & Grosse 2015, sec. 6.3); where it is not a positive finite number (a
    zero factor, e.g. a layer whose output got no gradient) pi is 1.

    Returned as two float64 scalars on the factors' device, without a host sync (one per block when the
    factors are grouped: each group's block is balanced on its own). ``damping`` may be a number or a 0-d
    tensor on the factors' device (its square root is then taken there): no host read either way.
    """
    mean_a = fx.mean_eigenvalue(A)
    mean_g = fx.mean_eigenvalue(G)
    pi = (mean_a / mean_g).sqrt()
    pi = torch.where(torch.isfinite(pi) & (pi > 0.0), pi, torch.ones_like(pi))
    root: float | torch.Tensor = (damping.to(torch.float64).sqrt() if isinstance(damping, torch.Tensor)
                                  else math.sqrt(damping))
    return pi * root, root / pi


def diagonal_inverse(factor: torch.Tensor, damping: float | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(diag(f) + damping I)^-1 of a diagonal factor, as its diagonal: negative entries (round-off) clamped to
    zero, and entries below 1e-10 of the largest raised to it as :func:`eigh_inverse` does (a zero factor without
    damping gives ones). Non-finite where the factor is: :func:`robust_inverse` takes that case.

    ``factor`` may also be a ``k x n`` stack of diagonal factors (each row floored on its own), with ``damping``
    a number or a ``k x 1`` tensor."""
    vals = factor.to(dtype).clamp(min=0.0) + (damping.to(dtype) if isinstance(damping, torch.Tensor) else damping)
    return _floored_reciprocal(vals)


def _floored_reciprocal(vals: torch.Tensor) -> torch.Tensor:
    """1 / vals, each row's entries below 1e-10 of its largest raised to that floor (ones where that is 0)."""
    floor = vals.amax(-1, keepdim=True) * EIGH_FLOOR
    vals = torch.where(vals > floor, vals, floor)
    return torch.where(vals > 0.0, vals.reciprocal(), torch.ones_like(vals))


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def eigh_inverse(factor: torch.Tensor, damping: float, dtype: torch.dtype) -> torch.Tensor:
    """(F + damping I)^-1 through a float64 symmetric eigendecomposition with clamped eigenvalues.

    Negative eigenvalues are clamped to zero before damping is added; a floor of 1e-10 times the
    largest eigenvalue keeps the result finite even with damping=0. May raise
    ``torch.linalg.LinAlgError`` (no convergence, or a zero factor with damping 0) or return
    non-finite values (a non-finite factor, or an inverse too large for ``dtype``):
    :func:`robust_inverse` handles both.
    """
    f = factor.to(torch.float64)
    f = 0.5 * (f + f.T)  # exact symmetry for eigh
    evals: torch.Tensor  # torch.linalg's functions are untyped in torch's stubs
    evecs: torch.Tensor
    evals, evecs = torch.linalg.eigh(f)
    evals = evals.clamp(min=0.0) + damping
    top = float(evals.max())
    if not top > 0.0:  # a zero factor without damping: no curvature to invert (1/tiny would overflow later)
        raise torch.linalg.LinAlgError("the factor has no positive eigenvalue and damping is 0")
    inv = (evecs / evals.clamp(min=top * EIGH_FLOOR)) @ evecs.T
    return inv.to(dtype)


def _cholesky_inverse64(factor: torch.Tensor, damping: float, dtype: torch.dtype) -> torch.Tensor | None:
    """(sym(F) + damping I)^-1 by a float64 Cholesky, or None where it fails or is not finite in ``dtype``."""
    f = factor.to(torch.float64)
    f = 0.5 * (f + f.T)
    f.diagonal().add_(damping)
    L, info = torch.linalg.cholesky_ex(f)
    if int(info) != 0:
        return None
    inv = torch.cholesky_inverse(L).to(dtype)
    return inv if _finite(inv) else None


def scaled_identity(factor: torch.Tensor, damping: float, dtype: torch.dtype) -> torch.Tensor:
    """I / (trace(F)/n + damping): the last resort; finite whatever the factor holds."""
    n = factor.shape[0]
    mean = float(factor.to(torch.float64).diagonal().sum()) / max(n, 1)
    denom = mean + damping
    if not (denom > 0.0 and denom < float("inf")) or not (1.0 / denom) < torch.finfo(dtype).max:
        denom = damping if damping > 0.0 else 1.0
    return torch.eye(n, dtype=dtype, device=factor.device) / denom


def robust_inverse(factor: torch.Tensor, damping: float, dtype: torch.dtype,
                   reason: str = "Cholesky was not tried") -> tuple[torch.Tensor, str, float, str]:
    """The fallback ladder below Cholesky for one factor: (inverse, level, damping used, reason).

    ``reason`` says why Cholesky was rejected; it is extended with why each later level failed.
    """
    reasons = [reason]
    if factor.dim() == 1:  # diagonal: a non-finite entry, or an inverse that overflows dtype, fails diagonal_inverse
        mean = float(factor.to(torch.float64).nan_to_num(0.0, 0.0, 0.0).clamp(min=0.0).mean()) if factor.numel() else 0.0
        denom = mean + damping
        denom = denom if 0.0 < denom < float("inf") else (damping if damping > 0.0 else 1.0)
        reasons.append("the factor holds non-finite values" if not _finite(factor)
                       else f"its elementwise inverse is not finite in {dtype}")
        return torch.full_like(factor, 1.0 / denom, dtype=dtype), "identity", damping, "; ".join(reasons)
    if not _finite(factor):
        reasons.append("the factor holds non-finite values")
        return scaled_identity(factor, damping, dtype), "identity", damping, "; ".join(reasons)
    inv: torch.Tensor | None
    try:
        inv = eigh_inverse(factor, damping, dtype)
        if _finite(inv):
            return inv, "eigh", damping, "; ".join(reasons)
        reasons.append(f"the eigendecomposition's inverse is not finite in {dtype}")
    except RuntimeError as e:  # torch.linalg.LinAlgError: no convergence
        reasons.append(f"the eigendecomposition failed ({str(e).splitlines()[0]})")
    mean = abs(float(factor.to(torch.float64).diagonal().sum())) / max(factor.shape[0], 1)
    base = damping if damping > 0.0 else torch.finfo(dtype).eps * mean
    if base > 0.0:
        for k in range(1, DAMPING_RETRIES + 1):
            d = base * DAMPING_GROWTH**k
            inv = _cholesky_inverse64(factor, d, dtype)
            if inv is None:
                try:
                    inv = eigh_inverse(factor, d, dtype)
                except RuntimeError:
                    inv = None
            if inv is not None and _finite(inv):
                return inv, "damping", d, "; ".join(reasons)
        reasons.append(f"damping up to {base * DAMPING_GROWTH**DAMPING_RETRIES:.3g} did not help")
    return scaled_identity(factor, damping, dtype), "identity", damping, "; ".join(reasons)


def _robust_any(factor: torch.Tensor, damping: float | torch.Tensor, dtype: torch.dtype,
                reason: str) -> tuple[torch.Tensor, str, float, str]:
    """:func:`robust_inverse` of a factor in any layout: a grouped one block by block (each block with its own
    damping, the healthy ones by Cholesky), reporting the lowest level a block needed."""
    if factor.dim() != 3:
        return robust_inverse(factor, float(damping), dtype, reason)
    d = damping if isinstance(damping, torch.Tensor) and damping.dim() == 1 else None
    blocks = []
    worst, used, why = "cholesky", float(damping if d is None else d.max()), reason
    for j in range(factor.shape[0]):
        single, fallbacks = robust_inverses([factor[j]], [float(d[j]) if d is not None else float(damping)], dtype)
        blocks.append(single[0])
        for fb in fallbacks:
            if LEVELS.index(fb.level) > LEVELS.index(worst):
                worst, used, why = fb.level, fb.damping, f"block {j}: {fb.reason}"
    return torch.stack(blocks), ("eigh" if worst == "cholesky" else worst), used, why


def _shape_groups(factors: Sequence[torch.Tensor], dtype: torch.dtype,
                  stack_bytes: int | None = None) -> list[list[int]]:
    """The factors' indices grouped by shape and device, in order of first appearance: each group is stacked (in
    ``dtype``, whatever the factors' own dtypes) and handled by one batched call; a group stacks at most
    ``stack_bytes`` (default :data:`MAX_STACK_BYTES`; or one factor).

    On CPUs a group of matrices is split into single factors where the factors' size in ``dtype`` is not a multiple
    of :data:`ALIGNMENT`: a batched LAPACK call runs the single-matrix routine on each factor in turn, but from the
    factor's offset in the stack, and the vectorized kernels round differently on a factor that starts less aligned
    than an allocation (measured with MKL: the batched cholesky_inverse and eigh of float32 matrices of odd size, or
    of float64 ones at odd multiples of 8 bytes, differ in the last bits from the same calls on each factor alone).
    Aligned stacks give each factor bitwise what a call on it alone gives, so the inverses do not depend on which
    factors share a call (the schedule, the number of ranks)."""
    groups: dict[tuple[tuple[int, ...], torch.device], list[int]] = {}
    out: list[list[int]] = []
    itemsize = torch.empty((), dtype=dtype).element_size()
    bound = MAX_STACK_BYTES if stack_bytes is None else stack_bytes
    for i, f in enumerate(factors):
        size = f.numel() * itemsize
        if f.dim() >= 2 and f.device.type == "cpu" and size % ALIGNMENT:
            out.append([i])
            continue
        key = (tuple(f.shape), f.device)
        group = groups.get(key)
        if group is None or (len(group) + 1) * size > bound:
            group = groups[key] = []
            out.append(group)
        group.append(i)
    return out


def _stack(factors: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The factors as one ``k x shape`` tensor in ``dtype``: one copy, converted on the way as ``.to(dtype)`` does."""
    out = torch.empty((len(factors), *factors[0].shape), dtype=dtype, device=factors[0].device)
    for row, f in zip(out, factors):
        row.copy_(f)
    return out


Targets = Sequence["torch.Tensor | None"]


def _usable(t: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``t`` (a held inverse) can take a new result of ``shape``, ``dtype`` on ``device`` in place."""
    return (t is not None and tuple(t.shape) == shape and t.dtype == dtype and t.device == device
            and t.is_contiguous())


def _scatter(stack: torch.Tensor, targets: Targets) -> list[torch.Tensor]:
    """Each row of ``stack`` as its own row-major tensor: copied into its target (a held inverse of its shape), or
    a new tensor where it has none. Never a view: a view would keep the whole stack alive (and be saved whole)."""
    out = []
    for row, t in zip(stack, targets):
        if t is not None and _usable(t, tuple(row.shape), row.dtype, row.device):
            out.append(t.copy_(row))
        else:
            out.append(row.clone(memory_format=torch.contiguous_format))
    return out


def _place(result: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
    """``result`` written into ``target`` where it can take it (see :func:`_usable`), else ``result`` itself."""
    if target is not None and _usable(target, tuple(result.shape), result.dtype, result.device):
        return target.copy_(result)
    return result


def _stacked_dampings(dampings: Sequence[float | torch.Tensor], shape: tuple[int, ...],
                      device: torch.device) -> torch.Tensor | None:
    """A group's dampings as one ``k`` (dense, diagonal) or ``k x b`` (grouped) tensor where every one is a tensor
    on ``device`` (as :func:`pi_split` gives them); None otherwise: numbers are added factor by factor, which
    needs no host-to-device copy."""
    ts = [d for d in dampings if isinstance(d, torch.Tensor) and d.device == device]
    if len(ts) != len(dampings):
        return None
    if len(shape) == 3:
        if any(t.dim() > 1 or (t.dim() == 1 and t.shape[0] != shape[0]) for t in ts):
            return None
        return torch.stack([t.expand(shape[0]) for t in ts])
    return torch.stack(ts) if all(t.dim() == 0 for t in ts) else None


def _add_each(stack: torch.Tensor, dampings: Sequence[float | torch.Tensor],
              add: Callable[[torch.Tensor, float | torch.Tensor], object]) -> None:
    """``add(row, damping)`` for each row of ``stack``; in a function of its own so that no loop variable (a view
    of the stack) keeps the stack alive after its caller is done with it."""
    for row, d in zip(stack, dampings):
        add(row, d)


def _cholesky_group(factors: Sequence[torch.Tensor], dampings: Sequence[float | torch.Tensor], dtype: torch.dtype,
                    limit: float, targets: Targets) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Cholesky inverses of same-shape dense or grouped factors by one batched factorization and one batched
    inversion: (the inverses, each its own tensor, written into its target where it has one; their codes as a
    ``k`` tensor, see :func:`robust_inverses`).

    Besides the factors and the inverses, at most two stacks of the group are alive at once (the damped copy and
    its Cholesky factor, that factor and the inverses), each freed as soon as it is used, and the last when this
    returns."""
    m = _stack(factors, dtype)
    stacked = _stacked_dampings(dampings, tuple(factors[0].shape), m.device)
    if stacked is not None:
        fx.diagonal(m).add_(stacked.to(dtype).unsqueeze(-1))
    else:
        _add_each(m, dampings, fx.add_damping)
    diag_m = fx.diagonal(m).clone()  # all that the condition check needs of the damped copy
    L, info = torch.linalg.cholesky_ex(m)  # info without a host sync
    del m
    failed = info.ne(0)  # k, or k x b (grouped)
    # A failed factorization may hold zeros on its diagonal, on which cholesky_inverse
    # raises; put ones there without a host sync (that result is discarded by the caller).
    fx.diagonal(L).masked_fill_(failed.unsqueeze(-1), 1.0)
    inv = torch.cholesky_inverse(L)
    del L
    dims = tuple(range(1, inv.dim()))
    # Codes: 0 ok, 1 failed, 2 inverse not finite (one pass: a non-finite entry makes the sum
    # non-finite; Cholesky can "succeed" on a near-singular matrix whose inverse overflows),
    # 3 too ill-conditioned for dtype (see the module docstring). A grouped factor: the worst block's.
    ill = (diag_m * fx.diagonal(inv)).amax(dim=dims[:-1]) > limit
    codes = torch.where(failed.reshape(len(factors), -1).any(1), 1,
                        torch.where(~torch.isfinite(inv.sum(dim=dims)), 2, torch.where(ill, 3, 0)))
    return _scatter(inv, targets), codes


def _diagonal_group(factors: Sequence[torch.Tensor], dampings: Sequence[float | torch.Tensor],
                    dtype: torch.dtype, targets: Targets) -> tuple[list[torch.Tensor], torch.Tensor]:
    """:func:`diagonal_inverse` of same-length diagonal factors in one pass: (the inverses, their codes)."""
    vals = _stack(factors, dtype).clamp_(min=0.0)
    stacked = _stacked_dampings(dampings, tuple(factors[0].shape), vals.device)
    if stacked is not None:
        vals.add_(stacked.to(dtype).unsqueeze(-1))
    else:
        _add_each(vals, dampings, lambda row, d: row.add_(d.to(dtype) if isinstance(d, torch.Tensor) else d))
    inv = _floored_reciprocal(vals)
    del vals
    # Each factor's sum in its own dtype, as the per-factor check reads it (k short reductions).
    src_finite = torch.stack([torch.isfinite(f.sum()) for f in factors])
    codes = torch.where(src_finite & torch.isfinite(inv.sum(-1)), 0, 2)
    return _scatter(inv, targets), codes


def robust_inverses(
    factors: list[torch.Tensor], damping: float | Sequence[float | torch.Tensor], dtype: torch.dtype,
    out: Targets | None = None, stack_bytes: int | None = None,
) -> tuple[list[torch.Tensor], list[Fallback]]:
    """Damped inverses of several factors, and a :class:`Fallback` for each one Cholesky did not invert.

    ``out``: None, or one tensor (or None) per factor: the inverse held now, which the new one is written into as
    soon as its group is done (where it has the inverse's shape, dtype and device and is contiguous; the returned
    inverse is then that tensor). An inverse step then never holds two sets of inverses at once: besides what is
    held, it allocates one group's stacks at a time (bounded by ``stack_bytes``, see :func:`_shape_groups` and
    :func:`~.inverse_memory.stack_budget`) and one inverse-sized temporary. The targets are overwritten before the step's checks
    are read: a caller that still needs the old inverses (asynchronous inverses, used while the new are made)
    passes None. The results are the same either way, bitwise.

    ``damping``: one value for every factor, or one per factor (numbers or 0-d tensors: the
    pi-balanced split of :func:`pi_split`; for a grouped factor also one per block). The factors are inverted
    batched by shape (one stacked Cholesky and one stacked inversion per shape), and one host sync reads the
    checks of the whole batch; when every Cholesky succeeds that is the only one. The fallback levels run
    factor by factor and sync freely (they only run on factors that need them).
    """
    if not factors:
        return [], []
    dampings = [float(damping)] * len(factors) if isinstance(damping, (int, float)) else list(damping)
    if len(dampings) != len(factors):
        raise ValueError(f"damping: got {len(dampings)} values for {len(factors)} factors; give one per factor")
    limit = COND_LIMIT / torch.finfo(dtype).eps
    targets: Targets = [None] * len(factors) if out is None else out
    if len(targets) != len(factors):
        raise ValueError(f"out: got {len(targets)} tensors for {len(factors)} factors; give one (or None) per factor")
    inverses: list[torch.Tensor] = list(factors)  # each replaced below
    order: list[int] = []
    parts: list[torch.Tensor] = []
    for idx in _shape_groups(factors, dtype, stack_bytes):
        fs, ds, ts = [factors[i] for i in idx], [dampings[i] for i in idx], [targets[i] for i in idx]
        invs, codes = (_diagonal_group(fs, ds, dtype, ts) if fs[0].dim() == 1
                       else _cholesky_group(fs, ds, dtype, limit, ts))
        for i, inv in zip(idx, invs):
            inverses[i] = inv
        order.extend(idx)
        parts.append(codes)
    code_of = dict(zip(order, torch.cat(parts).tolist()))  # the one sync
    why = {1: "it is not positive definite after damping (indefinite or singular)", 2: "the Cholesky inverse is not finite",
           3: f"the damped factor is too ill-conditioned for a {dtype} Cholesky (condition number above "
              f"{limit:.2g})"}
    fallbacks = []
    for i, f in enumerate(factors):
        if code_of[i]:
            inv, level, used, reason = _robust_any(f, dampings[i], dtype, why[code_of[i]])
            inverses[i] = _place(inv, targets[i])
            fallbacks.append(Fallback(i, level, used, reason))
    for inv in inverses:
        # Entries below the smallest normal float: zero to the inverse's precision, and subnormal
        # arithmetic in every later preconditioning matmul is many times slower on CPUs
        # (benchmarks/soak.py; the running factors are flushed the same way).
        inv.masked_fill_(inv.abs() < torch.finfo(inv.dtype).tiny, 0.0)
    # Row-major, as received inverses and loaded checkpoints are (cholesky_inverse returns the transpose of
    # one): the preconditioning matmuls then take the same path, and round the same, whichever rank computed
    # an inverse and whether it was computed, received or loaded (a dpkfac resume is bitwise because of it).
    return [inv.contiguous() for inv in inverses], fallbacks


# ---------------------------------------------------------------------------------------------- eigen
# inverse_method="eigen": each factor is kept as its eigendecomposition F = Q diag(e) Q^T, one (n+1, n)
# tensor per factor (rows 0..n-1: Q, whose columns are the eigenvectors; row n: e, clamped at 0), and
# the block is preconditioned with the exact damping (:func:`eigen_precondition`). The ladder:
#
# ``"eigh"`` (the healthy path, not a fallback): ``torch.linalg.eigh`` of the symmetrized factor in the
#     inversion dtype.
# ``"float64"``: that eigh failed (no convergence) or gave non-finite values: retried in float64 and
#     rounded to the inversion dtype.
# ``"identity"``: the factor holds non-finite values, or even the float64 eigh failed: Q = I and every
#     eigenvalue trace(F)/n (0 where that is not a finite non-negative number): the factor's isotropic part.

EIGEN_LEVELS = ("eigh", "float64", "identity")

# What the preconditioner reports it did instead of the eigendecomposition in the inversion dtype (messages).
EIGEN_FALLBACK_ACTION = {
    "float64": "retried in float64, which succeeded (consider inv_dtype='float64' or a larger damping)",
    "identity": "no eigendecomposition was finite, so this factor uses its isotropic part (Q = I, every "
                "eigenvalue trace/n), which drops its curvature (check the factor for non-finite values)",
}


def eigen_payload(evecs: torch.Tensor, evals: torch.Tensor) -> torch.Tensor:
    """One (n+1, n) tensor: rows 0..n-1 the eigenvectors (as columns), row n the eigenvalues (per block:
    ``b x (n+1) x n``). A diagonal factor's payload is its eigenvalues alone (the eigenvectors are I)."""
    return torch.cat([evecs, evals.unsqueeze(-2)], dim=-2)


def _eigh(factor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The payload of sym(F) by eigh in ``dtype`` (eigenvalues clamped at 0), or None where it fails."""
    f = factor.to(dtype)
    if f.dim() == 1:
        return f.clamp(min=0.0)
    f = 0.5 * (f + f.transpose(-1, -2))
    evals: torch.Tensor
    evecs: torch.Tensor
    try:
        evals, evecs = torch.linalg.eigh(f)
    except RuntimeError:  # torch.linalg.LinAlgError: no convergence
        return None
    return eigen_payload(evecs, evals.clamp(min=0.0))


def identity_payload(factor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Q = I, every eigenvalue trace(F)/n (0 where that is not finite and non-negative): the last resort."""
    n = factor.shape[-1]
    mean = float(fx.diagonal(factor.to(torch.float64)).sum()) / max(fx.diagonal(factor).numel(), 1)
    if not (mean >= 0.0 and mean < torch.finfo(dtype).max):
        mean = 0.0
    evals = torch.full(fx.diagonal(factor).shape, mean, dtype=dtype, device=factor.device)
    if factor.dim() == 1:
        return evals
    eye = torch.eye(n, dtype=dtype, device=factor.device).expand(*factor.shape[:-2], n, n)
    return eigen_payload(eye, evals)


def _eigen_ladder(i: int, f: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, Fallback | None]:
    """One factor's payload by the first level that gives a finite one (the ladder above), factor by factor with
    its own host reads: what :func:`robust_eigens` runs for the factors its batched eigh did not settle."""
    if not _finite(f):
        return identity_payload(f, dtype), Fallback(i, "identity", 0.0, "the factor holds non-finite values")
    p = _eigh(f, dtype)
    if p is not None and _finite(p):
        return p, None
    reason = f"eigh in {dtype} failed" if p is None else f"eigh in {dtype} gave non-finite values"
    if dtype != torch.float64:
        p = _eigh(f, torch.float64)
        if p is not None:
            p = p.to(dtype)
            if _finite(p):
                return p, Fallback(i, "float64", 0.0, reason)
        reason += "; so did eigh in float64"
    return identity_payload(f, dtype), Fallback(i, "identity", 0.0, reason)


def _eigen_group(factors: Sequence[torch.Tensor], dtype: torch.dtype,
                 targets: Targets) -> tuple[list[torch.Tensor], torch.Tensor] | None:
    """Payloads of same-shape factors by one batched eigh in ``dtype``: (the payloads, each its own tensor; a ``k``
    tensor, nonzero where a factor is not finite in ``dtype`` or its payload is not finite: those go down the
    ladder), or None where the batched eigh raised (every factor of the group then goes down the ladder)."""
    k = len(factors)
    m = _stack(factors, dtype)
    bad = ~torch.isfinite(m).reshape(k, -1).all(1)
    if m.dim() == 2:  # diagonal: the eigenvalues are the entries
        payload = m.clamp_(min=0.0)
    else:
        # The eigh never sees a non-finite value (those factors' results are discarded): no host read to skip them.
        m.masked_fill_(bad.view(k, *([1] * (m.dim() - 1))), 0.0)
        s = m + m.transpose(-1, -2)
        del m
        s.mul_(0.5)  # exact symmetry for eigh, as 0.5 * (f + f^T)
        evals: torch.Tensor
        evecs: torch.Tensor
        try:
            evals, evecs = torch.linalg.eigh(s)
        except RuntimeError:  # torch.linalg.LinAlgError: no convergence for one of them
            return None
        del s
        payload = eigen_payload(evecs, evals.clamp(min=0.0))
        del evals, evecs
    codes = (bad | ~torch.isfinite(payload).reshape(k, -1).all(1)).to(torch.int8)
    return _scatter(payload, targets), codes


def robust_eigens(factors: list[torch.Tensor], dtype: torch.dtype, out: Targets | None = None,
                  stack_bytes: int | None = None) -> tuple[list[torch.Tensor], list[Fallback]]:
    """Eigen payloads (see above) of several factors, and a :class:`Fallback` for each one that needed
    a level below the eigh in ``dtype`` (its ``damping`` is 0: eigen applies the damping later).

    ``out`` and ``stack_bytes``: as :func:`robust_inverses` (the payloads held now, written in place).

    The factors are decomposed batched by shape (one stacked eigh per shape) and one host sync reads the checks
    of the whole batch; when every factor is finite and its eigh succeeds that is the only one. The levels below
    run factor by factor and sync freely."""
    targets: Targets = [None] * len(factors) if out is None else out
    if len(targets) != len(factors):
        raise ValueError(f"out: got {len(targets)} tensors for {len(factors)} factors; give one (or None) per factor")
    payloads: list[torch.Tensor] = list(factors)  # each replaced below
    found: dict[int, Fallback | None] = {}
    order: list[int] = []
    parts: list[torch.Tensor] = []

    def ladder(i: int) -> None:
        p, found[i] = _eigen_ladder(i, factors[i], dtype)
        payloads[i] = _place(p, targets[i])

    for idx in _shape_groups(factors, dtype, stack_bytes):
        res = _eigen_group([factors[i] for i in idx], dtype, [targets[i] for i in idx])
        if res is None:
            for i in idx:
                ladder(i)
            continue
        for i, p in zip(idx, res[0]):
            payloads[i] = p
        order.extend(idx)
        parts.append(res[1])
    if parts:
        for i, code in zip(order, torch.cat(parts).tolist()):  # the one sync
            if code:
                ladder(i)
    fallbacks = [fb for _, fb in sorted(found.items()) if fb is not None]
    for p in payloads:  # as robust_inverses: subnormal entries are zero to the payload's precision, and slow
        p.masked_fill_(p.abs() < torch.finfo(p.dtype).tiny, 0.0)
    return payloads, fallbacks


def eigen_precondition(grad: torch.Tensor, A_eig: torch.Tensor, G_eig: torch.Tensor, damping: float) -> torch.Tensor:
    """(A (x) G + damping I)^-1 applied to the gradient matrix ``grad`` (g x a), from eigen payloads:
    Q_G [(Q_G^T grad Q_A) / (e_G e_A^T + damping)] Q_A^T. The smallest effective damping is ``damping``.

    With ``damping`` 0, denominators below 1e-10 of the largest are raised to it (and a zero block
    leaves the rotated gradient as it is), so the result stays finite.
    """
    QA, eA = split_payload(A_eig)
    QG, eG = split_payload(G_eig)
    denom = eG.unsqueeze(-1) * eA.unsqueeze(-2) + damping
    if damping <= 0.0:
        denom = torch.maximum(denom, denom.amax() * EIGH_FLOOR)
        denom = torch.where(denom > 0.0, denom, torch.ones_like(denom))
    r = grad if QG is None else QG.transpose(-1, -2) @ grad
    r = (r if QA is None else r @ QA) / denom
    r = r if QG is None else QG @ r
    return r if QA is None else r @ QA.transpose(-1, -2)


def split_payload(p: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(eigenvectors or None for a diagonal factor, eigenvalues) of an eigen payload in any layout."""
    if p.dim() == 1:
        return None, p
    return p[..., :-1, :], p[..., -1, :]
