"""The argument checks of the whole package: one module, one rule, validated by name.

Every constructor and public function that takes user input (the preconditioner and ``KFAC``, the
strategies, ``SPDOptions``, the comm executors, the planners, the simulator) checks it here, by
one rule:

- a value of the wrong **type** (a string where a number is expected, a float or a bool where an
  integer is, None where it is not allowed, a list or dict where a scalar is) raises ``TypeError``;
- a value of the right type that is not accepted (out of range, NaN or infinite, an unknown name,
  a combination of arguments that does not go together) raises ``ValueError``.

Every message names the argument, shows the value and says what is accepted ("``X must be ...,
got ...``"). Hyperparameters that are a number or a schedule (a callable of the step) are
checked here too, as is a schedule's output at each step.

Nothing here imports torch at module level: the package root and the planners stay light.
"""

from __future__ import annotations

import collections.abc as cabc
import contextlib
import inspect
import math
import numbers
import os
import reprlib
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeGuard, TypeVar, overload

# A hyperparameter given as a number or as a function of the optimizer step.
HParam = float | Callable[[int], float]

# The choices of check_choice (e.g. a Literal of names): what it returns is one of them.
_Choice = TypeVar("_Choice", bound=str)

_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 120
_repr.maxlist = _repr.maxtuple = _repr.maxdict = _repr.maxset = 8


def show(value: object) -> str:
    """``type value`` for messages, e.g. ``str 'abc'``; long values are shortened."""
    if value is None:
        return "None"
    text = _repr.repr(value) if isinstance(value, (list, tuple, dict, set, frozenset, str)) else repr(value)
    if len(text) > 200:
        text = text[:200] + "..."
    return f"{type(value).__name__} {text}"


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
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {self.high:g}"
        return "finite"


NONNEGATIVE = Bound(low=0.0)
POSITIVE = Bound(low=0.0, low_open=True)
DECAY = Bound(low=0.0, high=1.0, high_open=True)


def is_real(value: object) -> TypeGuard[float]:
    """A real number that is not a bool (``True`` is an int in Python, never a hyperparameter).

    (Typed as a float guard: every ``numbers.Real`` converts with ``float()``.)"""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_int(value: object) -> TypeGuard[int]:
    """An integral number that is not a bool (numpy integers too)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


# ---------------------------------------------------------------------- numbers and schedules
def check_schedule(name: str, value: object, bound: Bound, fix: str = "", probe: bool = False,
                   optional: bool = False) -> None:
    """Validate a number-or-callable hyperparameter at construction (None too with ``optional``).

    With ``probe=True`` a callable is also called once with step 0 and its output checked, so
    that a schedule which cannot be called with one argument, raises, or returns something that
    is not a number in range fails at construction instead of at the first optimizer step.
    """
    if value is None and optional:
        return
    if callable(value):
        if probe:
            _probe_schedule(name, value, bound)
        return
    if not is_real(value):
        raise TypeError(
            f"{name} must be {'None, ' if optional else ''}a number or a callable of the step, with values "
            f"{bound.describe()}; got {show(value)}{fix}"
        )
    if not bound.ok(float(value)):
        raise ValueError(f"{name} must be {bound.describe()}, got {value!r}{fix}")


def _probe_schedule(name: str, fn: Callable[..., Any], bound: Bound) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have none: calling is the only check
        signature = None
    if signature is not None:
        try:
            signature.bind(0)
        except TypeError:
            raise TypeError(
                f"{name} must be a number or a callable of one argument (the step), got {fn!r} "
                f"with signature {signature}"
            ) from None
    try:
        out = fn(0)
    except Exception as e:  # noqa: BLE001 - any failure of the user's schedule is reported by name
        raise ValueError(
            f"{name} must be a number or a schedule returning a number {bound.describe()} for every step, "
            f"but {name}(step=0) raised {type(e).__name__}: {e}"
        ) from e
    schedule_value(name, out, 0, bound)


def schedule_value(name: str, out: object, step: int, bound: Bound) -> float:
    """Check what a schedule returned at ``step``: a number (not a bool or a string) in ``bound``."""
    if isinstance(out, (bool, str, bytes)):
        v = None
    else:
        try:
            v = float(typing.cast(typing.SupportsFloat, out))  # whatever it is: float() decides
        except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of several elements
            v = None
    if v is None:
        raise TypeError(f"{name}(step={step}) must return a number {bound.describe()}, got {show(out)}")
    if not bound.ok(v):
        raise ValueError(f"{name}(step={step}) returned {v!r}; {name} must be {bound.describe()}")
    return v


def resolve(name: str, value: HParam, step: int, bound: Bound) -> float:
    """The value of a hyperparameter at ``step``; a schedule's output is validated too."""
    if not callable(value):
        return float(value)
    return schedule_value(name, value(step), step, bound)


# ---------------------------------------------------------------------- plain arguments
@overload
def check_int(name: str, value: object, low: int | None = None, optional: Literal[False] = False,
              accepted: str | None = None) -> int: ...
