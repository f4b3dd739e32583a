"""Bad configuration fails at construction, with one clear message naming the argument.

The rule (lightning_spdkfac/validation.py): a value of the wrong type raises ``TypeError``, a value of
the right type that is not accepted (range, NaN/inf, unknown name, a combination the scheduler would
ignore) raises ``ValueError``; the message names the argument and shows the value.

* Hypothesis fuzz of ``KFAC``, ``SPDKFACStrategy`` and ``SPDKFACDeepSpeedStrategy``: every parameter of
  the signature (read with ``inspect``, so arguments added later are fuzzed too) is drawn from a mix of
  valid values, invalid values and a generic pool (ints, floats with NaN/inf, bools, None, strings,
  lists, dicts, objects, callables). An oracle written here from the documented rules, independently of
  the validation code, says which arguments are invalid and whether by type or by value; the test
  asserts that construction succeeds exactly when the oracle finds nothing wrong, and otherwise raises
  the oracle's exception class with a message that names an invalid argument and shows its value.
  Arguments the oracle does not know (added by later work) only have to give TypeError/ValueError naming
  an argument.
* Through LightningCLI YAML: invalid KFAC and strategy arguments in a config reach the user, through
  jsonargparse, as a message naming the argument.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import os
import re
import textwrap
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from lightning_spdkfac import KFAC, SPDKFACStrategy
from lightning_spdkfac.cli import main
from lightning_spdkfac.kfac import KFACOptions, KFACPreconditioner

SETTINGS = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------- schedule callables
class HalfSchedule:
    """A callable object (not a function) that is a valid schedule."""

    def __call__(self, step):
        return 0.5


def _raises(step):
    return 1 / 0


# (callable, what happens at step 0): ("sig",) cannot be called with one argument, ("raise",) raises,
# ("out", value) returns value. Written down here, not computed, so the oracle does not call them.
SCHEDULES = [
    (lambda step: 0.01, ("out", 0.01)),
    (lambda step: 1.0, ("out", 1.0)),
    (lambda step: 0.0, ("out", 0.0)),
    (lambda step: -1.0, ("out", -1.0)),
    (lambda step: float("nan"), ("out", float("nan"))),
    (lambda step: float("inf"), ("out", float("inf"))),
    (lambda step: "0.1", ("out", "0.1")),
    (lambda step: None, ("out", None)),
    (lambda step: True, ("out", True)),
    (lambda step: [0.1], ("out", [0.1])),
    (lambda: 0.1, ("sig",)),
    (lambda a, b: 0.1, ("sig",)),
    (_raises, ("raise",)),
    (abs, ("out", 0)),
    (float, ("out", 0.0)),
    (dict, ("raise",)),  # dict(0): TypeError inside the schedule
    (str, ("out", "0")),
    (HalfSchedule(), ("out", 0.5)),
]
SCHEDULE_OUTCOME = {id(fn): outcome for fn, outcome in SCHEDULES}


class Opaque:
    """An arbitrary object, as YAML can never produce but Python callers can."""

    def __repr__(self):
        return "<Opaque>"


GENERIC = st.one_of(
    st.integers(-3, 30),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=6),
    st.sampled_from(["", "spd", "dtf", "bucket", "lbp", "float32", "bfloat16", "1", "nan", ".*", "(", "\x00"]),
    st.lists(st.integers(-2, 12), max_size=3),
    st.tuples(st.integers(-2, 12), st.integers(-2, 12)),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.builds(Opaque),
    st.sampled_from([fn for fn, _ in SCHEDULES]),
    st.sampled_from([timedelta(seconds=30), timedelta(0), Path("p")]),
)


# ---------------------------------------------------------------------------- the oracle
OK, TYPE, VALUE = None, "type", "value"
EXPECTED_EXC = {TYPE: TypeError, VALUE: ValueError}


def is_real(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def number(v, low=None, high=None, low_open=False, high_open=False, optional=False):
    if v is None and optional:
        return OK
    if not is_real(v):
        return TYPE
    if not math.isfinite(v):
        return VALUE
    if low is not None and (v < low or (low_open and v == low)):
        return VALUE
    if high is not None and (v > high or (high_open and v == high)):
        return VALUE
    return OK


def schedule(v, optional=False, **bound):
    """A number in the bound, or a callable that at step 0 returns a number in the bound."""
    if v is None and optional:
        return OK
    if not callable(v):
        return number(v, **bound)
    outcome = SCHEDULE_OUTCOME[id(v)]
    if outcome[0] == "sig":
        return TYPE
    if outcome[0] == "raise":
        return VALUE
    out = outcome[1]
    return TYPE if not is_real(out) else number(out, **bound)


def integer(v, low=None, optional=False):
    if v is None and optional:
        return OK
    if not is_int(v):
        return TYPE
    return VALUE if low is not None and v < low else OK


def boolean(v, optional=False):
    return OK if isinstance(v, bool) or (v is None and optional) else TYPE


def choice(v, choices, optional=False):
    if v is None and optional:
        return OK
    if not isinstance(v, str):
        return TYPE
    return OK if v in choices else VALUE


def regexes(v):
    if isinstance(v, str):
        v = [v]
    elif not isinstance(v, (list, tuple)):
        return TYPE
    if not all(isinstance(p, str) for p in v):
        return TYPE
    for p in v:
        try:
            re.compile(p)
        except re.error:
            return VALUE
    return OK


def dtype(v, names):
    """A torch dtype, or its name (with or without "torch."), among ``names`` (torch's aliases too)."""
    aliases = {"float": "float32", "double": "float64", "half": "float16"}
    if isinstance(v, torch.dtype):
        return OK if str(v).removeprefix("torch.") in names else VALUE
    if not isinstance(v, str):
        return TYPE
    name = v.removeprefix("torch.")
    return OK if aliases.get(name, name) in names else VALUE


def folder(v):
    if not isinstance(v, (str, os.PathLike)):
        return TYPE
    s = os.fspath(v)
    return OK if s and "\x00" not in s else VALUE


def timeout(v):
    if v is None:
        return OK
    if not isinstance(v, timedelta):
        return TYPE
    return OK if v > timedelta(0) else VALUE


KFAC_ORACLE = {
    "damping": lambda v: schedule(v, low=0.0),
    "factor_decay": lambda v: schedule(v, low=0.0, high=1.0, high_open=True),
    "kl_clip": lambda v: schedule(v, optional=True, low=0.0, low_open=True),
    "lr": lambda v: schedule(v, optional=True, low=0.0),
    "factor_update_steps": lambda v: integer(v, low=1),
    "inv_update_steps": lambda v: integer(v, low=1),
    "skip_layers": regexes,
    "factor_dtype": lambda v: dtype(v, ("float32", "float64", "bfloat16", "float16")),
    "inv_dtype": lambda v: dtype(v, ("float32", "float64")),
    "factor_approx": lambda v: choice(v, ("expand", "reduce")),
    "log_step_time": boolean,
    "trace_step": lambda v: integer(v, low=0, optional=True),
    "trace_dir": folder,
}

_good = [fn for fn, o in SCHEDULES if o[0] == "out" and is_real(o[1]) and 0 < o[1] < 1]
KFAC_VALID = {
    "damping": st.one_of(st.floats(0, 10), st.sampled_from(_good + [abs, float])),
    "factor_decay": st.one_of(st.floats(0, 0.999), st.sampled_from(_good)),
    "kl_clip": st.one_of(st.none(), st.floats(1e-6, 1), st.sampled_from(_good)),
    "lr": st.one_of(st.none(), st.floats(0, 1), st.integers(0, 2), st.sampled_from(_good)),
    "factor_update_steps": st.integers(1, 4),
    "inv_update_steps": st.integers(1, 12),
    "skip_layers": st.sampled_from([(), [], "^net", ["Linear", "conv.*"], ("a",), ".*"]),
    "factor_dtype": st.sampled_from(["float32", "float64", "bfloat16", "float16", torch.float32, torch.float64,
                                     "torch.float64", "double"]),
    "inv_dtype": st.sampled_from(["float32", "float64", torch.float32, torch.float64, "torch.float32", "double"]),
    "factor_approx": st.sampled_from(["expand", "reduce"]),
    "log_step_time": st.booleans(),
    "trace_step": st.one_of(st.none(), st.integers(0, 100)),
    "trace_dir": st.sampled_from(["kfac_traces", "/tmp/x", Path("traces")]),
}
KFAC_INVALID = {
    "damping": st.one_of(st.floats(max_value=-1e-9), st.sampled_from([math.nan, math.inf, "0.1", [0.1]])),
    "factor_decay": st.one_of(st.floats(min_value=1.0), st.floats(max_value=-1e-9)),
    "kl_clip": st.one_of(st.floats(max_value=0.0), st.just(math.nan)),
    "factor_update_steps": st.one_of(st.integers(max_value=0), st.sampled_from([1.0, 2.5, True, "2"])),
    "inv_update_steps": st.one_of(st.integers(max_value=0), st.sampled_from([10.0, False, None])),
    "skip_layers": st.sampled_from(["(", ["ok", "[a-"], [b"bytes"], {"a": 1}, 5, [None]]),
    "factor_dtype": st.sampled_from(["int32", "float33", "nn", "Tensor", torch.int64, torch.complex64, 32]),
    "inv_dtype": st.sampled_from(["float16", "bfloat16", torch.float16, "half", None]),
    "factor_approx": st.sampled_from(["Expand", "", "kfc", "reduce ", None, 1, ["reduce"]]),
    "log_step_time": st.sampled_from([0, 1, "true", None]),
    "trace_step": st.one_of(st.integers(max_value=-1), st.sampled_from([1.0, True, "3"])),
    "trace_dir": st.sampled_from(["", "a\x00b", None, 3]),
}

SCHEDULE_DEFAULTS = {  # the schedules' documented defaults (README, strategy docstring)
    "spd": dict(pipelining=True, fusion="dtf", placement="lbp_channel"),
    "mpd": dict(pipelining=False, fusion="layerwise", placement="round_robin"),
    "dkfac": dict(pipelining=False, fusion="layerwise", placement="replicated"),
}


def profile_steps(v):
    if not isinstance(v, (list, tuple)):
        return TYPE
    if not all(is_int(x) for x in v):
        return TYPE
    return OK if len(v) == 2 and 0 <= v[0] < v[1] else VALUE


def _replan_every(v, args):
    ps = args.get("profile_steps", (3, 8))
    end = ps[1] if profile_steps(ps) is OK else 8
    return integer(v, low=end + 1, optional=True)


STRATEGY_ORACLE = {  # name -> oracle(value, all arguments)
    "schedule": lambda v, a: choice(v, ("spd", "mpd", "dkfac")),
    "pipelining": lambda v, a: boolean(v, optional=True),
    "fusion": lambda v, a: choice(v, ("dtf", "layerwise", "all", "bucket"), optional=True),
    "placement": lambda v, a: choice(v, ("lbp", "lbp_channel", "round_robin", "replicated"), optional=True),
    "bucket_mb": lambda v, a: number(v, low=0.0, low_open=True),
    "profile_steps": lambda v, a: profile_steps(v),
    "replan_every": _replan_every,
    "small_factor": lambda v, a: integer(v, low=0, optional=True),
    "comm_dtype": lambda v, a: choice(v, ("float32", "bfloat16")),
    # at least a millisecond (torch counts whole ms; 0 is "no timeout"), at most 1e9 s (torch's timedelta)
    "comm_timeout_s": lambda v, a: number(v, low=1e-3, high=1e9),
    "timeout": lambda v, a: timeout(v),
}
STRATEGY_VALID = {
    "schedule": st.sampled_from(["spd", "mpd", "dkfac"]),
    "pipelining": st.sampled_from([None, True, False]),
    "fusion": st.sampled_from([None, "dtf", "layerwise", "all", "bucket"]),
    "placement": st.sampled_from([None, "lbp", "lbp_channel", "round_robin", "replicated"]),
    # Mostly the defaults for the three that must stay unset unless fusion/placement use them (the
    # combination rules), so that a fair share of the examples is accepted.
    "bucket_mb": st.one_of(st.just(4.0), st.just(4.0), st.just(4.0), st.floats(0.01, 64)),
    "profile_steps": st.sampled_from([(3, 8), [3, 8], (0, 1), [1, 3], (5, 20)]),
    "replan_every": st.one_of(st.none(), st.none(), st.none(), st.integers(21, 500)),
    "small_factor": st.one_of(st.none(), st.none(), st.none(), st.integers(0, 512)),
    "comm_dtype": st.sampled_from(["float32", "bfloat16"]),
    "comm_timeout_s": st.floats(0.1, 1e4),
    "timeout": st.sampled_from([None, timedelta(seconds=30), timedelta(minutes=30)]),
}
STRATEGY_INVALID = {
    "schedule": st.sampled_from(["fast", "SPD", "", None, 1, ["spd"]]),
    "pipelining": st.sampled_from([0, 1, "true", "yes"]),
    "fusion": st.sampled_from(["magic", "DTF", 0, ["dtf"]]),
    "placement": st.sampled_from(["everywhere", "", 3.0]),
    "bucket_mb": st.one_of(st.floats(max_value=0.0), st.sampled_from([math.nan, math.inf, "4", None, True])),
    "profile_steps": st.sampled_from([(5, 2), (3, 3), (-1, 2), (1, 2, 3), (3,), (), "ab", 5, None, (1.0, 2),
                                      (True, 3), {"a": 1}, [3, "8"]]),
    "replan_every": st.one_of(st.integers(-5, 8), st.sampled_from([50.0, True, "50"])),
    "small_factor": st.one_of(st.integers(max_value=-1), st.sampled_from([1.5, "8", False])),
    "comm_dtype": st.sampled_from(["float16", "fp32", None, 32]),
    "comm_timeout_s": st.sampled_from([0, -1.0, math.nan, math.inf, None, "600"]),
    "timeout": st.sampled_from([30, 30.0, "0:30:00", timedelta(0), timedelta(seconds=-1)]),
}


def strategy_combinations(args):
    """The combination rules, on arguments that are each valid: {argument: VALUE} for each broken one."""
    resolved = dict(SCHEDULE_DEFAULTS[args.get("schedule", "spd")])
    resolved.update({k: args[k] for k in resolved if args.get(k) is not None})
    bad = {}
    if args.get("bucket_mb", 4.0) != 4.0 and resolved["fusion"] != "bucket":
        bad["bucket_mb"] = VALUE
    if args.get("replan_every") is not None and not (resolved["pipelining"] and resolved["fusion"] == "dtf"):
        bad["replan_every"] = VALUE
    if args.get("small_factor") is not None and resolved["placement"] not in ("lbp", "lbp_channel"):
        bad["small_factor"] = VALUE
    return bad, resolved


# ---------------------------------------------------------------------------- the check
def named(name, message):
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", message) is not None


def shows_value(value, message):
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value) in message
    return True  # containers, objects, callables: the name and the type are enough


