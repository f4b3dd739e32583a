"""Grafting: K-FAC's direction with another optimizer's step size, layer by layer (``grafting`` option).

K-FAC's preconditioned gradient ``P = G^-1 [dW, db] A^-1`` has a good direction but a magnitude set by the
damping and the factors' scale, so the learning rate that suits it is not the one tuned for the base
optimizer (the project's time-to-accuracy sweeps found K-FAC's best lr 3x or 1/3 of AdamW's). Grafting, as
Distributed Shampoo does it (Anil et al. 2020, "Scalable second order optimization for deep learning",
sec. 4.2 "learning-rate grafting"), keeps each layer's direction from K-FAC and takes its norm from the
direction another optimizer would use::

    P_l <- P_l * ||D_l|| / ||P_l||        (P_l = 0 is left as it is)

``"sgd"``: ``D_l = [dW, db]``, the plain gradient: the step of each layer has the norm of SGD's at the same
lr, so an lr tuned for SGD carries over.

``"adam"``: ``D_l = g / (sqrt(v_hat) + eps)``, Adam's direction without its momentum, from a second moment
kept here: ``v <- beta2 v + (1 - beta2) g^2``, ``v_hat = v / (1 - beta2^t)`` (t: this layer's grafted steps),
with ``beta2`` and ``eps`` read from the param group of the optimizer given to ``step()`` when it has
``betas`` and ``eps`` (Adam, AdamW), else 0.999 and 1e-8. Meant for an SGD-type base optimizer (SGD with
momentum at an lr tuned for Adam): an Adam-type base optimizer divides what it receives by its own running
RMS, which undoes any per-layer scale (its update does not depend on the gradient's scale), so under Adam
or AdamW grafting changes little and the lr stays AdamW's own.

The KL clip is applied after grafting, to the grafted directions. The running second moments are part of
the preconditioner's state (checkpoints resume them exactly).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..vocabulary import GraftingName

DEFAULT_BETA2 = 0.999
DEFAULT_EPS = 1e-8

__all__ = ["AdamGraftState", "graft"]


class AdamGraftState:
    """The second moment of one layer's ``[dW, db]`` and how many steps it has seen."""

    def __init__(self) -> None:
        self.v: torch.Tensor | None = None
        self.t = 0

    def direction_norm(self, g: torch.Tensor, beta2: float, eps: float) -> torch.Tensor:
        """||g / (sqrt(v_hat) + eps)|| after folding ``g`` into the second moment (a 0-dim tensor)."""
        g2 = g.double().square()
        if self.v is None or self.v.shape != g.shape:
            self.v, self.t = torch.zeros_like(g2), 0
        self.v.mul_(beta2).add_(g2, alpha=1.0 - beta2)
        self.t += 1
        v_hat = self.v / (1.0 - beta2**self.t)
        norm: torch.Tensor = (g.double() / (v_hat.sqrt() + eps)).norm()
        return norm


def graft(kind: GraftingName, precs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
          states: Sequence[AdamGraftState] | None = None, beta2: float = DEFAULT_BETA2,
          eps: float = DEFAULT_EPS) -> list[torch.Tensor]:
    """Each ``P_l`` rescaled to the norm of the direction ``kind`` would use for the gradient ``g_l`` (module
    docstring); no host synchronization."""
    out = []
    for i, (p, g) in enumerate(zip(precs, grads, strict=True)):
        if kind == "sgd":
            target = g.double().norm()
        else:
            assert states is not None  # one per layer with kind "adam"
            target = states[i].direction_norm(g, beta2, eps)
        norm = p.double().norm()
        scale = torch.where(norm > 0, target / norm.clamp_min(torch.finfo(torch.float64).tiny), 1.0)
        out.append(p * scale.to(p.dtype))
    return out
