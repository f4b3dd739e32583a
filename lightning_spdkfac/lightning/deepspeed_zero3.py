"""The reduced gradients of a DeepSpeed engine at ZeRO stage 3, for K-FAC: :class:`DeepSpeedZero3GradAccess`.

At stage 3 DeepSpeed partitions the parameters themselves: outside a module's forward and backward a
parameter holds an empty tensor (``param.shape`` is ``(0,)``; ``param.ds_shape`` is its real shape) and
this rank's ``1/world`` of it, zero-padded, in ``param.ds_tensor``. The averaged fp32 gradient lives the
same way, as this rank's equal-sized slice of the flattened gradient, in the stage-3 optimizer.

K-FAC's factors need no change: DeepSpeed gathers a module's parameters before its forward and backward,
and the factor hooks read the layer's inputs and output gradients, never its weight. The step needs:

- the whole gradient matrix of every K-FAC layer: one all-gather of the slices (each rank sends the
  slices it holds of every K-FAC parameter, packed; on gloo, one broadcast per rank), bitwise what
  ``deepspeed.utils.safe_get_full_grad`` returns parameter by parameter (one all-gather each). Where the
  optimizer's internals are not the ones this is written against (optimizer offload), it uses that public
  accessor instead;
- the preconditioned gradient written back: this rank's slice of it copied into the optimizer's (no
  communication). ``safe_set_full_grad`` does the same through ``set_fp32_grad_for_param``, but (DeepSpeed
  0.19.8) it fails on the last rank wherever the parameter's size is not a multiple of the world size: it
  reads the padding of the last slice from the unpadded full gradient. Only the elements that exist are
  copied here; the padding is left as the engine made it;
- the parameters' full shapes (the preconditioner checks each gradient against its weight's shape, and
  the step-size and grafting rules read the weights): the partitioned K-FAC parameters are gathered
  for the step and partitioned again when the gradients are written back, as DeepSpeed does for a
  forward. This is one all-gather of the K-FAC layers' weights per preconditioned step, and the full
  weights of those layers in memory for its duration, beside their full gradients.

Every rank holds the full factors and inverses of every layer, as under ZeRO 0/1/2 (the SPD schedule
places the inversions, the inverses are broadcast); only the gradients and parameters are partitioned.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .deepspeed_grads import DeepSpeedGradAccess, _all_gather

if TYPE_CHECKING:
    import deepspeed

__all__ = ["DeepSpeedZero3GradAccess", "is_zero3_param"]


def is_zero3_param(p: torch.nn.Parameter) -> bool:
    """Is ``p`` partitioned by DeepSpeed's ZeRO stage 3 (it carries a ``ds_id``)?"""
    return hasattr(p, "ds_id")


def _fusable3(params: Sequence[Any]) -> bool:
    """Can the slices of ``params`` be read from the stage-3 optimizer directly? Decided from what is the same
    on every rank (the optimizer's configuration and the parameters' groups), so every rank takes the same path."""
    optimizer = getattr(params[0], "_z3_optimizer", None)
    if optimizer is None or getattr(optimizer, "offload_optimizer", True):
        return False
    if not (hasattr(optimizer, "_get_fp32_grad_state_partition") and hasattr(optimizer, "set_fp32_grad_for_param")):
        return False
    group = getattr(params[0], "ds_process_group", None)
    return all(getattr(p, "_z3_optimizer", None) is optimizer and getattr(p, "ds_process_group", None) is group
               for p in params)


