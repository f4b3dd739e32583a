"""Thin Lightning adapters over the K-FAC core: the callback and the strategies."""

from .callback import KFAC
from .deepspeed import SPDKFACDeepSpeedStrategy
from .strategy import SPDKFACStrategy

__all__ = ["KFAC", "SPDKFACDeepSpeedStrategy", "SPDKFACStrategy"]
