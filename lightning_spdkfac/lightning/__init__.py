"""Thin Lightning adapters over the K-FAC core: the callback and the strategies."""

from .callback import KFAC
from .strategy import SPDKFACStrategy

__all__ = ["KFAC", "SPDKFACStrategy"]
