"""A deterministic measure of the memory a piece of PyTorch code takes: the bytes of live tensor storages, counted
at the dispatcher (no RSS, no timing), and their peak.

:class:`AllocTracker` is a ``TorchDispatchMode``: every op's output whose storage is new (not the storage of one of
its inputs, nor one already counted) adds the storage's bytes; a storage is freed when the last tensor seen holding
it dies (a ``weakref.finalize`` on each, which CPython runs when the last reference goes, so the count follows the
program exactly). Tensors that exist before the measure (the state a step starts from) are adopted with
:meth:`AllocTracker.adopt`: counted as live, freed when they die.

LAPACK's own work arrays are allocated inside the kernels, below the dispatcher, and are no tensor any op returns:
the one that matters, the symmetric eigendecomposition's (``syevd``: ``1 + 6n + 2n^2`` elements of the matrix's
dtype and ``3 + 5n`` 32-bit integers for an ``n x n`` matrix, allocated once per call, batched or not; LAPACK's
documented minimum, and what torch allocates, measured with the profiler), is added while the op runs, computed
here from that formula.

The mode is per thread: :meth:`AllocTracker.on_this_thread` enters another mode that shares the counts (the
asynchronous inverses' worker).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_EIGH = {torch.ops.aten._linalg_eigh.default, torch.ops.aten.linalg_eigh.default}


def syevd_work_bytes(n: int, dtype: torch.dtype) -> int:
    """LAPACK's documented minimum workspace of ``?syevd`` with eigenvectors, for an ``n x n`` matrix."""
    return (1 + 6 * n + 2 * n * n) * torch.empty((), dtype=dtype).element_size() + (3 + 5 * n) * 4


class _Mode(TorchDispatchMode):
    def __init__(self, tracker: AllocTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        t = self.tracker
        inputs = {_key(x) for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)}
        work = 0
        if func in _EIGH:
            a = args[0]
            work = syevd_work_bytes(a.shape[-1], a.dtype)
        out = func(*args, **kwargs)
        with t.lock:
            # The work array lives while the kernel runs: with the inputs and the outputs, allocated before it.
            t.bump(work)
            for x in tree_flatten(out)[0]:
                if isinstance(x, torch.Tensor):
                    t.see(x, new=_key(x) not in inputs)
            t.bump(-work)
        return out


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class AllocTracker:
    """Live tensor-storage bytes and their peak, from :meth:`start` (``with tracker:``) on."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.live = 0  # bytes
        self.peak = 0
        self._extra = 0  # LAPACK work arrays in use
        self._holders: dict[int, set[int]] = {}  # storage -> ids of the tensors seen holding it
        self._bytes: dict[int, int] = {}
        self._mode: _Mode | None = None

    def bump(self, n: int) -> None:
        self._extra += n
        self.peak = max(self.peak, self.live + self._extra)

    def see(self, x: torch.Tensor, new: bool = True) -> None:
        """Count ``x``'s storage if it is new; follow ``x``'s lifetime either way (when tracked)."""
        key = _key(x)
        if key == 0:
            return
        if key not in self._holders:
            if not new:
                return  # a view or in-place result of a storage from before the measure, not adopted
            self._holders[key] = set()
            self._bytes[key] = x.untyped_storage().nbytes()
            self.live += self._bytes[key]
            self.peak = max(self.peak, self.live + self._extra)
        holders = self._holders[key]
        if id(x) in holders:
            return
        holders.add(id(x))
        weakref.finalize(x, self._release, key, id(x))

    def _release(self, key: int, tid: int) -> None:
        with self.lock:
            holders = self._holders.get(key)
            if holders is None or tid not in holders:
                return
            holders.discard(tid)
            if not holders:
                del self._holders[key]
                self.live -= self._bytes.pop(key)

    def adopt(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Count tensors that exist already (each storage once) as live, freed when the last of them dies."""
        with self.lock:
            for x in tensors:
                if x is not None:
                    self.see(x)

    def reset_peak(self) -> None:
        with self.lock:
            self.peak = self.live

    def __enter__(self) -> AllocTracker:
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._mode is not None
        self._mode.__exit__(*exc)
        self._mode = None

    @contextmanager
    def on_this_thread(self) -> Iterator[None]:
        """Track another thread too (a mode is per thread); the counts are shared."""
        with _Mode(self):
            yield
