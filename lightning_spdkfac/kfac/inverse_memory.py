"""The memory of an inversion, from the factors' shapes alone: how the batched inversions of :mod:`.inverse` bound
their stacks (:func:`stack_budget`), and the most bytes one call allocates beyond the factors and inverses held
(:func:`inversion_workspace`: the K-FAC summary's peak, kfac/summary.py). Kept apart from the inversions so that the
summary reads sizes without the numerics."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

# Bytes: PyTorch's CPU allocations start at this alignment, so a factor inverted alone does too.
ALIGNMENT = 64
# Bytes: the largest stack of one group (more factors of a shape are stacked in several groups), which bounds the
# extra memory of a batch: at most two stacks of a group are alive at once (see ``inverse._cholesky_group``).
MAX_STACK_BYTES = 1 << 28
# The preconditioner bounds a stack further, to 1/STACK_SHARE of the inverses of the call (or one factor, where one
# is larger; :func:`stack_budget`): the workspace of an inverse step is then a small share of what K-FAC holds,
# whatever the number of equal-shaped layers, for at most STACK_SHARE batched calls per shape more.
STACK_SHARE = 16


def stack_budget(sizes: Sequence[int]) -> int:
    """The stack bound (bytes) of a call inverting factors of ``sizes`` bytes each (in the inversion dtype): a
    1/:data:`STACK_SHARE` share of their total, at least the largest, at most :data:`MAX_STACK_BYTES`. Which
    factors share a stack does not change their inverses (see ``inverse._shape_groups``)."""
    if not sizes:
        return MAX_STACK_BYTES
    return min(MAX_STACK_BYTES, max(max(sizes), -(-sum(sizes) // STACK_SHARE)))


def syevd_work_bytes(n: int, itemsize: int) -> int:
    """Bytes of LAPACK's work arrays for the symmetric eigendecomposition (``?syevd``, with eigenvectors) of an
    ``n x n`` matrix: its documented minimum, ``1 + 6n + 2n^2`` elements and ``3 + 5n`` 32-bit integers, which torch
    allocates inside ``torch.linalg.eigh`` (once per call, batched or not; no tensor returns it)."""
    return (1 + 6 * n + 2 * n * n) * itemsize + (3 + 5 * n) * 4


def inversion_workspace(shapes: Sequence[tuple[int, ...]], method: str, dtype: torch.dtype, *, cpu: bool = True,
                        in_place: bool = True, stack_bytes: int | None = None) -> int:
    """The most bytes one call of :func:`~.inverse.robust_inverses` (``method="cholesky"``) or :func:`~.inverse.robust_eigens`
    (``"eigen"``) on factors of ``shapes`` allocates at once beyond the factors and the inverses held, from the
    shapes alone (the K-FAC summary's peak): the stacks of one group at a time (bounded as ``stack_bytes``, default
    :func:`stack_budget`), LAPACK's eigendecomposition work arrays, and the inverse-sized temporary of the final
    pass; with ``in_place=False`` (no held inverses to write into: asynchronous inverses, a layer's first) also the
    new inverses made so far. Groups are formed as ``inverse._shape_groups`` forms them (``cpu``: unaligned dense
    factors alone). The fallback levels, which run factor by factor on the few factors that need them, are not
    counted."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = [math.prod(s) * itemsize for s in shapes]
    bound = stack_budget(sizes) if stack_bytes is None else stack_bytes
    groups: list[list[tuple[int, ...]]] = []
    open_group: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for shape, size in zip(shapes, sizes):
        if len(shape) >= 2 and cpu and size % ALIGNMENT:
            groups.append([shape])
            continue
        group = open_group.get(shape)
        if group is None or (len(group) + 1) * size > bound:
            group = open_group[shape] = []
            groups.append(group)
        group.append(shape)

    def inv_numel(shape: tuple[int, ...]) -> int:
        if method == "eigen" and len(shape) >= 2:
            return math.prod(shape[:-2]) * (shape[-1] + 1) * shape[-1]
        return math.prod(shape)

    made = peak = 0
    for group in groups:
        shape, k = group[0], len(group)
        n = shape[-1]
        stack = k * math.prod(shape) * itemsize
        out_stack = k * inv_numel(shape) * itemsize
        # torch.isfinite(x) makes |x| and three boolean masks of x's size at once.
        finite = k * math.prod(shape) * (itemsize + 3)
        if len(shape) == 1:
            # The stack and its finiteness test (eigen); the stack, the floored copy, its reciprocal, the ones, the
            # result and their masks (cholesky's diagonal inverse, _floored_reciprocal).
            work = stack + finite if method == "eigen" else 5 * stack + 2 * k * n
        elif method == "eigen":
            evals = k * math.prod(shape[:-1]) * itemsize
            work = max(stack + finite,  # the stack and its finiteness test
                       2 * stack + evals + syevd_work_bytes(n, itemsize),  # the symmetrized copy, eigenvectors, work
                       stack + 2 * evals + out_stack,  # eigenvectors, eigenvalues and their clamped copy, payloads
                       out_stack + k * inv_numel(shape) * (itemsize + 3))  # the payloads and their finiteness test
        else:
            work = 2 * stack + k * math.prod(shape[:-1]) * itemsize  # two stacks and the damped diagonals
        if not in_place:
            work = max(work, 2 * out_stack)  # the inverses' stack and the new inverses copied out of it
        peak = max(peak, made + work)
        if not in_place:
            made += out_stack
    # The last pass over the inverses (subnormal entries set to zero): |inverse| and its mask, one at a time.
    last = max((inv_numel(s) * (itemsize + 1) for s in shapes), default=0)
    return max(peak, made + last)
