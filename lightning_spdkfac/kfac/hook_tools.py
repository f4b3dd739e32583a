"""Small tools of the preconditioner's forward and gradient hooks: autograd state, compile and autocast."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, TypeVar, cast

import torch


def in_backward() -> bool:
    """Whether autograd is running a backward pass now (activation checkpointing recomputes there)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def eager(fn: _Fn) -> _Fn:
    """``fn`` excluded from torch.compile tracing (run as plain Python; a graph break under compile)."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return fn if disable is None else cast(_Fn, disable(fn, recursive=True))


def autocast_off(device_type: str) -> torch.autocast | nullcontext[None]:
    """Autocast disabled for factor statistics (fp32 factors under bf16/fp16 autocast)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return nullcontext()


class _NoType:
    """What nothing is an instance of (torch without torch.compile)."""


def optimized_module_type() -> type:
    """torch.compile's module wrapper (``OptimizedModule``; a type nothing is an instance of where torch has none)."""
    eval_frame = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    return cast(type, getattr(eval_frame, "OptimizedModule", _NoType))


def holds_compiled(model: torch.nn.Module) -> bool:
    """Whether ``model`` is or holds a torch.compile'd module (whose cached graphs run without hooks added later)."""
    compiled = optimized_module_type()
    return any(isinstance(m, compiled) for m in model.modules())
