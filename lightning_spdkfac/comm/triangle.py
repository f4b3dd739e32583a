"""Packing of symmetric factors for the wire: only the upper triangle of a dense block travels.

A factor is held in one of three layouts (:mod:`lightning_spdkfac.factor_shapes`): ``(n, n)`` dense, sent
as its upper triangle (n(n+1)/2 elements); ``(n,)`` diagonal, sent as its n entries; ``(b, n, n)`` grouped,
sent as b upper triangles, block after block. ``pack_factors`` gathers a list of factors of any layouts
into one flat buffer; ``unpack_factors`` rebuilds them from it given their shapes, mirroring each
triangle, so the dense blocks come back *exactly* symmetric whatever rounding the buffer went through.
``pack_triu`` / ``unpack_triu`` are the same for dense matrices only (sides as ints).

Both are one gather per factor (a grouped factor's blocks in one batched gather) with cached index
tensors (per side and device), no element loops and no host synchronization (``index_select`` sizes are
known on the host, unlike boolean masking), so they can sit on an asynchronous GPU pipeline. The indices
are int32 (half the memory of int64): the packing index holds n(n+1)/2 entries, the mirroring index n*n.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from .. import validation as val
from ..factor_shapes import FactorShape, ShapeLike, check_shapes, describe, packed_numel

__all__ = ["pack_factors", "pack_triu", "packed_size", "triu_size", "unpack_factors", "unpack_triu"]

_INDEX_CACHE_SIZE = 64


def triu_size(n: int) -> int:
    """Number of elements in the upper triangle (diagonal included) of an ``n x n`` matrix."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return n * (n + 1) // 2


def _index_dtype(n: int) -> torch.dtype:
    return torch.int32 if n * n < 2**31 else torch.int64


@functools.lru_cache(maxsize=_INDEX_CACHE_SIZE)
def _triu_index(n: int, device: torch.device) -> torch.Tensor:
    """Flat positions ``i * n + j`` (i <= j) of the upper triangle, row-major; length n(n+1)/2."""
    rows_cols = torch.triu_indices(n, n, device=device)
    return (rows_cols[0] * n + rows_cols[1]).to(_index_dtype(n))


@functools.lru_cache(maxsize=_INDEX_CACHE_SIZE)
def _mirror_index(n: int, device: torch.device) -> torch.Tensor:
    """For every flat position of an n x n matrix, its place in the packed upper triangle; length n*n."""
    i = torch.arange(n, device=device, dtype=torch.int64)
    a = torch.minimum(i[:, None], i[None, :])
    b = torch.maximum(i[:, None], i[None, :])
    # Row a of the triangle starts after rows 0..a-1, which hold n + (n-1) + ... + (n-a+1) elements.
    pos = a * n - (a * (a - 1)) // 2 + (b - a)
    return pos.reshape(-1).to(_index_dtype(n))


def _device_key(device: torch.device) -> torch.device:
    # "cuda" and "cuda:0" are the same memory; normalize so the cache holds one copy.
    if device.type != "cpu" and device.index is None:
        return torch.device(device.type, torch.empty(0, device=device).device.index)
    return device


def _check_square(name: str, m: torch.Tensor) -> int:
    if m.dim() != 2 or m.shape[0] != m.shape[1]:
        raise ValueError(f"{name} must be a square matrix, got shape {tuple(m.shape)}")
    return m.shape[0]


def _factor_shape(name: str, m: torch.Tensor) -> FactorShape:
    """The layout of factor tensor ``m``: its shape, if it is (n,), (n, n) or (b, n, n)."""
    shape = tuple(m.shape)
    if m.dim() == 1 or (m.dim() in (2, 3) and shape[-1] == shape[-2]):
        return shape
    raise ValueError(f"{name} must be a factor of shape (n,) (diagonal), (n, n) (dense) or (b, n, n) (grouped), "
                     f"got shape {shape}")


def packed_size(shapes: Sequence[ShapeLike]) -> int:
    """Elements of the buffer :func:`pack_factors` makes of factors of ``shapes`` (an int n: (n, n))."""
    return sum(packed_numel(s) for s in check_shapes("shapes", shapes, low=0))


def _pack_one(m: torch.Tensor, shape: FactorShape, seg: torch.Tensor) -> None:
    """Write factor ``m`` (of ``shape``) packed into the flat segment ``seg`` (casting to its dtype)."""
    if len(shape) == 1:
        seg.copy_(m)
        return
    n = shape[-1]
    idx = _triu_index(n, _device_key(m.device))
    if len(shape) == 2:
        flat, dst = m.reshape(-1), seg  # a view when m is contiguous, else one copy
        dim = 0
    else:
        flat, dst = m.reshape(shape[0], n * n), seg.view(shape[0], -1)  # the b blocks in one gather
        dim = 1
    if m.dtype == seg.dtype:
        torch.index_select(flat, dim, idx, out=dst)
    else:
        dst.copy_(flat.index_select(dim, idx))


def _unpack_one(seg: torch.Tensor, shape: FactorShape, target: torch.Tensor) -> None:
    """Fill ``target`` (of ``shape``) from its packed segment ``seg``, mirroring each triangle."""
    if seg.dtype != target.dtype:
        seg = seg.to(target.dtype)  # cast the packed elements, not the (b x) n^2 result
    if len(shape) == 1:
        target.copy_(seg)
        return
    n = shape[-1]
    idx = _mirror_index(n, _device_key(seg.device))
    src, dim = (seg, 0) if len(shape) == 2 else (seg.view(shape[0], -1), 1)
    if target.is_contiguous():
        torch.index_select(src, dim, idx, out=target.view(src.shape[0], n * n) if dim else target.view(-1))
    else:
        target.copy_(src.index_select(dim, idx).view(shape))


