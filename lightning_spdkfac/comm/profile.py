"""Profiling of the process group, so that every rank plans from the same measurements.

``measure_allreduce`` / ``measure_broadcast`` time one collective per message size (all ranks take part:
call them on every rank at the same point) and return, on every rank, the same list: the minimum over
``repeats`` timed runs on each rank, then the maximum over ranks (one MAX all-reduce), so a plan derived
from them is identical everywhere. Fitting the alpha-beta model is the planners' job (``schedule/``).
``broadcast_object`` hands rank ``src``'s object (e.g. inversion timings) to every rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .. import validation as val
from ._common import check_wire_dtype, default_device, distributed_ready, global_rank

__all__ = ["broadcast_object", "measure_allreduce", "measure_broadcast", "probe_sizes"]


def probe_sizes(largest: int, cap: int | None = None, points: int = 5) -> list[int]:
    """Message sizes (bytes) to fit an alpha-beta model on: ``points`` geometric steps from 4 KiB (or a
    quarter of the top, if smaller) to ``largest`` (at least 16 KiB), the top bounded by ``cap``."""
    high = max(largest, 4 * 4096)
    if cap is not None:
        high = int(min(high, cap))
    low = min(4096, high // 4)
    return sorted({int(low * (high / low) ** (i / (points - 1))) for i in range(points)})


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure(
    collective: Callable[[torch.Tensor], object],
    sizes_bytes: Sequence[int],
    process_group: dist.ProcessGroup | None,
    repeats: int,
    warmup: int,
    dtype: torch.dtype,
    device: torch.device | str | None,
) -> list[float]:
    sizes = val.check_ints("sizes_bytes", sizes_bytes, low=0)
    val.check_int("repeats", repeats, low=1)
    val.check_int("warmup", warmup, low=0)
    check_wire_dtype("dtype", dtype)
    if not distributed_ready(process_group):
        return [0.0] * len(sizes)  # one process: nothing is communicated
    dev = torch.device(device) if device is not None else default_device(process_group)
    element = torch.empty((), dtype=dtype).element_size()
    medians: list[float] = []
    for size in sizes:
        buf = torch.zeros(max(1, size // element), dtype=dtype, device=dev)
        for _ in range(warmup):
            collective(buf)
        _sync(dev)
        times = []
        for _ in range(repeats):
            dist.barrier(group=process_group)  # start together: we time the collective, not the skew
            t0 = time.perf_counter()
            collective(buf)
            _sync(dev)
            times.append(time.perf_counter() - t0)
        medians.append(min(times))  # the uncontended cost: noise only ever adds time
    worst = torch.tensor(medians, dtype=torch.float64, device=dev)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=process_group)
    return [float(x) for x in worst.tolist()]


def measure_allreduce(
    sizes_bytes: Sequence[int],
    process_group: dist.ProcessGroup | None = None,
    repeats: int = 5,
    warmup: int = 1,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> list[float]:
    """Seconds of one SUM all-reduce of each size (bytes, rounded down to whole ``dtype`` elements, at
    least one): minimum over ``repeats`` barrier-aligned runs, maximum over ranks; identical on every
    rank. All zeros without torch.distributed (one process). Collective: call on every rank."""

    def collective(buf: torch.Tensor) -> object:
        return dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=process_group)

    return _measure(collective, sizes_bytes, process_group, repeats, warmup, dtype, device)


def measure_broadcast(
    sizes_bytes: Sequence[int],
    process_group: dist.ProcessGroup | None = None,
    repeats: int = 5,
    src: int = 0,
    warmup: int = 1,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> list[float]:
    """Like :func:`measure_allreduce`, for a broadcast from group rank ``src``."""
    root = global_rank(process_group, src) if distributed_ready(process_group) else src

    def collective(buf: torch.Tensor) -> object:
        return dist.broadcast(buf, src=root, group=process_group)

    return _measure(collective, sizes_bytes, process_group, repeats, warmup, dtype, device)


def broadcast_object(obj: Any, src: int = 0, group: dist.ProcessGroup | None = None) -> Any:
    """Rank ``src``'s ``obj`` (picklable) on every rank; ``obj`` itself without torch.distributed.

    Collective: call on every rank (the others' ``obj`` is ignored). With NCCL the current CUDA device
    carries the bytes, so set it first (``torch.cuda.set_device``)."""
    if not distributed_ready(group):
        return obj
    holder = [obj if dist.get_rank(group) == src else None]
    dist.broadcast_object_list(holder, src=global_rank(group, src), group=group)
    return holder[0]
