"""Which layers an optimizer steps, and at which learning rate: what the KL clip must know.

``KFACPreconditioner.step(optimizer=opt)`` preconditions only the layers whose parameters ``opt``
holds, and the KL clip weighs each layer by the learning rate of the param group holding its weight:
per-group learning rates (discriminative fine-tuning, a frozen backbone at lr 0) and several
optimizers (manual optimization, GANs) each get the step they take, not the first group's.

The module parameters of each param group are read from the groups themselves, or, for DeepSpeed's
wrappers whose ``param_groups`` hold flat fp32 partitions, from the lists they keep of the module
parameters per group (``bit16_groups``: ZeRO 1/2; ``bf16_groups``: the bf16 optimizer;
``fp16_groups``: the fp16 optimizer), which follow the client optimizer's group order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["StepGroups", "group_params", "step_groups", "unwrap"]

_DEEPSPEED_GROUPS = ("bit16_groups", "bf16_groups", "fp16_groups")


def unwrap(optimizer: Any) -> Any:
    """The optimizer under Lightning's ``LightningOptimizer`` wrapper (itself otherwise)."""
    inner = getattr(optimizer, "_optimizer", None)
    return inner if inner is not None and hasattr(inner, "param_groups") else optimizer


def group_params(optimizer: Any) -> list[list[torch.Tensor]]:
    """The module parameters of each of ``optimizer.param_groups``, in group order."""
    opt = unwrap(optimizer)
    groups = getattr(opt, "param_groups", None)
    if not isinstance(groups, Sequence):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer (with param_groups), got {type(optimizer).__name__}")
    for attr in _DEEPSPEED_GROUPS:
        kept = getattr(opt, attr, None)
        if isinstance(kept, Sequence) and len(kept) == len(groups) and kept:
            return [list(g) for g in kept]
    return [list(g["params"]) for g in groups]


@dataclass(frozen=True)
class StepGroups:
    """Layer index -> index of the param group holding its weight, for the layers one optimizer steps."""

    optimizer: Any
    layer_group: dict[int, int]
    key: tuple[int, ...]

    def current(self, optimizer: Any) -> bool:
        """Still the map of ``optimizer`` (no param group added or resized since it was made)?"""
        return self.optimizer is optimizer and self.key == _key(optimizer)

    def lrs(self) -> dict[int, float]:
        """Layer index -> its group's learning rate now (read at every step: schedulers change it)."""
        groups = unwrap(self.optimizer).param_groups
        return {index: float(groups[g]["lr"]) for index, g in self.layer_group.items()}


def _key(optimizer: Any) -> tuple[int, ...]:
    """Changes when param groups are added or their parameters change (``add_param_group``)."""
    groups = unwrap(optimizer).param_groups
    return (id(unwrap(optimizer)), len(groups), *(len(g["params"]) for g in groups))


def step_groups(optimizer: Any, layers: Sequence[tuple[int, str, Sequence[torch.nn.Parameter]]]) -> StepGroups:
    """Map the layers (index, name, [weight, bias?]) to the param groups of ``optimizer``.

    A layer none of whose parameters the optimizer holds is left out (another optimizer, or none, steps
    it). A layer whose weight and bias are split between this optimizer and another one (or none) cannot
    be preconditioned as one block by either: ValueError naming it. Weight and bias in two groups of the
    same optimizer are fine; the weight's group lr is the layer's.
    """
    where = {id(p): g for g, params in enumerate(group_params(optimizer)) for p in params}
    layer_group: dict[int, int] = {}
    for index, name, params in layers:
        found = [where.get(id(p)) for p in params]
        if all(g is None for g in found):
            continue
        if any(g is None for g in found):
            held = [kind for kind, g in zip(("weight", "bias"), found) if g is not None]
            raise ValueError(
                f"K-FAC layer {name!r}: the optimizer steps only its {' and '.join(held)}, not all of its "
                "parameters; K-FAC preconditions a layer's weight and bias as one block, so give both to the "
                "same optimizer (or exclude the layer from K-FAC with skip_layers)")
        layer_group[index] = found[0]  # type: ignore[assignment]  # (not None: checked above)
    return StepGroups(optimizer=optimizer, layer_group=layer_group, key=_key(optimizer))
