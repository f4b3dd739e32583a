"""What the parts of one :class:`~lightning_spdkfac.kfac.KFACPreconditioner` share, in one typed object.

The preconditioner is composed of parts, each owning its own state (kfac/registration.py, factor_updates.py,
inverse_steps.py, preconditioning.py, coverage.py, checkpoint.py, guard.py). What more than one part reads is here,
and only that: the model and its registered layers, the options and the hyperparameters that may change during a run
(``damping`` under ``adapt_damping``), where the gradients live and the step's gradients, the distributor, the step
counter and the step timer. Every part gets this object at construction; nothing else is passed around.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from .. import validation as val
from ..telemetry import StepTimer
from .auto_damping import DEFAULT_DAMPING
from .distributor import Distributor, OwnerHeld
from .gradients import GradAccess
from .layer_state import KFACLayer
from .options import KFACOptions


@dataclass(eq=False)
class Core:
    """The state the preconditioner's parts share (docs/concepts/how-it-is-built.md)."""

    model: nn.Module
    options: KFACOptions
    distributor: Distributor
    grad_access: GradAccess
    timer: StepTimer
    # The hyperparameters, from the options; ``damping`` changes under adapt_damping, and the cadences may be set
    # by hand between steps.
    damping: val.HParam
    factor_decay: val.HParam
    kl_clip: val.HParam | None
    lr: val.HParam | None
    factor_update_steps: int
    inv_update_steps: int
    skip_layers: tuple[re.Pattern[str], ...]
    factor_dtype: torch.dtype
    inv_dtype: torch.dtype
    # "eigen": A_inv / G_inv hold eigen payloads and the block is damped exactly (kfac/inverse.py).
    eigen: bool
    # One process with the base distributor: the in-place fast path.
    local: bool
    layers: dict[str, KFACLayer] = field(default_factory=dict)
    # K-FAC's parameters (each once) and the others, set by the registration.
    grad_params: list[nn.Parameter] = field(default_factory=list)
    other_params: list[nn.Parameter] = field(default_factory=list)
    # Distributed preconditioning (schedule="dpkfac"): the distributor holding each layer on its owner and the owner
    # of each layer; None: every rank holds all. Set once the distributor is set up.
    owner_held: OwnerHeld | None = None
    owners: tuple[int, ...] | None = None
    steps: int = 0  # optimizer steps taken (calls of step())
    # parameter -> gradient tensor, while step() runs; False once the step's gradients were found non-finite
    grads: dict[nn.Parameter, torch.Tensor | None] = field(default_factory=dict)
    grads_finite: bool = True
    # True while forwards are not trained through (Lightning's SWA BatchNorm pass, the step size's measurement): the
    # hooks collect nothing.
    paused: bool = False
    # layer name -> why its block produced no factors though its weight got a gradient (measured; kfac/coverage.py)
    unfactored: dict[str, str] = field(default_factory=dict)
    warned: set[tuple[str, str]] = field(default_factory=set)

    @classmethod
    def from_options(cls, model: nn.Module, options: KFACOptions, distributor: Distributor,
                     grad_access: GradAccess) -> Core:
        o = options
        return cls(model=model, options=o, distributor=distributor, grad_access=grad_access, timer=StepTimer(),
                   damping=DEFAULT_DAMPING if o.damping == "auto" else o.damping,  # ("auto": see step())
                   factor_decay=o.factor_decay, kl_clip=o.kl_clip, lr=o.lr,
                   factor_update_steps=o.factor_update_steps, inv_update_steps=o.inv_update_steps,
                   skip_layers=tuple(re.compile(p) for p in o.skip_layers),
                   factor_dtype=o.factor_dtype, inv_dtype=o.inv_dtype,  # type: ignore[arg-type]
                   eigen=o.inverse_method == "eigen", local=distributor.is_local)

    @property
    def collecting(self) -> bool:
        """Whether the hooks collect factor statistics for the coming step."""
        return self.steps % self.factor_update_steps == 0

    def sharing(self) -> OwnerHeld:
        """The distributor as it holds layers on their owners (called where ``owners`` is set)."""
        if self.owner_held is None:
            raise TypeError(f"{type(self.distributor).__name__} sets layer_owners but does not implement OwnerHeld "
                            "(lightning_spdkfac.kfac.distributor): distributed preconditioning needs its methods")
        return self.owner_held

    def warn_once(self, layer: str, key: str, message: str) -> None:
        if (layer, key) not in self.warned:
            self.warned.add((layer, key))
            warnings.warn(message, stacklevel=3)
