"""Where ``spdkfac plan`` gets a model from: the paper's models, ``--model pkg.module:Class`` or a
LightningCLI ``--config`` of this project (its model, its data batch size and its K-FAC strategy).

A user's model is built on the meta device (no memory) and, when that fails, on the CPU; its K-FAC
layers are read by :func:`~.workload.profile_layers`, each factor in the layout the runtime gives it
(``--max-factor-side``, else a config's ``kfac.max_factor_side``, else the runtime's default 4608: a larger side
is a diagonal factor; an embedding's A is always diagonal, a grouped convolution's factors grouped). A config's ``trainer.strategy`` is compared as
schedule ``config`` when it is an SPD-KFAC strategy: a class path of ``SPDKFACStrategy`` or
``SPDKFACDeepSpeedStrategy``, or a name registered in Lightning's StrategyRegistry
(:data:`~lightning_spdkfac.vocabulary.DDP_STRATEGY_NAMES`,
:data:`~lightning_spdkfac.vocabulary.DEEPSPEED_STRATEGY_NAMES`), with the arguments the name fixes.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..vocabulary import DDP_STRATEGY_NAMES, DEEPSPEED_STRATEGY_NAMES
from .plan import DEEPSPEED_CLASS, STRATEGY_CLASS
from .workload import DEFAULT_MAX_FACTOR_SIDE, LayerSpec, profile_layers

__all__ = ["DTYPES", "ModelSource", "PlanError", "model_source"]

# --input-dtype: the dtype of the sample the model is run on
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "int64": torch.int64, "int32": torch.int32}
_STRATEGY_CLASSES = {"SPDKFACStrategy": STRATEGY_CLASS, "SPDKFACDeepSpeedStrategy": DEEPSPEED_CLASS}


class PlanError(Exception):
    """A bad or missing argument: ``flag`` names it; ``spdkfac plan`` prints it and exits with code 2."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"{flag}: {message}")
        self.flag = flag
        self.message = message


class _NotAModule(PlanError):
    pass


@dataclass
class ModelSource:
    """A model as ``spdkfac plan`` sees it: its K-FAC layers and what the command line or config says."""

    name: str
    source: str  # where it came from, for the report
    specs: list[LayerSpec]
    shape: tuple[int, ...]
    other_params: int = 0  # parameters outside the K-FAC layers
    batch: int | None = None  # per-GPU batch: --batch-size, else the config's data batch size
    options: Any = None  # SPDOptions of the config's strategy (compared as schedule "config")
    strategy_args: dict[str, Any] | None = None  # the config strategy's K-FAC init_args
    strategy_class: str = STRATEGY_CLASS  # the strategy class to recommend
    max_factor_side: int | None = None  # the layouts' size policy the layers were profiled with (None: --paper)


