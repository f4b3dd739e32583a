"""The seam between the preconditioner and wherever the reduced gradients live.

Under DDP (and on one process) the averaged gradient of a parameter is ``param.grad`` and the
preconditioner rewrites it in place. Under DeepSpeed ZeRO the gradient that the optimizer will
read is a fragment of a flat, partitioned fp32 buffer, and ``param.grad`` is ``None``. A
*gradient access* hides the difference:

1. ``open(params)`` once per optimizer step, on every rank, with the same parameters in the
   same order (an implementation may run a collective here). It returns, for each parameter, a
   full-shaped tensor holding that parameter's reduced gradient (or None when it has none). The
   preconditioner reads these tensors and writes the preconditioned gradient into them in place.
2. ``close(grads)`` after the last write: commits the tensors to where the optimizer reads
   them (nothing to do when they *are* ``param.grad``).
3. ``loss_scale()``: the factor by which these gradients and the output gradients seen by the
   backward hooks are multiplied (a dynamic fp16 loss scale that is still applied at step
   time); 1.0 when gradients arrive unscaled.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .layer_state import KFACLayer


class GradAccess:
    """``param.grad``, read and written in place (DDP, one process)."""

    def open(self, params: Sequence[torch.nn.Parameter]) -> dict[torch.nn.Parameter, torch.Tensor | None]:
        return {p: p.grad for p in params}

    def close(self, grads: dict[torch.nn.Parameter, torch.Tensor | None]) -> None:
        """The tensors are the gradients themselves: nothing to commit."""

    def loss_scale(self) -> float:
        return 1.0


SHARDED_HINT = ("FSDP and DeepSpeed ZeRO strategies that are not K-FAC-aware keep sharded or flattened gradients; use "
                "SPDKFACDeepSpeedStrategy or the DDP strategy (SPDKFACStrategy)")


def check_grad_shape(layer: KFACLayer, what: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    """Refuse, naming the layer, a gradient whose shape is not what its parameters and factors need."""
    if got != want:
        raise RuntimeError(
            f"K-FAC layer {layer.name!r}: its {what} has shape {tuple(got)}, not {tuple(want)}: K-FAC cannot read "
            "it as the layer's gradient (a sharded or flattened gradient, or a layer whose shape changed after "
            f"setup). {SHARDED_HINT}; or rebuild the preconditioner after changing a layer")
