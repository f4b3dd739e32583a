"""Small helpers shared by the comm executors: process-group facts and the dtypes they send."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .. import validation as val

# The torch dtypes the executors can send factors and inverses in (the user-facing SPDOptions.comm_dtype
# names, lightning_spdkfac.vocabulary.COMM_DTYPE_NAMES, are a subset of these).
WIRE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def check_wire_dtype(name: str, dtype: object) -> torch.dtype:
    checked: torch.dtype = val.check_member(name, dtype, WIRE_DTYPES, torch.dtype)
    return checked


NAN = math.nan


def distributed_ready(process_group: object | None) -> bool:
    """True when collectives can run; False means one local process (no group given, none initialized)."""
    if dist.is_available() and dist.is_initialized():
        return True
    if process_group is not None:
        raise RuntimeError("a process_group was given but torch.distributed is not initialized")
    return False


def global_rank(process_group: dist.ProcessGroup | None, rank_in_group: int) -> int:
    """The global rank of ``rank_in_group`` (what ``src=`` of collectives expects)."""
    if process_group is None or process_group is dist.GroupMember.WORLD:
        return rank_in_group
    return dist.get_global_rank(process_group, rank_in_group)


def default_device(process_group: dist.ProcessGroup | None) -> torch.device:
    """Where receive buffers live when no tensor says otherwise: the current GPU for NCCL, else CPU."""
    if distributed_ready(process_group) and dist.get_backend(process_group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
