"""lightning-spdkfac: K-FAC second-order optimization for PyTorch Lightning, with SPD-KFAC scheduling.

Importing the package registers the ``"spdkfac"`` strategies in Lightning's strategy registry.
"""

from .kfac import KFACPreconditioner
from .lightning import KFAC, SPDKFACDeepSpeedStrategy, SPDKFACStrategy

__all__ = ["KFAC", "KFACPreconditioner", "SPDKFACDeepSpeedStrategy", "SPDKFACStrategy"]
__version__ = "0.1.0"