class DeepSpeedZero3GradAccess(DeepSpeedGradAccess):
    """Full gradients (and, for the step, full parameters) of the K-FAC layers under ZeRO stage 3.

    ``open`` is collective: every rank calls it with the same parameters in the same order, between the
    engine's backward and its step; ``close`` writes back locally and partitions the gathered parameters.
    """

    def __init__(self, engine_fn: Callable[[], deepspeed.DeepSpeedEngine], fused: bool = True) -> None:
        super().__init__(engine_fn, fused=fused)
        self._z3: list[Any] = []
        self._gathered: list[Any] = []  # the parameters open() gathered, which close() partitions again

    def open(self, params: Sequence[torch.nn.Parameter]) -> dict[torch.nn.Parameter, torch.Tensor | None]:
        z3 = [p for p in params if is_zero3_param(p)]
        z3_ids = {id(p) for p in z3}
        grads: dict[torch.nn.Parameter, torch.Tensor | None] = {
            p: None if id(p) in z3_ids else p.grad for p in params}
        self._z3 = z3
        if not z3:
            return grads
        trained = [p for p in z3 if p.requires_grad]
        if trained and self.fused and _fusable3(trained):
            grads.update(_gather_slices(trained))
        else:
            from deepspeed.utils import safe_get_full_grad

            grads.update({p: safe_get_full_grad(p) for p in trained})
        self._gather_params(z3)
        return grads

    def _gather_params(self, params: list[Any]) -> None:
        """Make the partitioned ``params`` whole (collective; the same list on every rank, since a parameter's
        availability outside forward is the same everywhere: DeepSpeed's persistence threshold decides it)."""
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        self._gathered = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        if self._gathered:
            self._gathered[0].all_gather(param_list=self._gathered)

    def close(self, grads: dict[torch.nn.Parameter, torch.Tensor | None]) -> None:
        z3, self._z3 = self._z3, []
        gathered, self._gathered = self._gathered, []
        try:
            for p in z3:
                value = grads.get(p)
                if value is not None and p.requires_grad:
                    _write_slice(p, value)
        finally:
            if gathered:
                gathered[0].partition(param_list=gathered, has_been_updated=False)


def _gather_slices(params: Sequence[Any]) -> dict[torch.nn.Parameter, torch.Tensor | None]:
    """Full fp32 gradients of ``params`` (see :func:`_fusable3`) with one all-gather: rank r's chunk is its slices
    of every parameter, packed in order; a parameter's full gradient is its slice from every rank, in rank
    order, cut to its number of elements (stage 3's layout, the one ``safe_get_full_grad`` reads). Collective."""
    optimizer, group = params[0]._z3_optimizer, params[0].ds_process_group
    slices = [optimizer._get_fp32_grad_state_partition(param=p, release_swap_buffers=False)[0].reshape(-1)
              for p in params]
    sizes = [s.numel() for s in slices]
    chunk, world, rank = sum(sizes), dist.get_world_size(group), dist.get_rank(group)
    gathered = torch.empty(world * chunk, dtype=torch.float32, device=slices[0].device)
    torch.cat([s.float() for s in slices], out=gathered.narrow(0, rank * chunk, chunk))
    _all_gather(gathered, group)
    by_rank = gathered.view(world, chunk)
    out: dict[torch.nn.Parameter, torch.Tensor | None] = {}
    offset = 0
    for p, size in zip(params, sizes):
        full = by_rank.narrow(1, offset, size).reshape(-1)  # (a copy: the ranks' slices are not adjacent)
        out[p] = full.narrow(0, 0, p.ds_numel).view(p.ds_shape)
        offset += size
    return out


def _write_slice(p: Any, value: torch.Tensor) -> None:
    """Copy this rank's slice of the full gradient ``value`` into the stage-3 optimizer's fp32 gradient of ``p``
    (local); the zero padding of the last slice is left alone. Where the optimizer lacks the accessor this is
    written against, DeepSpeed's ``safe_set_full_grad``."""
    optimizer = p._z3_optimizer
    if not hasattr(optimizer, "_get_fp32_grad_state_partition"):
        from deepspeed.utils import safe_set_full_grad

        safe_set_full_grad(p, value)
        return
    target = optimizer._get_fp32_grad_state_partition(param=p, release_swap_buffers=False)[0].reshape(-1)
    start = target.numel() * dist.get_rank(p.ds_process_group)
    count = max(0, min(target.numel(), p.ds_numel - start))
    if count:
        target.narrow(0, 0, count).copy_(value.reshape(-1).narrow(0, start, count))
