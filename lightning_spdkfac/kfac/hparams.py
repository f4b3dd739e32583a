"""Hyperparameters that are a number or a schedule (a callable of the step), validated by name."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

Schedule = float | Callable[[int], float]


@dataclass(frozen=True)
class Bound:
    """A range check with the message that names the argument and its allowed values."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def ok(self, v: float) -> bool:
        if not math.isfinite(v):
            return False
        if self.low is not None and (v < self.low or (self.low_open and v == self.low)):
            return False
        if self.high is not None and (v > self.high or (self.high_open and v == self.high)):
            return False
        return True

    def describe(self) -> str:
        lo = "" if self.low is None else ("(" if self.low_open else "[") + f"{self.low:g}"
        hi = "" if self.high is None else f"{self.high:g}" + (")" if self.high_open else "]")
        if self.low is not None and self.high is not None:
            return f"in {lo}, {hi}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        return f"{'<' if self.high_open else '<='} {self.high:g}"


NONNEGATIVE = Bound(low=0.0)
POSITIVE = Bound(low=0.0, low_open=True)
DECAY = Bound(low=0.0, high=1.0, high_open=True)


def check_schedule(name: str, value: object, bound: Bound, fix: str = "") -> None:
    """Validate a number-or-callable hyperparameter at construction."""
    if callable(value):
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a number or a callable of the step, got {type(value).__name__} {value!r}"
        )
    if not bound.ok(float(value)):
        raise ValueError(f"{name} must be {bound.describe()}, got {value!r}{fix}")


def resolve(name: str, value: Schedule, step: int, bound: Bound) -> float:
    """The value of a hyperparameter at ``step``; a schedule's output is validated too."""
    if not callable(value):
        return float(value)
    out = value(step)
    try:
        v = float(out)
    except (TypeError, ValueError):
        raise TypeError(f"{name}(step={step}) must return a number, got {out!r}") from None
    if not bound.ok(v):
        raise ValueError(f"{name}(step={step}) returned {v!r}; {name} must be {bound.describe()}")
    return v


def check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)
