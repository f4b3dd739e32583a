"""Upper-triangle packing of symmetric factors: only n(n+1)/2 elements of an n x n factor travel.

``pack_triu`` gathers the upper triangles (diagonal included, row-major) of a list of square matrices
into one flat buffer; ``unpack_triu`` rebuilds the full matrices from it, mirroring the triangle, so
the results are *exactly* symmetric whatever rounding the buffer went through.

Both are one gather per matrix with cached index tensors (per side and device), no element loops and
no host synchronization (``index_select`` sizes are known on the host, unlike boolean masking), so they
can sit on an asynchronous GPU pipeline. The indices are int32 (half the memory of int64): the packing
index holds n(n+1)/2 entries, the mirroring index n*n.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from .. import validation as val

__all__ = ["pack_triu", "triu_size", "unpack_triu"]

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


def pack_triu(mats: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Upper triangles of ``mats`` (square, presumably symmetric) concatenated into one flat tensor.

    ``out``: an optional flat buffer of exactly the packed length, possibly of another dtype (e.g.
    bfloat16 for communication; values are cast). Without it, the buffer has the dtype and device of
    ``mats[0]``. Only the upper triangle is read: the strictly lower part of each matrix is ignored.
    """
    if not mats:
        raise ValueError("mats must hold at least one matrix")
    sides = [_check_square(f"mats[{k}]", m) for k, m in enumerate(mats)]
    total = sum(triu_size(n) for n in sides)
    device = mats[0].device
    if out is None:
        out = torch.empty(total, dtype=mats[0].dtype, device=device)
    elif out.dim() != 1 or out.numel() != total:
        raise ValueError(f"out must be a flat tensor of {total} elements, got shape {tuple(out.shape)}")
    offset = 0
    for k, (m, n) in enumerate(zip(mats, sides)):
        if m.device != out.device:
            raise ValueError(f"mats[{k}] is on {m.device} but the buffer is on {out.device}")
        size = triu_size(n)
        seg = out[offset:offset + size]
        idx = _triu_index(n, _device_key(m.device))
        flat = m.reshape(-1)  # a view when m is contiguous, else one copy
        if m.dtype == out.dtype:
            torch.index_select(flat, 0, idx, out=seg)
        else:
            seg.copy_(flat.index_select(0, idx))
        offset += size
    return out


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
    results are exactly symmetric.
    """
    ns = val.check_ints("sides", sides, low=0)
    total = sum(triu_size(n) for n in ns)
    if flat.dim() != 1 or flat.numel() != total:
        raise ValueError(f"flat must be a flat tensor of {total} elements for sides {ns}, "
                         f"got shape {tuple(flat.shape)}")
    if out is not None and len(out) != len(ns):
        raise ValueError(f"out must hold one matrix per side ({len(ns)}), got {len(out)}")
    dtype = flat.dtype if dtype is None else dtype
    results: list[torch.Tensor] = []
    offset = 0
    for k, n in enumerate(ns):
        size = triu_size(n)
        seg = flat[offset:offset + size]
        offset += size
        idx = _mirror_index(n, _device_key(flat.device))
        if out is None:
            target = torch.empty(n, n, dtype=dtype, device=flat.device)
        else:
            target = out[k]
            if tuple(target.shape) != (n, n):
                raise ValueError(f"out[{k}] must have shape ({n}, {n}), got {tuple(target.shape)}")
            if target.device != flat.device:
                raise ValueError(f"out[{k}] is on {target.device} but flat is on {flat.device}")
        if seg.dtype != target.dtype:
            seg = seg.to(target.dtype)  # cast the n(n+1)/2 triangle, not the n^2 result
        if target.is_contiguous():
            torch.index_select(seg, 0, idx, out=target.view(-1))
        else:
            target.copy_(seg.index_select(0, idx).view(n, n))
        results.append(target)
    return results