def draw_arguments(data, fn, valid, invalid, skip=("self",)):
    """Every parameter of ``fn``: a few get invalid or generic values, the others valid ones (or their
    default, for parameters this file does not know)."""
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.name not in skip and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    names = [p.name for p in params]
    perturbed = data.draw(st.sets(st.sampled_from(names), max_size=3), label="perturbed")
    args = {}
    for p in params:
        if p.name in perturbed:
            pool = st.one_of(invalid[p.name], GENERIC) if p.name in invalid else GENERIC
            args[p.name] = data.draw(pool, label=p.name)
        elif p.name in valid:
            args[p.name] = data.draw(valid[p.name], label=p.name)
        elif p.default is not p.empty:
            args[p.name] = p.default
        else:
            args[p.name] = data.draw(GENERIC, label=p.name)
    return args


def construct(cls, args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. inv_update_steps not a multiple of factor_update_steps
        try:
            return cls(**args), None
        except Exception as e:  # noqa: BLE001 - the test is about which exceptions come out
            return None, e


def check(cls, args, invalid: dict[str, str], unknown: set[str]):
    """``invalid``: the oracle's verdict per argument; ``unknown``: arguments without an oracle."""
    obj, exc = construct(cls, args)
    event("accepted" if exc is None else type(exc).__name__)  # see --hypothesis-show-statistics
    if exc is None:
        assert not invalid, f"{cls.__name__}({args}) was accepted; expected errors for {invalid}"
        return obj
    assert type(exc) in (TypeError, ValueError), (
        f"{cls.__name__}({args}) raised {type(exc).__name__}: {exc}; only TypeError/ValueError are allowed"
    )
    message = str(exc)
    matching = [n for n, kind in invalid.items() if named(n, message) and type(exc) is EXPECTED_EXC[kind]]
    if matching:
        assert "must" in message, f"the message does not say what is accepted: {message}"
        assert any(shows_value(args[n], message) for n in matching), f"the value is not shown: {message}"
        return None
    # Only an argument this file knows nothing about (added later) may explain it.
    assert any(named(n, message) for n in unknown), (
        f"{cls.__name__}({args}) raised {type(exc).__name__}: {message}\n"
        f"expected a {'/'.join(sorted({EXPECTED_EXC[k].__name__ for k in invalid.values()})) or 'success'} "
        f"naming one of {sorted(invalid)}"
    )
    return None


# ---------------------------------------------------------------------------- fuzz: KFAC
@settings(max_examples=400, **SETTINGS)
@given(st.data())
def test_fuzz_kfac_arguments(data):
    args = draw_arguments(data, KFAC.__init__, KFAC_VALID, KFAC_INVALID)
    invalid = {n: kind for n, kind in ((n, KFAC_ORACLE[n](v)) for n, v in args.items() if n in KFAC_ORACLE) if kind}
    unknown = {n for n in args if n not in KFAC_ORACLE and args[n] is not _default(KFAC.__init__, n)}
    cb = check(KFAC, args, invalid, unknown)
    if cb is not None:  # what was accepted is what the preconditioner will get
        assert cb.options.factor_update_steps == args["factor_update_steps"]
        assert cb.options.factor_approx == args["factor_approx"]
        assert all(isinstance(p, str) for p in cb.options.skip_layers)
        assert isinstance(cb.options.factor_dtype, torch.dtype) and isinstance(cb.options.inv_dtype, torch.dtype)


def _default(fn, name):
    return inspect.signature(fn).parameters[name].default


def test_the_fuzz_oracle_knows_every_kfac_argument_of_this_issue():
    # Guards the oracle against silently dropping an argument it is meant to check.
    params = set(inspect.signature(KFAC.__init__).parameters)
    assert set(KFAC_ORACLE) <= params


def test_skip_layers_generator_is_kept_and_patterns_may_match_linear():
    # Two things the fuzz found: a generator of patterns was consumed by the construction-time check (the
    # preconditioner then got none), and a pattern matching "Linear" failed the probe layer's check.
    cb = KFAC(skip_layers=(p for p in ["^net[.]2$", "Linear"]))
    assert cb.options.skip_layers == ("^net[.]2$", "Linear")
    assert KFAC(skip_layers=".*").options.skip_layers == (".*",)


@pytest.mark.parametrize("build", [KFAC, KFACOptions, lambda **kw: KFACPreconditioner(torch.nn.Linear(2, 2), **kw)],
                         ids=["callback", "options", "preconditioner"])
def test_nonsense_schedules_fail_at_construction_not_at_the_first_step(build):
    # KFACOptions probes a schedule (calls it with step 0): the callback and a plain-PyTorch preconditioner alike.
    with pytest.raises(TypeError, match=r"damping must be a number or a callable of one argument"):
        build(damping=lambda: 0.1)
    with pytest.raises(ValueError, match=r"factor_decay.*factor_decay\(step=0\) raised ZeroDivisionError"):
        build(factor_decay=_raises)
    with pytest.raises(TypeError, match=r"lr\(step=0\) must return a number >= 0, got str '0.1'"):
        build(lr=lambda step: "0.1")
    with pytest.raises(ValueError, match=r"kl_clip\(step=0\) returned 0.0; kl_clip must be > 0"):
        build(kl_clip=lambda step: 0.0)


def test_the_callbacks_lr_travels_in_its_options_and_a_schedule_is_probed_once():
    calls = []

    def lr(step):
        calls.append(step)
        return 0.1

    cb = KFAC(lr=lr)
    assert cb.options.lr is lr and cb.lr is lr and calls == [0]
    assert KFAC(lr=0.25).options.lr == 0.25 and KFAC().options.lr is None
    with pytest.raises(ValueError, match=r"lr must be >= 0, got -1.0 \(None: the optimizer's own, per param group\)"):
        KFAC(lr=-1.0)


# ---------------------------------------------------------------------------- fuzz: strategies
def _draw_strategy_arguments(data, cls):
    return draw_arguments(data, cls.__init__, STRATEGY_VALID | DEEPSPEED_VALID, STRATEGY_INVALID | DEEPSPEED_INVALID)


def _check_strategy(cls, args):
    """Construct ``cls(**args)`` against the oracle; the strategy, or None where it (rightly) failed."""
    oracle = STRATEGY_ORACLE | DEEPSPEED_ORACLE
    invalid = {n: kind for n, kind in ((n, oracle[n](v, args)) for n, v in args.items() if n in oracle) if kind}
    resolved = None
    if not invalid:
        invalid, resolved = strategy_combinations(args)
    unknown = {n for n in args if n not in oracle and args[n] is not _default(cls.__init__, n)}
    assert not dist.is_initialized()
    strategy = check(cls, args, invalid, unknown)
    assert not dist.is_initialized(), "constructing a strategy must not start a process group"
    if strategy is not None:
        options = strategy.spd_options
        assert {k: getattr(options, k) for k in resolved} == resolved
        assert options.schedule == args["schedule"] and options.profile_steps == tuple(args["profile_steps"])
        assert isinstance(options.profile_steps, tuple)
    return strategy


@settings(max_examples=400, **SETTINGS)
@given(st.data())
def test_fuzz_spdkfac_strategy_arguments(data):
    _check_strategy(SPDKFACStrategy, _draw_strategy_arguments(data, SPDKFACStrategy))


def test_combinations_the_scheduler_would_ignore_are_refused():
    with pytest.raises(ValueError, match=r"replan_every must be None unless pipelining=True and fusion='dtf'.*"
                                         r"replan_every=50 with schedule='dkfac'"):
        SPDKFACStrategy(schedule="dkfac", replan_every=50)
    with pytest.raises(ValueError, match=r"replan_every must be None unless.*fusion='layerwise'"):
        SPDKFACStrategy(fusion="layerwise", replan_every=50)
    with pytest.raises(ValueError, match=r"small_factor must be None unless placement is 'lbp' or 'lbp_channel'"):
        SPDKFACStrategy(schedule="mpd", small_factor=64)
    with pytest.raises(ValueError, match=r"bucket_mb must be left at its default.*fusion='dtf'"):
        SPDKFACStrategy(bucket_mb=8.0)
    # The schedule only picks defaults: each part can be overridden (the paper's ablations) ...
    s = SPDKFACStrategy(schedule="dkfac", pipelining=True, fusion="dtf", replan_every=50)
    assert (s.spd_options.pipelining, s.spd_options.fusion, s.spd_options.placement) == (True, "dtf", "replicated")
    # ... and profile_steps, which every strategy passes on, is inert (not an error) without profiling.
    assert SPDKFACStrategy(schedule="mpd", profile_steps=[1, 3]).spd_options.profile_steps == (1, 3)


@pytest.mark.parametrize("value", [5, None, "38", {"a": 1}])
def test_profile_steps_not_a_pair_gives_the_clear_message(value):
    with pytest.raises(TypeError, match=r"profile_steps must be two integers \[start, end\)"):
        SPDKFACStrategy(profile_steps=value)


# DeepSpeed's own arguments (the schedule's are shared with SPDKFACStrategy).
DEEPSPEED_CONFIGS: dict[str, str] = {}  # name -> path, made by the fixture below


def _config_oracle(v, args):
    if v is None:
        return OK
    if isinstance(v, dict):
        if not all(isinstance(k, str) for k in v):
            return TYPE
        zero = v.get("zero_optimization")
        if zero is None:
            return OK
        if not isinstance(zero, dict):
            return TYPE
        stage = zero.get("stage", 0)
        offload = any(zero.get(k) not in (None, {"device": "none"}) for k in ("offload_optimizer", "offload_param"))
        return integer(stage, low=0) or (OK if stage in (0, 1, 2) or (stage == 3 and not offload) else VALUE)
    if isinstance(v, (str, os.PathLike)):
        path = os.fspath(v)
        for name, verdict in (("good", OK), ("stage3", VALUE), ("notjson", VALUE), ("array", VALUE)):
            if DEEPSPEED_CONFIGS.get(name) == path:
                return verdict
        assert not os.path.isfile(path), "an existing file other than the prepared ones is excluded by assume()"
        return VALUE
    return TYPE


DEEPSPEED_ORACLE = {
    "stage": lambda v, a: integer(v, low=0) or (OK if v in (0, 1, 2, 3) else VALUE),
    "config": _config_oracle,
    "fused_grad_gather": lambda v, a: boolean(v),
}
DEEPSPEED_VALID = {
    "stage": st.sampled_from([0, 1, 2, 3]),
    "config": st.sampled_from([None, {}, {"zero_optimization": {"stage": 1}}, {"train_batch_size": 8},
                               {"zero_optimization": None}, {"zero_optimization": {"stage": 3}}]),
    "fused_grad_gather": st.booleans(),
}
DEEPSPEED_INVALID = {
    "stage": st.sampled_from([4, -1, 2.0, "2", None, True]),
    "config": st.sampled_from([{"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
                               {"zero_optimization": 5},
                               {"zero_optimization": {"stage": "2"}}, {1: 2}, "missing.json", 7, ["a"]]),
    "fused_grad_gather": st.sampled_from([1, "yes", None]),
}


@pytest.fixture(scope="module")
def deepspeed_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds")
    contents = {"good": '{"zero_optimization": {"stage": 1}}', "stage3": '{"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}',
                "notjson": "zero_optimization: {stage: 1}", "array": "[1, 2]"}
    for name, text in contents.items():
        (root / f"{name}.json").write_text(text)
        DEEPSPEED_CONFIGS[name] = str(root / f"{name}.json")
    yield
    DEEPSPEED_CONFIGS.clear()


@pytest.fixture(scope="module")
def deepspeed_strategy():
    pytest.importorskip("deepspeed")
    from lightning_spdkfac import SPDKFACDeepSpeedStrategy

    return SPDKFACDeepSpeedStrategy


@settings(max_examples=300, **SETTINGS)
@given(data=st.data())
def test_fuzz_deepspeed_strategy_arguments(deepspeed_strategy, deepspeed_files, data):
    from pytorch_lightning.strategies import DeepSpeedStrategy

    assert DeepSpeedStrategy.DEEPSPEED_ENV_VAR not in os.environ  # config=None must mean "no config"
    args = _draw_strategy_arguments(data, deepspeed_strategy)
    if data.draw(st.integers(0, 3), label="use_file") == 0:  # sometimes one of the prepared JSON files
        args["config"] = DEEPSPEED_CONFIGS[data.draw(st.sampled_from(sorted(DEEPSPEED_CONFIGS)), label="file")]
    config = args["config"]
    assume(not (isinstance(config, (str, os.PathLike)) and os.path.isfile(config)
                and os.fspath(config) not in DEEPSPEED_CONFIGS.values()))  # a stray file the oracle cannot judge
    strategy = _check_strategy(deepspeed_strategy, args)
    if strategy is not None:
        if args["config"] is None:  # Lightning's default config, from the stage argument
            assert strategy.config["zero_optimization"]["stage"] == args["stage"]
        elif args["config"] == DEEPSPEED_CONFIGS["good"]:  # read from the file
            assert strategy.config["zero_optimization"]["stage"] == 1
        assert strategy.fused_grad_gather is args["fused_grad_gather"]


def test_constructing_the_strategies_needs_no_process_group(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a process group was requested at construction")

    for name in ("init_process_group", "new_group", "get_world_size", "get_rank", "barrier"):
        monkeypatch.setattr(dist, name, refuse)
    assert SPDKFACStrategy(schedule="mpd").spd_options.placement == "round_robin"
    if importlib.util.find_spec("deepspeed") is None:
        return
    from lightning_spdkfac import SPDKFACDeepSpeedStrategy

    assert SPDKFACDeepSpeedStrategy(stage=1, schedule="spd").spd_options.fusion == "dtf"
    assert SPDKFACDeepSpeedStrategy(stage=3).config["zero_optimization"]["stage"] == 3
    with pytest.raises(ValueError, match="stage must be the ZeRO stage 0, 1, 2 or 3, got 4"):
        SPDKFACDeepSpeedStrategy(stage=4)


# ---------------------------------------------------------------------------- through LightningCLI YAML
CONFIG = """\
trainer:
  accelerator: cpu
  devices: 1
  logger: false
  enable_progress_bar: false
  max_steps: 1
  strategy:
    class_path: {strategy}
    init_args:
{strategy_args}
  callbacks:
    - class_path: lightning_spdkfac.KFAC
      init_args:
{kfac_args}
model:
  class_path: lightning_spdkfac.demo.DigitsCNN
data:
  class_path: lightning_spdkfac.demo.DigitsDataModule
"""


def _yaml(tmp_path, strategy_args, kfac_args, strategy="lightning_spdkfac.SPDKFACStrategy"):
    path = tmp_path / "config.yaml"
    path.write_text(CONFIG.format(strategy=strategy, strategy_args=textwrap.indent(strategy_args, " " * 6),
                                  kfac_args=textwrap.indent(kfac_args, " " * 8)))
    return path


def _what_the_user_sees(path, tmp_path, capsys) -> str:
    """Run ``spdkfac fit --config path``; the error it ends with (a parse error is printed and exits 2, an
    error from a constructor propagates through jsonargparse, which quotes its message)."""
    try:
        main(["fit", "--config", str(path), f"--trainer.default_root_dir={tmp_path / 'run'}"])
    except SystemExit as e:
        assert e.code not in (0, None)
        return capsys.readouterr().err
    except (TypeError, ValueError) as e:
        return str(e)
    pytest.fail("the invalid config was accepted")


@pytest.mark.parametrize(
    "strategy_args, kfac_args, expected",
    [
        # A value of the right YAML type, refused by the constructor (ValueError, quoted by jsonargparse).
        ("schedule: spd", "damping: -1.0", r"damping must be >= 0, got -1.0"),
        ("schedule: spd", "skip_layers: ['(']", r"skip_layers must be .*got '\('"),
        ("schedule: spd", "damping: 0.1\nfactor_dtype: int8", r"factor_dtype must be a torch dtype name .*got 'int8'"),
        ("bucket_mb: -2.0", "damping: 0.1", r"bucket_mb must be a number > 0, got -2.0"),
        ("schedule: dkfac\nreplan_every: 50", "damping: 0.1",
         r"replan_every must be None unless pipelining=True and fusion='dtf'.*replan_every=50"),
        ("profile_steps: [8, 3]", "damping: 0.1", r"profile_steps must be two integers .*got [\[(]8, 3[\])]"),
        # A value of the wrong type: jsonargparse refuses it from the annotation and names the key.
        ("profile_steps: 5", "damping: 0.1", r'Parser key "profile_steps":\s+Expected a <class \'tuple\'>'),
        ("schedule: fast", "damping: 0.1", r'Parser key "schedule":\s+Expected a typing.Literal.*fast'),
        ("schedule: spd", "factor_update_steps: 2.5", r'Parser key "factor_update_steps":\s+Expected a <class \'int\'>'),
        ("schedule: spd", "factor_approx: kfc", r'Parser key "factor_approx":\s+Expected a typing.Literal.*kfc'),
    ],
)
def test_invalid_yaml_values_name_the_argument(tmp_path, capsys, isolated, strategy_args, kfac_args, expected):
    seen = _what_the_user_sees(_yaml(tmp_path, strategy_args, kfac_args), tmp_path, capsys)
    assert re.search(expected, seen, re.S), seen


def test_yaml_with_an_invalid_kfac_and_an_invalid_strategy_argument(tmp_path, capsys, isolated):
    # Both are reported in turn: the user fixes the first and is told about the second.
    path = _yaml(tmp_path, "schedule: mpd\nsmall_factor: 64", "inv_update_steps: 0")
    first = _what_the_user_sees(path, tmp_path, capsys)
    bad = {"inv_update_steps": r"inv_update_steps must be a positive integer, got 0",
           "small_factor": r"small_factor must be None unless placement is 'lbp' or 'lbp_channel'.*small_factor=64 "
                           r"with placement='round_robin'"}
    hit = [name for name, pattern in bad.items() if re.search(pattern, first, re.S)]
    assert len(hit) == 1, first
    fixed = {"inv_update_steps": ("schedule: mpd\nsmall_factor: 64", "inv_update_steps: 5"),
             "small_factor": ("schedule: mpd\nsmall_factor: null", "inv_update_steps: 0")}[hit[0]]
    second = _what_the_user_sees(_yaml(tmp_path, *fixed), tmp_path, capsys)
    other = next(n for n in bad if n != hit[0])
    assert re.search(bad[other], second, re.S), second


def test_yaml_deepspeed_stage_4_is_refused_by_name(tmp_path, capsys, isolated, deepspeed_strategy):
    path = _yaml(tmp_path, "stage: 4", "damping: 0.1", strategy="lightning_spdkfac.SPDKFACDeepSpeedStrategy")
    seen = _what_the_user_sees(path, tmp_path, capsys)
    assert re.search(r"stage must be the ZeRO stage 0, 1, 2 or 3, got 4.*ZeRO stages 0 to 3", seen, re.S), seen


def test_a_constructor_error_in_yaml_reads_as_one_line(tmp_path, capsys, isolated):
    """jsonargparse wraps a constructor's ValueError in its Union error and a traceback; the CLI prints
    the root cause alone and exits 2."""
    path = _yaml(tmp_path, "schedule: spd", "damping: -1.0")
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", str(path), f"--trainer.default_root_dir={tmp_path / 'run'}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "spdkfac: invalid configuration: ValueError: damping must be >= 0, got -1.0" in err
    assert "Traceback" not in err and "Union subtypes" not in err