@overload
def check_int(name: str, value: object, low: int | None = None, optional: bool = False,
              accepted: str | None = None) -> int | None: ...
def check_int(name: str, value: object, low: int | None = None, optional: bool = False,
              accepted: str | None = None) -> int | None:
    """An integer >= ``low`` (None too with ``optional``); bools and floats are type errors."""
    what = accepted or ("an integer" + ("" if low is None else f" >= {low}"))
    if optional:
        what = f"None or {what}"
    if value is None and optional:
        return None
    if not is_int(value):
        raise TypeError(f"{name} must be {what}, got {show(value)}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return int(value)


def check_positive_int(name: str, value: object) -> int:
    return check_int(name, value, low=1, accepted="a positive integer")


@overload
def check_real(name: str, value: object, bound: Bound = Bound(), optional: Literal[False] = False) -> float: ...
@overload
def check_real(name: str, value: object, bound: Bound = Bound(), optional: bool = False) -> float | None: ...
def check_real(name: str, value: object, bound: Bound = Bound(), optional: bool = False) -> float | None:
    """A finite real number in ``bound`` (None too with ``optional``)."""
    if value is None and optional:
        return None
    what = f"{'None or ' if optional else ''}a number {bound.describe()}"
    if not is_real(value):
        raise TypeError(f"{name} must be {what}, got {show(value)}")
    if not bound.ok(float(value)):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return float(value)


@overload
def check_bool(name: str, value: object, optional: Literal[False] = False) -> bool: ...
@overload
def check_bool(name: str, value: object, optional: bool = False) -> bool | None: ...
def check_bool(name: str, value: object, optional: bool = False) -> bool | None:
    if value is None and optional:
        return None
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False{' (or None)' if optional else ''}, got {show(value)}")
    return value


@overload
def check_choice(name: str, value: object, choices: Iterable[_Choice],
                 optional: Literal[False] = False) -> _Choice: ...
@overload
def check_choice(name: str, value: object, choices: Iterable[_Choice],
                 optional: bool = False) -> _Choice | None: ...
def check_choice(name: str, value: object, choices: Iterable[str], optional: bool = False) -> str | None:
    """One of ``choices`` (strings); None too with ``optional``. A non-string is a type error."""
    if value is None and optional:
        return None
    return check_member(name, value, tuple(choices), str, shown=repr,  # type: ignore[no-any-return]
                        note=" (or None)" if optional else "")


def check_sequence(name: str, values: object, what: str) -> Sequence[Any]:
    """A list or tuple-like sequence (not a string): TypeError naming ``name`` otherwise."""
    if isinstance(values, (str, bytes)) or not isinstance(values, cabc.Sequence):
        raise TypeError(f"{name} must be a sequence of {what}, got {show(values)}")
    return values


def check_reals(name: str, values: object, bound: Bound = Bound()) -> list[float]:
    """Each item checked with :func:`check_real`; messages name the index, e.g. ``seconds[3]``."""
    seq = check_sequence(name, values, f"numbers {bound.describe()}")
    return [float(check_real(f"{name}[{i}]", v, bound)) for i, v in enumerate(seq)]


def check_ints(name: str, values: object, low: int | None = None) -> list[int]:
    """Each item checked with :func:`check_int`; messages name the index."""
    seq = check_sequence(name, values, "integers" + ("" if low is None else f" >= {low}"))
    return [int(check_int(f"{name}[{i}]", v, low=low)) for i, v in enumerate(seq)]


def check_same_length(name_a: str, a: Sequence[object], name_b: str, b: Sequence[object]) -> None:
    if len(a) != len(b):
        raise ValueError(f"{name_a} and {name_b} must have the same length, got {len(a)} and {len(b)}")


def check_index(name: str, value: object, count: int) -> int:
    """An index into ``count`` items: TypeError unless an integer, ValueError unless in [0, count)."""
    what = f"an integer in [0, {count})"
    if not is_int(value):
        raise TypeError(f"{name} must be {what}, got {show(value)}")
    if not 0 <= value < count:
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return int(value)


def check_seconds(name: str, value: object, what: str = "a positive, finite number of seconds") -> float:
    """Positive, finite seconds (a timeout): TypeError unless a real number, ValueError otherwise."""
    if not is_real(value):
        raise TypeError(f"{name} must be {what}, got {show(value)}")
    if not POSITIVE.ok(float(value)):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return float(value)


def check_timedelta(name: str, value: object) -> None:
    """A positive ``datetime.timedelta`` or None (torch's default process-group timeout)."""
    import datetime

    if value is None:
        return
    if not isinstance(value, datetime.timedelta):
        raise TypeError(f"{name} must be None or a datetime.timedelta > 0, got {show(value)}")
    if value <= datetime.timedelta(0):
        raise ValueError(f"{name} must be None or a datetime.timedelta > 0, got {value!r}")


def check_folder(name: str, value: object) -> str:
    """A folder path: a non-empty string (or ``os.PathLike``) without NUL, as a string."""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a folder path (a non-empty string), got {show(value)}")
    path = os.fspath(value)
    if not isinstance(path, str) or not path or "\x00" in path:
        raise ValueError(f"{name} must be a folder path (a non-empty string without NUL), got {value!r}")
    return path


def check_instance(name: str, value: object, cls: type | tuple[type, ...], what: str | None = None) -> Any:
    """An instance of ``cls``: TypeError naming ``name`` otherwise."""
    if not isinstance(value, cls):
        names = " or ".join(c.__name__ for c in (cls if isinstance(cls, tuple) else (cls,)))
        raise TypeError(f"{name} must be {what or 'a ' + names}, got {show(value)}")
    return value


def check_member(name: str, value: object, allowed: Sequence[Any], kind: type | tuple[type, ...], *,
                 shown: Callable[[Any], str] = str, note: str = "") -> Any:
    """One of ``allowed`` (e.g. torch dtypes): TypeError unless a ``kind``, ValueError unless allowed.

    ``shown`` writes each allowed value in the message; ``note`` is appended to the list."""
    what = f"one of {', '.join(shown(a) for a in allowed)}{note}"
    if not isinstance(value, kind):
        raise TypeError(f"{name} must be {what}, got {show(value)}")
    if value not in allowed:
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return value


# ---------------------------------------------------------------------- by annotation
def _matches(value: object, hint: Any) -> bool | None:
    """Does ``value`` fit the annotation ``hint``? None: the annotation is beyond this check."""
    if hint is Any or hint is object:
        return True
    if hint is None or hint is type(None):
        return value is None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        results = [_matches(value, h) for h in typing.get_args(hint)]
        return True if True in results else (None if None in results else False)
    if origin is typing.Literal:
        return any(type(value) is type(c) and value == c for c in typing.get_args(hint))
    if hint is float:
        return is_real(value)
    if hint is int:
        return is_int(value)
    if hint is bool:
        return isinstance(value, bool)
    if origin is cabc.Callable or hint is cabc.Callable:
        return callable(value)
    if origin in (tuple, list, cabc.Sequence):
        return isinstance(value, (tuple, list)) if origin is not list else isinstance(value, list)
    if origin in (dict, cabc.Mapping):
        return isinstance(value, cabc.Mapping)
    if origin is cabc.Iterable:
        return isinstance(value, cabc.Iterable) and not isinstance(value, (str, bytes, cabc.Mapping))
    if isinstance(hint, type):
        return isinstance(value, hint)
    return None


def _literals(hint: Any) -> list[Any]:
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return list(typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return [c for h in typing.get_args(hint) for c in _literals(h)]
    return []


def _describe_hint(hint: Any) -> str:
    text = getattr(hint, "__name__", None) if isinstance(hint, type) else None
    return text or str(hint).replace("typing.", "").replace("collections.abc.", "")


def check_annotation(name: str, value: object, hint: Any) -> None:
    """TypeError (or ValueError for a string outside a ``Literal``) unless ``value`` fits ``hint``.

    The fallback of the constructors for arguments without a check of their own: the type
    annotation that LightningCLI reads is then also what the constructor enforces.
    """
    ok = _matches(value, hint)
    if ok is None or ok:
        if ok and is_real(value) and not is_int(value) and math.isnan(float(value)):
            raise ValueError(f"{name} must be a number, not NaN, got {value!r}")
        return
    literals = _literals(hint)
    if literals and any(type(value) is type(c) for c in literals):
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in literals)}, got {value!r}")
    raise TypeError(f"{name} must be {_describe_hint(hint)}, got {show(value)}")