def pack_factors(mats: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """``mats`` (factors of any layout: (n,) diagonal, (n, n) dense, (b, n, n) grouped; each dense block
    presumably symmetric) packed into one flat tensor: a diagonal's entries, the upper triangle of each dense
    block (row-major, block after block), factor after factor.

    ``out``: an optional flat buffer of exactly the packed length (:func:`packed_size`), possibly of another
    dtype (e.g. bfloat16 for communication; values are cast). Without it, the buffer has the dtype and
    device of ``mats[0]``. Only the upper triangles are read: the strictly lower parts are ignored.
    """
    if not mats:
        raise ValueError("mats must hold at least one factor")
    shapes = [_factor_shape(f"mats[{k}]", m) for k, m in enumerate(mats)]
    return _pack(mats, shapes, out)


def _pack(mats: Sequence[torch.Tensor], shapes: Sequence[FactorShape], out: torch.Tensor | None) -> torch.Tensor:
    total = sum(packed_numel(s) for s in shapes)
    if out is None:
        out = torch.empty(total, dtype=mats[0].dtype, device=mats[0].device)
    elif out.dim() != 1 or out.numel() != total:
        raise ValueError(f"out must be a flat tensor of {total} elements, got shape {tuple(out.shape)}")
    offset = 0
    for k, (m, shape) in enumerate(zip(mats, shapes)):
        if m.device != out.device:
            raise ValueError(f"mats[{k}] is on {m.device} but the buffer is on {out.device}")
        size = packed_numel(shape)
        _pack_one(m, shape, out[offset:offset + size])
        offset += size
    return out


def pack_triu(mats: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Upper triangles of ``mats`` (square, presumably symmetric) concatenated into one flat tensor.

    ``out``: an optional flat buffer of exactly the packed length, possibly of another dtype (e.g.
    bfloat16 for communication; values are cast). Without it, the buffer has the dtype and device of
    ``mats[0]``. Only the upper triangle is read: the strictly lower part of each matrix is ignored.
    (:func:`pack_factors` packs diagonal and grouped factors too.)
    """
    if not mats:
        raise ValueError("mats must hold at least one matrix")
    sides = [_check_square(f"mats[{k}]", m) for k, m in enumerate(mats)]
    return _pack(mats, [(n, n) for n in sides], out)


def unpack_factors(
    flat: torch.Tensor,
    shapes: Sequence[ShapeLike],
    out: Sequence[torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """The factors rebuilt from a buffer made by :func:`pack_factors`.

    ``shapes``: the shape of each packed factor, in packing order: ``(n,)``, ``(n, n)``, ``(b, n, n)``, or an
    int n for ``(n, n)``. ``out``: optional tensors to fill (one per factor, of its shape, any float dtype);
    otherwise new ones of ``dtype`` (default: the buffer's dtype) on the buffer's device. In a dense block,
    element ``(i, j)`` and ``(j, i)`` are copies of the same packed value, so the blocks are exactly symmetric.
    """
    sizes = check_shapes("shapes", shapes, low=0)
    total = sum(packed_numel(s) for s in sizes)
    if flat.dim() != 1 or flat.numel() != total:
        raise ValueError(f"flat must be a flat tensor of {total} elements for shapes "
                         f"[{', '.join(describe(s) for s in sizes)}], got shape {tuple(flat.shape)}")
    if out is not None and len(out) != len(sizes):
        raise ValueError(f"out must hold one tensor per shape ({len(sizes)}), got {len(out)}")
    dtype = flat.dtype if dtype is None else dtype
    results: list[torch.Tensor] = []
    offset = 0
    for k, shape in enumerate(sizes):
        size = packed_numel(shape)
        seg = flat[offset:offset + size]
        offset += size
        if out is None:
            target = torch.empty(shape, dtype=dtype, device=flat.device)
        else:
            target = out[k]
            if tuple(target.shape) != shape:
                raise ValueError(f"out[{k}] must have shape {shape}, got {tuple(target.shape)}")
            if target.device != flat.device:
                raise ValueError(f"out[{k}] is on {target.device} but flat is on {flat.device}")
        _unpack_one(seg, shape, target)
        results.append(target)
    return results


def unpack_triu(
    flat: torch.Tensor,
    sides: Sequence[int],
    out: Sequence[torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """Full symmetric matrices rebuilt from a buffer made by :func:`pack_triu`.

    ``sides``: n of each packed matrix, in packing order. ``out``: optional matrices to fill (one per
    side, ``n x n``, any float dtype); otherwise new ones of ``dtype`` (default: the buffer's dtype) on the
    buffer's device. Element ``(i, j)`` and ``(j, i)`` are copies of the same packed value, so the
    results are exactly symmetric. (:func:`unpack_factors` rebuilds diagonal and grouped factors too.)
    """
    ns = val.check_ints("sides", sides, low=0)
    total = sum(triu_size(n) for n in ns)
    if flat.dim() != 1 or flat.numel() != total:
        raise ValueError(f"flat must be a flat tensor of {total} elements for sides {ns}, "
                         f"got shape {tuple(flat.shape)}")
    if out is not None and len(out) != len(ns):
        raise ValueError(f"out must hold one matrix per side ({len(ns)}), got {len(out)}")
    return unpack_factors(flat, [(n, n) for n in ns], out=out, dtype=dtype)
