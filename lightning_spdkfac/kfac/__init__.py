"""The K-FAC math on one process: layer helpers, factors, inverses, the preconditioner and its options.

Nothing here touches torch.distributed or Lightning: cross-rank work goes through a ``Distributor``,
reduced gradients through a ``GradAccess``.
"""

from .layer_state import KFACLayer
from .options import KFACOptions
from .preconditioner import KFACPreconditioner

__all__ = ["KFACLayer", "KFACOptions", "KFACPreconditioner"]
