"""What a strategy offers the ``KFAC`` callback: the seam between Lightning's strategies and K-FAC.

A strategy that implements :class:`KFACStrategy` (``SPDKFACStrategy``, ``SPDKFACDeepSpeedStrategy``, or
one of a user's own) tells the callback where the cross-rank K-FAC work runs, where the reduced
gradients live, and whether the coming micro-batch ends an optimizer step. Any other strategy is
fine on one process: the callback then uses the single-process defaults.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..kfac.distributor import Distributor
from ..kfac.gradients import GradAccess


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
