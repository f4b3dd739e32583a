"""Argument checks shared by the planners: every message names the bad argument."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence


def real(name: str, value: object, *, low: float | None = None, low_open: bool = False) -> float:
    """``value`` as a finite float, optionally bounded below; ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if low is not None and (v < low or (low_open and v == low)):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low:g}, got {value!r}")
    return v


def integer(name: str, value: object, *, low: int | None = None) -> int:
    """``value`` as an int (bools and non-integral numbers refused), optionally bounded below."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    v = int(value)
    if low is not None and v < low:
        raise ValueError(f"{name} must be >= {low}, got {value!r}")
    return v


def reals(name: str, values: Sequence[object], *, low: float | None = None,
          low_open: bool = False) -> list[float]:
    """Each item checked with :func:`real`; the message names the index, e.g. ``seconds[3]``."""
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise ValueError(f"{name} must be a sequence of numbers, got {type(values).__name__}")
    return [real(f"{name}[{i}]", v, low=low, low_open=low_open) for i, v in enumerate(values)]


def integers(name: str, values: Sequence[object], *, low: int | None = None) -> list[int]:
    """Each item checked with :func:`integer`; the message names the index."""
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise ValueError(f"{name} must be a sequence of integers, got {type(values).__name__}")
    return [integer(f"{name}[{i}]", v, low=low) for i, v in enumerate(values)]


def same_length(name_a: str, a: Sequence[object], name_b: str, b: Sequence[object]) -> None:
    if len(a) != len(b):
        raise ValueError(f"{name_a} and {name_b} must have the same length, got {len(a)} and {len(b)}")


def choice(name: str, value: object, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(repr(a) for a in allowed)}; got {value!r}")
    return value
