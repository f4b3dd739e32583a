"""Shape-generic Kronecker-factor arithmetic: Gram sums, traces, damping and the preconditioning product for
the three factor layouts of :mod:`lightning_spdkfac.factor_shapes` (dense ``(n, n)``, diagonal ``(n,)``, grouped
``(b, n, n)``). docs/math.md, "Diagonal and grouped factors", has the definitions.

Factor rows come in as ``R x (b*n)`` (a grouped layer's columns are its groups' columns one group after the other,
as ``weight.view(out, -1)`` orders them) and every function here returns the factor's own layout.
"""

from __future__ import annotations

import functools

import torch

from ..factor_shapes import FactorShape

HALF_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def mixed_gemm(device_type: str) -> bool:
    """Whether this torch multiplies 16-bit matrices into a float32 result on ``device_type`` (``torch.mm(...,
    out_dtype=torch.float32)``, CUDA in torch >= 2.8): the tensor-core GEMM with float32 accumulation."""
    if device_type != "cuda":
        return False
    try:
        for dtype in HALF_DTYPES:
            one = torch.ones(1, 1, 1, dtype=dtype, device=device_type)
            mm = torch.mm(one[0], one[0], out_dtype=torch.float32)
            bmm = torch.bmm(one, one, out_dtype=torch.float32)
            if mm.dtype != torch.float32 or bmm.dtype != torch.float32:
                return False
        return True
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def half_rows(x: torch.Tensor, factor_dtype: torch.dtype, shape: FactorShape) -> bool:
    """Whether the rows of ``x`` can go into a ``factor_dtype`` Gram sum in their own 16-bit dtype (bf16/fp16
    activations or output gradients under autocast, on CUDA, a dense or grouped float32 factor): a product of two
    16-bit floats is exact in float32, and the tensor-core GEMM accumulates in float32, so the sum is the one of the
    rows cast to float32 first (in another order of additions), several times faster than float32 GEMMs."""
    return (x.dtype in HALF_DTYPES and factor_dtype == torch.float32 and len(shape) != 1
            and x.device.type == "cuda" and mixed_gemm(x.device.type))


def fill_runs(dst: torch.Tensor, values: list[float]) -> torch.Tensor:
    """``dst`` (1-D, ``len(values)`` long) set to ``values`` on its device without a host-to-device copy
    (``torch.tensor(values, device=cuda)`` blocks the host): one ``fill_`` per run of equal values, so one kernel
    when they are all equal. Returns ``dst``."""
    start = 0
    for end in range(1, len(values) + 1):
        if end == len(values) or values[end] != values[start]:
            dst[start:end].fill_(values[start])
            start = end
    return dst


def grouped_rows(rows: torch.Tensor, groups: int) -> torch.Tensor:
    """``R x (b*n)`` rows as ``b x R x n`` (one batch of rows per group)."""
    return rows.reshape(rows.shape[0], groups, rows.shape[1] // groups).transpose(0, 1)


def gram(acc: torch.Tensor, rows: torch.Tensor, shape: FactorShape, first: bool) -> None:
    """``acc = rows^T rows`` (``first``) or ``acc += rows^T rows``, in place, in ``shape``'s layout: the full
    Gram matrix, its diagonal (the column sums of squares), or one Gram matrix per group. 16-bit rows into a float32
    ``acc`` (:func:`half_rows`): float32 products and sums from the tensor cores."""
    if rows.dtype != acc.dtype and rows.dtype in HALF_DTYPES and len(shape) != 1:
        if len(shape) == 2:
            prod = torch.mm(rows.T, rows, out_dtype=acc.dtype)
        else:
            r = grouped_rows(rows, shape[0])
            prod = torch.bmm(r.transpose(1, 2), r, out_dtype=acc.dtype)
        if first:
            acc.copy_(prod)
        else:
            acc.add_(prod)
        return
    if len(shape) == 2:
        if first:
            torch.mm(rows.T, rows, out=acc)
        else:
            acc.addmm_(rows.T, rows)
    elif len(shape) == 1:
        sq = rows.square().sum(0)
        if first:
            acc.copy_(sq)
        else:
            acc.add_(sq)
    else:
        r = grouped_rows(rows, shape[0])
        if first:
            torch.bmm(r.transpose(1, 2), r, out=acc)
        else:
            acc.baddbmm_(r.transpose(1, 2), r)


def column_sums(rows: torch.Tensor, shape: FactorShape) -> torch.Tensor:
    """The sum of the rows (the bias column of A): ``n`` (dense, diagonal) or ``b x n`` (grouped); float32 for 16-bit
    rows (:func:`half_rows`)."""
    s = rows.sum(0, dtype=torch.float32) if rows.dtype in HALF_DTYPES else rows.sum(0)
    return s.reshape(shape[0], s.shape[0] // shape[0]) if len(shape) == 3 else s


def diagonal(t: torch.Tensor) -> torch.Tensor:
    """The diagonal entries of a factor in any layout (``n``, or ``b x n``)."""
    return t if t.dim() == 1 else t.diagonal(dim1=-2, dim2=-1)


def trace_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of the diagonal entries (of every block): finite iff the factor's rows were (Cauchy-Schwarz)."""
    return diagonal(t).sum()


def mean_eigenvalue(t: torch.Tensor) -> torch.Tensor:
    """trace / side in float64: a scalar, or one per block of a grouped factor (``b``)."""
    return diagonal(t).to(torch.float64).mean(-1)


def add_damping(m: torch.Tensor, damping: float | torch.Tensor) -> torch.Tensor:
    """``m + damping I`` in place (``damping``: a number, a 0-d tensor, or one per block of a grouped ``m``)."""
    d = diagonal(m)
    if isinstance(damping, torch.Tensor) and damping.dim() == 1:
        d.add_(damping.to(m.dtype).unsqueeze(-1))
    else:
        d.add_(damping)
    return m


def apply_inverses(g_inv: torch.Tensor, grad: torch.Tensor, a_inv: torch.Tensor) -> torch.Tensor:
    """``G^-1 grad A^-1`` with each inverse dense (a matrix product) or diagonal (a row or column scaling);
    ``grad`` is ``out x in``, or ``b x out x in`` with grouped inverses (batched products)."""
    left = g_inv.unsqueeze(-1) * grad if g_inv.dim() == 1 else g_inv @ grad
    if a_inv.dim() != 1:
        return left @ a_inv
    # A diagonal A scales the columns of a new tensor in place (the same products): an embedding's P, as large as its
    # vocabulary, is then made once, not twice.
    return left.mul_(a_inv) if left.dtype == torch.promote_types(left.dtype, a_inv.dtype) else left * a_inv
