"""What a strategy offers the ``KFAC`` callback: the seam between Lightning's strategies and K-FAC.

A strategy that implements :class:`KFACStrategy` (``SPDKFACStrategy``, ``SPDKFACDeepSpeedStrategy``, or
one of a user's own) tells the callback where the cross-rank K-FAC work runs, where the reduced
gradients live, and whether the coming micro-batch ends an optimizer step. Any other strategy is
fine on one process: the callback then uses the single-process defaults; and Lightning's ModelParallelStrategy
(FSDP2, :func:`model_parallel`) on several, the preconditioner finding the sharded parameters itself.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import nn

from ..kfac.distributor import Distributor
from ..kfac.gradients import GradAccess
from ..kfac.sharded import is_dtensor


@runtime_checkable
class KFACStrategy(Protocol):
    def make_kfac_distributor(self) -> Distributor:
        """The distributor for this fit (called once per fit, after the process groups exist)."""
        ...

    def make_kfac_grad_access(self) -> GradAccess:
        """Where the ``KFAC`` callback reads and writes the reduced gradients."""
        ...

    def kfac_final_micro_batch(self) -> bool | None:
        """Whether the coming micro-batch ends an optimizer step; None: ask the fit loop."""
        ...


def model_parallel(strategy: object, model: nn.Module, check_only: bool) -> bool:
    """Is ``strategy`` Lightning's ModelParallelStrategy (FSDP2)? Then K-FAC needs no K-FAC-aware strategy: the
    preconditioner built after ``configure_model`` finds the DTensor parameters (kfac/sharded.py). Raises where it
    would not: a tensor-parallel mesh, a model left unsharded on several ranks (``check_only``: before
    ``configure_model``, not checked)."""
    if type(strategy).__name__ != "ModelParallelStrategy":
        return False
    tp = getattr(strategy, "_tensor_parallel_size", 1)
    if tp != 1:
        raise ValueError(f"KFAC under ModelParallelStrategy(tensor_parallel_size={tp!r}): K-FAC does not support "
                         "tensor-parallel layers yet; use tensor_parallel_size=1 and fully_shard on the data-parallel "
                         "mesh (FSDP2), or strategy='spdkfac' (DDP)")
    world = getattr(strategy, "world_size", 1)
    if not check_only and world > 1 and not any(is_dtensor(p) for p in model.parameters()):
        raise ValueError("KFAC under ModelParallelStrategy: the model's parameters are not FSDP2-sharded on "
                         f"{world} ranks, so each rank would precondition with its own factors; apply fully_shard "
                         "(mesh=self.device_mesh['data_parallel']) in configure_model, or use strategy='spdkfac' (DDP)")
    return True
