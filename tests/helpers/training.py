"""The SGD + K-FAC loop the distributed tests train with, on one rank of a DDP job or in one process."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lightning_spdkfac import KFACPreconditioner

Data = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]  # (step, world) -> the joint batch (x, y)


def sgd_kfac_steps(net: nn.Module, pre: KFACPreconditioner, data: Data, steps: int, world: int,
                   rank: int | None = None, batch: int = 0) -> None:
    """``steps`` steps of SGD (lr 0.1, momentum 0.9) with ``pre.step()`` between backward and the step.

    ``data(step, world)`` is the joint batch of all ranks. With ``rank``, ``net`` (a DDP module) trains
    on that rank's slice of ``batch`` examples; without, on the whole joint batch: the one-process run
    the distributed ones must equal.
    """
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = data(step, world)
        if rank is not None:
            x, y = x[rank * batch:(rank + 1) * batch], y[rank * batch:(rank + 1) * batch]
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        pre.step()
        opt.step()
