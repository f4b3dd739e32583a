"""The K-FAC math on one process: layer helpers, factors, inverses, the preconditioner."""

from .preconditioner import KFACLayer, KFACPreconditioner

__all__ = ["KFACLayer", "KFACPreconditioner"]
