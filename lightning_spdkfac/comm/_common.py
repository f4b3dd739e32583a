"""Small helpers shared by the comm executors: process-group facts, argument checks, timing records."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch
import torch.distributed as dist

COMM_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

NAN = math.nan


def distributed_ready(process_group: object | None) -> bool:
    """True when collectives can run; False means one local process (no group given, none initialized)."""
    if dist.is_available() and dist.is_initialized():
        return True
    if process_group is not None:
        raise RuntimeError("a process_group was given but torch.distributed is not initialized")
    return False


def group_size(process_group: object | None) -> int:
    return dist.get_world_size(process_group) if distributed_ready(process_group) else 1


def group_rank(process_group: object | None) -> int:
    return dist.get_rank(process_group) if distributed_ready(process_group) else 0


def global_rank(process_group: object | None, rank_in_group: int) -> int:
    """The global rank of ``rank_in_group`` (what ``src=`` of collectives expects)."""
    if process_group is None or process_group is dist.GroupMember.WORLD:
        return rank_in_group
    return dist.get_global_rank(process_group, rank_in_group)


def default_device(process_group: object | None) -> torch.device:
    """Where receive buffers live when no tensor says otherwise: the current GPU for NCCL, else CPU."""
    if distributed_ready(process_group) and dist.get_backend(process_group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_comm_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    if dtype not in COMM_DTYPES:
        raise ValueError(f"{name} must be one of {', '.join(str(d) for d in COMM_DTYPES)}; got {dtype!r}")
    return dtype


def check_sides(sides: Sequence[int]) -> list[int]:
    if isinstance(sides, str | bytes) or not isinstance(sides, Sequence):
        raise ValueError(f"sides must be a sequence of ints, got {type(sides).__name__}")
    out = []
    for i, n in enumerate(sides):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise ValueError(f"sides[{i}] must be an int >= 1, got {n!r}")
        out.append(int(n))
    return out


def check_index(index: int, count: int) -> int:
    if isinstance(index, bool) or not isinstance(index, numbers.Integral) or not 0 <= index < count:
        raise IndexError(f"factor index must be an int in [0, {count}), got {index!r}")
    return int(index)