def check_annotations(fn: Callable[..., Any], arguments: dict[str, Any], skip: Iterable[str] = ()) -> None:
    """:func:`check_annotation` for every parameter of ``fn`` in ``arguments`` except ``skip``."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - an annotation that cannot be resolved is not checked
        hints = {}
    skip = set(skip)
    for pname, param in inspect.signature(fn).parameters.items():
        if pname in skip or pname not in arguments or pname not in hints:
            continue
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        check_annotation(pname, arguments[pname], hints[pname])


# ---------------------------------------------------------------------------- errors a caller may lose
# jsonargparse tries every member of a Union (a Trainer's ``strategy: str | Strategy``) and chains only the
# first attempt's failure to its own error, so a strategy constructor's ValueError is quoted in the text of
# that error but is not among its causes. Constructors run their checks inside ``reported()``; a caller that
# wants the original exception (the CLI, to print it as one line) collects them with ``collecting_errors()``.
_error_logs: list[list[BaseException]] = []


@contextlib.contextmanager
def reported() -> Iterator[None]:
    """Hand a TypeError/ValueError raised inside to every active ``collecting_errors()``, then re-raise it."""
    try:
        yield
    except (TypeError, ValueError) as e:
        for log in _error_logs:
            log.append(e)
        raise


@contextlib.contextmanager
def collecting_errors() -> Iterator[list[BaseException]]:
    """The TypeError/ValueError raised inside ``reported()`` blocks while this is active, in order."""
    log: list[BaseException] = []
    _error_logs.append(log)
    try:
        yield log
    finally:
        _error_logs.remove(log)