def _ints(flag: str, text: str) -> tuple[int, ...]:
    """Positive integers separated by commas (or ``x``), e.g. a sample shape ``3,224,224``."""
    parts = [t.strip() for t in re.split(r"[,xX]", text.strip())]
    try:
        vals = tuple(int(t) for t in parts)
    except ValueError:
        raise PlanError(flag, f"expected positive integers separated by commas (e.g. 3,224,224), got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise PlanError(flag, f"expected positive integers separated by commas (e.g. 3,224,224), got {text!r}")
    return vals


def _resolve(flag: str, path: str) -> Callable[..., Any]:
    if ":" in path:
        mod, _, attr = path.partition(":")
    else:
        mod, _, attr = path.rpartition(".")
    if not mod or not attr:
        raise PlanError(flag, f"expected pkg.module:Class or pkg.module.Class, got {path!r}")
    try:
        obj: Any = importlib.import_module(mod)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's path
        raise PlanError(flag, f"cannot import module {mod!r} of {path!r}: {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PlanError(flag, f"module {mod!r} has no attribute {attr!r} (from {path!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise PlanError(flag, f"{path!r} is a {type(obj).__name__}, not a class or function that builds a model")
    return obj


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def _profile(flag: str, factory: Callable[..., Any], init_args: dict[str, Any], shape: tuple[int, ...],
             notes: list[str], dtype: torch.dtype, max_side: int) -> tuple[torch.nn.Module, list[LayerSpec]]:
    """Build the model (meta device first, then the CPU) and read its K-FAC layers."""
    args_flag = "--init-args" if flag == "--model" else "--config (model.init_args)"

    def build(device: str | None) -> torch.nn.Module:
        try:
            if device is None:
                model = factory(**init_args)
            else:
                with torch.device(device):
                    model = factory(**init_args)
        except TypeError as e:
            raise PlanError(args_flag if init_args else flag, f"building the model failed: {e}") from e
        except Exception as e:  # noqa: BLE001 - the user's code
            raise PlanError(flag, f"building the model failed: {type(e).__name__}: {_first_line(e)}") from e
        if not isinstance(model, torch.nn.Module):
            raise _NotAModule(flag, f"the model builder returned a {type(model).__name__}, not a torch.nn.Module")
        return model

    try:
        model = build("meta")
        return model, profile_layers(model, shape, dtype=dtype, max_factor_side=max_side)
    except _NotAModule:
        raise
    except Exception as e:  # noqa: BLE001 - anything the model does on the meta device: retry on the CPU
        cause = e.message if isinstance(e, PlanError) else f"{type(e).__name__}: {_first_line(e)}"
    model = build(None)
    notes.append(f"the model could not be built or run on the meta device ({cause[:160]}); it was built on the "
                 "CPU and run on one sample instead")
    try:
        return model, profile_layers(model, shape, dtype=dtype, max_factor_side=max_side)
    except Exception as e:  # noqa: BLE001
        hint = " (token ids? add --input-dtype int64)" if dtype.is_floating_point else ""
        raise PlanError("--input-shape", f"the forward pass of one {dtype} sample of shape {shape} failed: "
                        f"{type(e).__name__}: {_first_line(e)}{hint}") from None


def _kfac_layers(flag: str, factory: Callable[..., Any], init_args: dict[str, Any], shape: tuple[int, ...],
                 notes: list[str], dtype: torch.dtype, max_side: int) -> tuple[list[LayerSpec], int]:
    """The model's K-FAC layers and its parameters outside them."""
    model, specs = _profile(flag, factory, init_args, shape, notes, dtype, max_side)
    if not specs:
        raise PlanError(flag, "the model has no layer K-FAC handles (nn.Conv2d / nn.Linear) on the forward path")
    total = sum(p.numel() for p in model.parameters())
    return specs, max(0, total - sum(s.params for s in specs))


# ---------------------------------------------------------------------------------------- --config
def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``, mappings merged key by key; a mapping naming another ``class_path`` replaces."""
    out = dict(base)
    for k, v in top.items():
        old = out.get(k)
        if isinstance(old, dict) and isinstance(v, dict) and v.get("class_path", old.get("class_path")) == old.get(
                "class_path"):
            out[k] = _merge(old, v)
        else:
            out[k] = v
    return out


def _read_config(paths: Sequence[str]) -> dict[str, Any]:
    """The configs at ``paths``, layered in order as LightningCLI does."""
    import yaml

    cfg: dict[str, Any] = {}
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                layer = yaml.safe_load(f)
        except OSError as e:
            raise PlanError("--config", f"cannot read {path!r}: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            raise PlanError("--config", f"{path!r} is not valid YAML: {e}") from None
        if layer is None:
            continue
        if not isinstance(layer, dict):
            raise PlanError("--config", f"{path!r} is not a mapping of LightningCLI sections")
        cfg = _merge(cfg, layer)
    return cfg


def _data_batch(cfg: dict[str, Any]) -> int | None:
    """data.init_args.batch_size, when it is a positive integer."""
    data = cfg.get("data")
    if isinstance(data, dict) and isinstance(data.get("init_args"), dict):
        b = data["init_args"].get("batch_size")
        if isinstance(b, int) and not isinstance(b, bool) and b > 0:
            return b
    return None


def _config_max_side(cfg: dict[str, Any]) -> int | None:
    """The config's ``kfac.max_factor_side`` (flat or under ``init_args``), when it is a positive integer."""
    kfac = cfg.get("kfac")
    if not isinstance(kfac, dict):
        return None
    inner = kfac.get("init_args")
    args: dict[str, Any] = inner if isinstance(inner, dict) else kfac
    v = args.get("max_factor_side")
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _strategy_given(strategy: object) -> tuple[dict[str, Any] | None, str]:
    """The K-FAC arguments a config's ``trainer.strategy`` gives (None: not an SPD-KFAC strategy) and the
    strategy class. A registered name stands for the arguments the registry fixes (those that are not
    K-FAC arguments, such as ``start_method`` or ``stage``, are left out later)."""
    if isinstance(strategy, str):
        if strategy in DDP_STRATEGY_NAMES:
            return dict(DDP_STRATEGY_NAMES[strategy]), STRATEGY_CLASS
        if strategy in DEEPSPEED_STRATEGY_NAMES:
            return dict(DEEPSPEED_STRATEGY_NAMES[strategy]), DEEPSPEED_CLASS
        return None, STRATEGY_CLASS
    if isinstance(strategy, dict):
        cls = _STRATEGY_CLASSES.get(str(strategy.get("class_path", "")).rsplit(".", 1)[-1])
        if cls is not None:
            return dict(strategy.get("init_args") or {}), cls
    return None, STRATEGY_CLASS


def _strategy_args(options: Any) -> dict[str, Any]:
    """The K-FAC init_args of ``SPDOptions``, as the report prints them."""
    args = {"schedule": options.schedule, "pipelining": options.pipelining, "fusion": options.fusion,
            "placement": options.placement}
    if options.fusion == "bucket":
        args["bucket_mb"] = options.bucket_mb
    if options.small_factor is not None:
        args["small_factor"] = options.small_factor
    args["comm_dtype"] = options.comm_dtype
    return args


def _config_strategy(cfg: dict[str, Any], notes: list[str]) -> tuple[Any, dict[str, Any] | None, str]:
    """(SPDOptions of the config's strategy or None, its K-FAC init_args, the strategy class to recommend)."""
    trainer = cfg.get("trainer")
    strategy = trainer.get("strategy") if isinstance(trainer, dict) else None
    if strategy is None:
        return None, None, STRATEGY_CLASS
    from ..comm.scheduler import SPDOptions
    from ..lightning.strategy import SPD_ARGUMENTS

    given, strategy_class = _strategy_given(strategy)
    if given is None:
        shown = strategy.get("class_path") if isinstance(strategy, dict) else strategy
        notes.append(f"the config's trainer.strategy ({shown}) is not an SPD-KFAC strategy: not compared")
        return None, None, strategy_class
    kw = {k: given[k] for k in SPD_ARGUMENTS if k in given}
    if "profile_steps" in kw:
        kw["profile_steps"] = tuple(kw["profile_steps"])
    try:
        options = SPDOptions.from_schedule(given.get("schedule", "spd"), **kw)
    except (TypeError, ValueError) as e:
        raise PlanError("--config", f"trainer.strategy.init_args: {e}") from None
    if strategy_class == DEEPSPEED_CLASS:
        notes.append("the strategy snippet holds the K-FAC schedule arguments only: keep the config's "
                     "DeepSpeed arguments (stage, config, ...) beside them")
    return options, _strategy_args(options), strategy_class


# ---------------------------------------------------------------------------------------- the model
def _paper_model(name: str) -> ModelSource:
    from .models import PAPER_MODELS
    from .paper import model_specs

    if name not in PAPER_MODELS:
        raise PlanError("--paper", f"unknown model {name!r}; valid: {', '.join(PAPER_MODELS)}")
    return ModelSource(name=name, source="the paper's model", specs=list(model_specs(name)),
                       shape=tuple(PAPER_MODELS[name][1]))


def _module_model(args: argparse.Namespace, shape: tuple[int, ...], dtype: torch.dtype,
                  notes: list[str]) -> ModelSource:
    max_side = getattr(args, "max_factor_side", None) or DEFAULT_MAX_FACTOR_SIDE
    init_args: dict[str, Any] = {}
    if args.init_args is not None:
        try:
            init_args = json.loads(args.init_args)
        except json.JSONDecodeError as e:
            raise PlanError("--init-args", f"not valid JSON ({e.msg}): {args.init_args!r}") from None
        if not isinstance(init_args, dict):
            raise PlanError("--init-args", f"must be a JSON object, got {args.init_args!r}")
    factory = _resolve("--model", args.model)
    specs, other = _kfac_layers("--model", factory, init_args, shape, notes, dtype, max_side)
    return ModelSource(name=args.model, source="--model", specs=specs, shape=shape, other_params=other,
                       max_factor_side=max_side)


def _config_model(paths: Sequence[str], shape: tuple[int, ...], dtype: torch.dtype,
                  notes: list[str], max_side: int | None) -> ModelSource:
    cfg = _read_config(paths)
    if max_side is None:
        max_side = _config_max_side(cfg)
        if max_side is not None:
            notes.append(f"factor layouts with max_factor_side {max_side} from the config's kfac.max_factor_side")
    max_side = max_side or DEFAULT_MAX_FACTOR_SIDE
    path = " + ".join(paths)
    if not isinstance(cfg.get("model"), dict) or "class_path" not in cfg["model"]:
        raise PlanError("--config", f"{path!r} has no model.class_path (a LightningCLI config of this project)")
    class_path = cfg["model"]["class_path"]
    init_args = cfg["model"].get("init_args") or {}
    if not isinstance(init_args, dict):
        raise PlanError("--config", f"model.init_args of {path!r} must be a mapping")
    options, strategy_args, strategy_class = _config_strategy(cfg, notes)
    factory = _resolve("--config", class_path)
    specs, other = _kfac_layers("--config", factory, init_args, shape, notes, dtype, max_side)
    return ModelSource(name=class_path.rsplit(".", 1)[-1], source=f"config {path}", specs=specs, shape=shape,
                       other_params=other, batch=_data_batch(cfg), options=options,
                       strategy_args=strategy_args, strategy_class=strategy_class, max_factor_side=max_side)


def model_source(args: argparse.Namespace, notes: list[str]) -> ModelSource:
    """The model of ``--paper``, ``--model`` or ``--config`` (exactly one is given), its layers read; the
    per-GPU batch is ``--batch-size``, else a config's data batch size. Notes for the report go to
    ``notes``."""
    if args.paper:
        source = _paper_model(args.paper)
        source.batch = args.batch_size
        return source
    flag = "--model" if args.model else "--config"
    if args.input_shape is None:
        raise PlanError("--input-shape", f"required with {flag}: the shape of one sample without the "
                        "batch dimension, e.g. --input-shape 3,224,224")
    shape = _ints("--input-shape", args.input_shape)
    dtype = DTYPES[args.input_dtype]
    if args.model:
        source = _module_model(args, shape, dtype, notes)
        source.batch = args.batch_size
        return source
    source = _config_model(args.config, shape, dtype, notes, getattr(args, "max_factor_side", None))
    if args.batch_size is not None:
        source.batch = args.batch_size
    elif source.batch is not None:
        notes.append(f"per-GPU batch {source.batch} from the config's data.init_args.batch_size")
    return source
