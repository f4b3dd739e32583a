"""The shapes a Kronecker factor takes, and what each costs to store, send and invert.

A layer's K-FAC block is ``A (x) G``; each factor is held in one of three layouts (docs/math.md, "Diagonal and
grouped factors"):

``(n, n)`` dense
    The usual symmetric factor. It travels as its upper triangle, n(n+1)/2 elements.
``(n,)`` diagonal
    A side above ``max_factor_side`` (an LM head's vocabulary-sized G), or a factor that is diagonal by nature (an
    embedding's token-frequency A): only the diagonal is kept, accumulated, reduced, inverted and sent.
``(b, n, n)`` grouped
    ``b`` independent dense blocks of one side, as a grouped or depthwise convolution has (one Kronecker block per
    group): stored, reduced and inverted as one batched tensor, sent as ``b`` upper triangles.

A factor's shape is fixed when the layer is registered (the helper's ``a_shape`` / ``g_shape``), and every piece
that moves or plans factors (fused reductions, inverse broadcasts, placement, checkpoints, the simulator's plan)
takes it from there. An ``int`` n anywhere a shape is expected means ``(n, n)`` (the only shape before diagonal
and grouped factors existed).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

FactorShape = tuple[int, ...]
ShapeLike = int | Sequence[int]

__all__ = [
    "FactorShape",
    "ShapeLike",
    "as_shape",
    "blocks",
    "check_shape",
    "check_shapes",
    "describe",
    "inverse_numel",
    "inverse_shape",
    "is_diagonal",
    "is_grouped",
    "numel",
    "packed_numel",
    "preconditioned_shape",
    "side",
]


def as_shape(shape: ShapeLike, name: str = "shape") -> FactorShape:
    """``shape`` checked and as a tuple: ``n`` -> ``(n, n)``; ``(n,)``, ``(n, n)`` and ``(b, n, n)`` as given."""
    if isinstance(shape, bool):
        raise TypeError(f"{name} must be an int or a tuple of ints, got {shape!r}")
    if isinstance(shape, int):
        if shape < 0:
            raise ValueError(f"{name} must be >= 0, got {shape}")
        return (shape, shape)
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"{name} must be an int or a tuple of ints, got {shape!r}") from None
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise ValueError(f"{name} must hold non-negative ints, got {shape!r}")
    if len(dims) == 1:
        return dims
    if len(dims) in (2, 3) and dims[-1] == dims[-2]:
        return dims
    raise ValueError(f"{name} must be (n,) (diagonal), (n, n) (dense) or (b, n, n) (grouped), got {shape!r}")


def is_diagonal(shape: FactorShape) -> bool:
    return len(shape) == 1


def is_grouped(shape: FactorShape) -> bool:
    return len(shape) == 3


def side(shape: FactorShape) -> int:
    """n: the side of the factor (of each block for a grouped one; the length of a diagonal one)."""
    return shape[-1]


def blocks(shape: FactorShape) -> int:
    """b: the number of dense blocks (1 for a dense factor, 0 for a diagonal one)."""
    return shape[0] if len(shape) == 3 else (0 if len(shape) == 1 else 1)


def numel(shape: FactorShape) -> int:
    """Elements stored for the factor (and for a Cholesky inverse, which has its shape)."""
    return math.prod(shape)


def packed_numel(shape: FactorShape) -> int:
    """Elements one factor sends: the diagonal, or the upper triangle of each dense block."""
    if len(shape) == 1:
        return shape[0]
    n = shape[-1]
    return blocks(shape) * (n * (n + 1) // 2)


def inverse_shape(shape: FactorShape, method: Literal["cholesky", "eigen"] | str) -> FactorShape:
    """The shape of what inversion returns: the factor's own for ``"cholesky"``; for ``"eigen"`` the eigen
    payload ((n+1) x n: eigenvectors, then the eigenvalues; per block for a grouped factor) or, for a diagonal
    factor, its eigenvalues alone (the eigenvectors are the identity)."""
    if method != "eigen" or len(shape) == 1:
        return shape
    n = shape[-1]
    return (*shape[:-2], n + 1, n)


def inverse_numel(shape: FactorShape, method: str) -> int:
    """Elements of an inverse as it is broadcast: a Cholesky inverse packed like its factor, an eigen payload
    whole."""
    return packed_numel(shape) if method != "eigen" else numel(inverse_shape(shape, method))


def describe(shape: FactorShape) -> str:
    """``'512x512'``, ``'diag 50257'``, ``'768 x 49x49'``."""
    if len(shape) == 1:
        return f"diag {shape[0]}"
    if len(shape) == 2:
        return f"{shape[0]}x{shape[1]}"
    return f"{shape[0]} x {shape[1]}x{shape[2]}"


def check_shape(name: str, shape: object, low: int = 1) -> FactorShape:
    """``shape`` as :func:`as_shape` (an int n is ``(n, n)``), every dimension ``>= low``; the message names
    ``name`` and what is accepted: TypeError for a wrong type, ValueError for a wrong value."""
    parts = ([shape] if isinstance(shape, int)
             else (list(shape) if isinstance(shape, Sequence) and not isinstance(shape, str) else None))
    if parts is None or any(isinstance(d, bool) or not isinstance(d, int) for d in parts):
        raise TypeError(f"{name} must be an int n (an n x n factor) or a tuple of ints: (n,) diagonal, (n, n) "
                        f"dense, (b, n, n) grouped; got {shape!r} ({type(shape).__name__})")
    dims = as_shape(shape, name)  # type: ignore[arg-type]  # ints or a sequence of ints, checked above
    if any(d < low for d in dims):
        raise ValueError(f"{name} must have every dimension >= {low}, got {shape!r}")
    return dims


def check_shapes(name: str, shapes: object, low: int = 1) -> list[FactorShape]:
    """Each item of ``shapes`` checked by :func:`check_shape`; the messages name the index (``sides[2] ...``)."""
    if isinstance(shapes, (str, bytes)) or not isinstance(shapes, Sequence):
        raise TypeError(f"{name} must be a sequence of factor shapes (an int n for an n x n factor, or a tuple: "
                        f"(n,) diagonal, (n, n) dense, (b, n, n) grouped), got a {type(shapes).__name__}")
    return [check_shape(f"{name}[{i}]", s, low) for i, s in enumerate(shapes)]


def preconditioned_shape(a_shape: ShapeLike, g_shape: ShapeLike) -> FactorShape:
    """The shape of a layer's gradient matrix and of its preconditioned gradient ``G^-1 dW A^-1``:
    ``(side(G), side(A))``, or ``(b, side(G), side(A))`` when either factor is grouped (``b`` its blocks; both
    grouped ones must then have the same ``b``). What ``schedule="dpkfac"`` broadcasts per layer."""
    a, g = as_shape(a_shape, "a_shape"), as_shape(g_shape, "g_shape")
    grouped = [blocks(s) for s in (a, g) if len(s) == 3]
    if len(set(grouped)) > 1:
        raise ValueError(f"a_shape and g_shape are both grouped but with different block counts: {a!r} and {g!r}; "
                         "a layer's grouped factors have one block per group each")
    return (grouped[0], side(g), side(a)) if grouped else (side(g), side(a))
