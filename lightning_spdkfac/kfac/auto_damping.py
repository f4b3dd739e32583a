"""``damping="auto"`` (the default): the damping K-FAC uses, chosen by the optimizer that steps.

Measured on six workloads, 3 seeds each (docs/results/time-to-accuracy.md, "six workloads against the whole field";
issue 37): under AdamW no damping from 1e-4 to 1e-1 stalled, and 1e-3 reached the targets in at most the epochs of
3e-2 on all five AdamW workloads, in fewer on four (GPT-2 over 400 steps: 80 steps against 160). Adam's
per-coordinate normalisation bounds each step whatever K-FAC's direction, so a weak damping only makes the
direction closer to the natural gradient. Under SGD the same 1e-3 stalls the digits CNN (a weakly damped block's
smallest eigenvalues take the KL clip's whole budget), and 3e-2 is the damping every SGD workload trained at.

So ``"auto"`` resolves, at the first :meth:`KFACPreconditioner.step` (or at construction when an ``optimizer`` is
given), to :data:`ADAM_TYPE_DAMPING` under an Adam-type optimizer (one that divides by a running second moment, per
coordinate: torch's Adam family, Adagrad, RMSprop, Adadelta, or a class named ``*Adam*`` such as DeepSpeed's
``FusedAdam``, wrappers unwrapped) in the default update, and to :data:`DEFAULT_DAMPING` otherwise: SGD, Muon, any
other optimizer, the eigenbasis mode (whose damping is a floor relative to each block's moment, measured at 3e-2),
or a step without an optimizer. With several optimizers, the first one that steps decides. A number (or a schedule)
passed as ``damping`` is used as it is.
"""

from __future__ import annotations

from typing import Any

import torch

ADAM_TYPE_DAMPING = 1e-3
DEFAULT_DAMPING = 3e-2

_ADAM_TYPES: tuple[type, ...] = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
                                 torch.optim.RAdam, torch.optim.SparseAdam, torch.optim.Adagrad, torch.optim.RMSprop,
                                 torch.optim.Adadelta)


def unwrap(optimizer: Any) -> Any:
    """The optimizer inside wrappers (Lightning's ``LightningOptimizer``, DeepSpeed's ZeRO optimizers)."""
    for _ in range(8):
        inner = getattr(optimizer, "_optimizer", None) or getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer or not hasattr(inner, "param_groups"):
            return optimizer
        optimizer = inner
    return optimizer


def is_adam_type(optimizer: Any) -> bool:
    """Does ``optimizer`` (unwrapped) normalise each coordinate by a running second moment? (:func:`is_adam_class`)"""
    return is_adam_class(type(unwrap(optimizer)))


def is_adam_class(cls: type) -> bool:
    """Is ``cls`` an Adam-type optimizer class? Muon (and classes that combine Muon with AdamW) do not count: Muon
    orthogonalises instead."""
    name = cls.__name__.lower()
    if "muon" in name:
        return False
    return issubclass(cls, _ADAM_TYPES) or "adam" in name


def resolve(optimizer: Any, update: str) -> tuple[float, str]:
    """The damping ``"auto"`` stands for under ``optimizer`` (None: none seen) and ``update``, and why."""
    return resolve_class(None if optimizer is None else type(unwrap(optimizer)), update)


def resolve_class(cls: type | None, update: str) -> tuple[float, str]:
    """:func:`resolve` for an optimizer class (None: no optimizer), before any instance exists."""
    if update != "kfac":
        return DEFAULT_DAMPING, f"update={update!r}"
    if cls is None:
        return DEFAULT_DAMPING, "no optimizer given to step()"
    if is_adam_class(cls):
        return ADAM_TYPE_DAMPING, f"{cls.__name__}, an Adam-type optimizer"
    return DEFAULT_DAMPING, cls.__name__
