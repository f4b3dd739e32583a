"""Thin Lightning adapters over the K-FAC core."""

from .callback import KFAC

__all__ = ["KFAC"]
