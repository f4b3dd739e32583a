"""lightning-spdkfac: K-FAC second-order optimization for PyTorch Lightning, with SPD-KFAC scheduling."""

from .kfac import KFACPreconditioner
from .lightning import KFAC

__all__ = ["KFAC", "KFACPreconditioner"]
__version__ = "0.1.0"
