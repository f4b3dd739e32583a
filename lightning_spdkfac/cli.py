"""The ``spdkfac`` command line: Lightning's CLI with any LightningModule / LightningDataModule.

Examples::

    spdkfac fit --config configs/digits.yaml
    spdkfac fit --config configs/digits.yaml --kfac.damping=0.05 --kfac.inv_update_steps=10
    spdkfac fit --config configs/digits_spdkfac.yaml --trainer.strategy.schedule=mpd
    spdkfac fit --config configs/digits.yaml --trainer.max_epochs=3 --trainer.default_root_dir=/tmp/run
    spdkfac fit --config configs/digits_sgd.yaml            # kfac: null -- plain SGD
    spdkfac test --config configs/digits.yaml
    spdkfac fit --kfac.help KFAC                            # every K-FAC argument
    spdkfac plan --paper resnet50

``fit``, ``validate``, ``test`` and ``predict`` are Lightning's subcommands; the model and data
module are named by ``class_path`` in the config (subclass mode). K-FAC is the ``kfac:`` argument
group: the :class:`~lightning_spdkfac.KFAC` callback, always added to the Trainer (``kfac: null`` or
``--kfac=null`` turns it off), each argument settable on its own (``--kfac.damping=0.05``) without
touching ``trainer.callbacks``. A config that still lists ``lightning_spdkfac.KFAC`` under
``trainer.callbacks`` keeps working (that callback is used, and the group must then be left at
its defaults). The strategy's arguments are set one by one the same way:
``--trainer.strategy.<arg>=...`` (short for ``--trainer.strategy.init_args.<arg>``).

At the end of a run the CLI prints its outcome (:class:`RunSummary`): the metrics, the run
records (TimeToAccuracy, LossHistory), the K-FAC step summary and where logs, checkpoints and
traces went. Commands of our own that are not Trainer methods go into :data:`COMMANDS`.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from functools import cache
from typing import TYPE_CHECKING, Any, cast

import pytorch_lightning as pl
from pytorch_lightning.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from pytorch_lightning.loggers import CSVLogger

from . import validation as val
from .lightning.callback import KFAC, KFACCallbackBody
from .lightning.run_report import auto_choice, kfac_line

# Our own subcommands: name -> function(argv after the name) -> exit code. Checked before
# Lightning's (fit, validate, test, predict).
COMMANDS: dict[str, Callable[[list[str]], int | None]] = {}


def _plan(argv: list[str]) -> int:
    """``spdkfac plan``: the recommended K-FAC schedule for a model on a cluster (the simulator)."""
    from .simulate.plan_cli import main as plan_main  # imported on use: the simulator is not needed to train

    return plan_main(argv)


COMMANDS["plan"] = _plan
# One line each for ``spdkfac --help``.
COMMAND_HELP = {"plan": "Recommend a K-FAC schedule for a model on a cluster (the simulator); "
                        "spdkfac plan --help"}


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _our_error(err: BaseException) -> BaseException | None:
    """The TypeError/ValueError raised by this package among the exceptions ``err`` was raised from
    (its ``__cause__``/``__context__`` graph), or None: jsonargparse tries every member of a Union and
    chains each attempt's failure, so the innermost exception is not necessarily ours."""
    stack: list[BaseException | None] = [err]
    seen: set[int] = set()
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if isinstance(e, (TypeError, ValueError)) and tb is not None and \
                os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_PACKAGE_DIR):
            return e
        stack += [e.__context__, e.__cause__]
    return None


def _quoted(err: BaseException, raised: list[BaseException]) -> BaseException | None:
    """The last error one of our constructors raised (``validation.reported``) whose message ``err`` quotes:
    jsonargparse's Union error (a Trainer's ``strategy: str | Strategy``) quotes the strategy constructor's
    error in its text but chains only the error of the first member it tried (``str``)."""
    text = str(err)
    for e in reversed(raised):
        first = str(e).partition("\n")[0]
        if first and first in text:
            return e
    return None


if TYPE_CHECKING:  # what the type checker sees; at run time each namespace's flavour adds its own base
    _CallbackBase = pl.Callback
    _SaveConfigBase = SaveConfigCallback
    _CLIBase = LightningCLI
else:
    _CallbackBase = _SaveConfigBase = _CLIBase = object

NAMESPACES = ("pytorch_lightning", "lightning.pytorch")  # the Lightning a module of the CLI may subclass


class _RunSummaryBody(_CallbackBase):
    """Times the run for the line the CLI prints when it ends; the K-FAC part of that line is the
    :class:`~lightning_spdkfac.KFAC` callback's own record (:attr:`KFAC.run_record
    <lightning_spdkfac.KFAC>`, :func:`~lightning_spdkfac.lightning.run_report.kfac_line`), the line the callback
    prints by itself outside the CLI. Added by the ``spdkfac`` CLI to every Trainer it builds; it turns the
    callback's own print off, so that the line shows once, in the outcome block.
    """

    def __init__(self) -> None:
        super().__init__()
        self._reset(None)

    def _reset(self, stage: str | None) -> None:
        self.stage = stage
        self.seconds = 0.0
        self._t0 = 0.0
        self.start_step = 0  # trainer.global_step when training started (> 0: resumed from a checkpoint)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._reset(stage)  # a fresh record for each run of the Trainer
        self._t0 = time.perf_counter()
        kfac = self.kfac(trainer)
        if kfac is not None:
            kfac.print_run_line = False  # printed in outcome_lines instead

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start_step = trainer.global_step

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.seconds = time.perf_counter() - self._t0

    @staticmethod
    def kfac(trainer: pl.Trainer) -> KFACCallbackBody | None:
        """The KFAC callback of either namespace."""
        return next((c for c in trainer.callbacks if isinstance(c, KFACCallbackBody)), None)  # type: ignore[attr-defined]


class RunSummary(_RunSummaryBody, pl.Callback):
    __doc__ = _RunSummaryBody.__doc__


class _SaveConfigBody(_SaveConfigBase):
    """Lightning's SaveConfigCallback (config.yaml in the logger's versioned folder), plus a copy at
    ``trainer.default_root_dir/config.yaml``: the latest run's config where scripts look for it."""

    def save_config(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # (rank 0 only: the logger's own log_dir, not trainer.log_dir, which is a collective broadcast)
        root = trainer.default_root_dir
        log_dir = trainer.loggers[0].log_dir if trainer.loggers else None
        if log_dir is None or os.path.abspath(log_dir) == os.path.abspath(root):
            return
        os.makedirs(root, exist_ok=True)
        self.parser.save(self.config, os.path.join(root, self.config_filename), skip_none=False, overwrite=True,
                         multifile=self.multifile)


class _SaveConfig(_SaveConfigBody, SaveConfigCallback):
    __doc__ = _SaveConfigBody.__doc__


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return str(value)


def _metric_line(trainer: pl.Trainer) -> str | None:
    metrics = {}
    for name, value in sorted(trainer.callback_metrics.items()):
        try:
            metrics[name] = float(value)
        except (TypeError, ValueError, RuntimeError):
            continue
    return "  ".join(f"{k} {_fmt(v)}" for k, v in metrics.items()) or None


_auto_choice = auto_choice  # (its name here before lightning/run_report.py held it)


def _record_lines(trainer: pl.Trainer) -> list[str]:
    """The run-record callbacks (TimeToAccuracy, LossHistory: a ``results`` dict and a JSON path)."""
    lines = []
    for cb in trainer.callbacks:  # type: ignore[attr-defined]
        results = getattr(cb, "results", None)
        resolved = getattr(cb, "resolved_path", None)
        if not isinstance(results, dict) or not results or not callable(resolved):
            continue
        scalars = ", ".join(f"{k} {_fmt(v)}" for k, v in results.items() if not isinstance(v, (list, dict)))
        path = resolved(trainer)
        lines.append(f"{type(cb).__name__}: {scalars}" + (f" -> {path}" if path else ""))
    return lines


def _where_lines(trainer: pl.Trainer, kfac: KFACCallbackBody | None) -> list[str]:
    lines = []
    if not trainer.loggers:
        lines.append("logs: none (trainer.logger is false)")
    for logger in trainer.loggers:
        where = logger.log_dir if hasattr(logger, "log_dir") else getattr(logger, "save_dir", None)
        hint = ""
        if type(logger).__name__ == CSVLogger.__name__ and importlib.util.find_spec("tensorboard") is None:
            hint = " (CSV: metrics.csv; `pip install tensorboard` for TensorBoard)"
        lines.append(f"logs: {type(logger).__name__} -> {where}{hint}")
    for cb in trainer.checkpoint_callbacks:  # (either namespace's ModelCheckpoint)
        cb = cast(Any, cb)
        if hasattr(cb, "best_model_path") and (cb.best_model_path or cb.last_model_path):
            best = f" (best {cb.monitor} {_fmt(float(cb.best_model_score))})" if cb.monitor and \
                cb.best_model_score is not None else ""
            lines.append(f"checkpoint: {cb.best_model_path or cb.last_model_path}{best}")
    trace = getattr(kfac, "trace_path", None)
    if trace:
        lines.append(f"K-FAC trace: {trace}")
    return lines


def outcome_lines(trainer: pl.Trainer, subcommand: str) -> list[str]:
    """What ``spdkfac SUBCOMMAND`` prints when it ends (rank 0): metrics, run records, K-FAC, locations."""
    summary = next((c for c in trainer.callbacks if isinstance(c, _RunSummaryBody)), None)  # type: ignore[attr-defined]
    head = f"spdkfac {subcommand}: done"
    if subcommand == "fit":
        epochs = trainer.current_epoch
        head += f" after {epochs} epoch{'' if epochs == 1 else 's'}, {trainer.global_step} optimizer steps"
        if summary is not None and summary.start_step:
            head += f" ({trainer.global_step - summary.start_step} in this run, resumed at step {summary.start_step})"
    if summary is not None and summary.seconds:
        head += f", {summary.seconds:.1f} s"
    if trainer.interrupted:
        head += " (interrupted)"
    lines = [head]
    metrics = _metric_line(trainer)
    if metrics:
        lines.append(f"metrics: {metrics}")
    if subcommand == "fit":
        lines += _record_lines(trainer)
        kfac = RunSummary.kfac(trainer)
        if summary is not None:
            lines.append(f"K-FAC: {kfac_line(None if kfac is None else kfac.run_record)}")
    else:
        kfac = None
    lines += _where_lines(trainer, kfac)
    return [lines[0]] + ["  " + line for line in lines[1:]]


class _CLIBody(_CLIBase):
    """LightningCLI with the ``kfac`` argument group, an outcome printed at the end, and
    construction errors that read as one line.

    jsonargparse reports a constructor's ValueError/TypeError (our "damping must be >= 0, got -1.0") inside
    its own "Does not validate against any of the Union subtypes" error and a traceback; the user then has
    to dig for the one line that matters. Here the root cause is printed alone and the command exits 2,
    as for any other invalid argument. Other errors, and errors raised later (during fit), keep their
    traceback.
    """

    # The namespace's flavours: the KFAC callback of the kfac group (and its import path), the run summary.
    kfac_class: type = KFAC
    kfac_path = "lightning_spdkfac.KFAC"
    summary_class: type = RunSummary

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # Subclass mode: `kfac: null` (or --kfac=null) can turn it off, `kfac: {damping: 0.05}` needs no
        # class_path, and --kfac.damping=0.05 sets one argument.
        parser.add_lightning_class_args(self.kfac_class, "kfac", subclass_mode=True, required=False)
        parser.set_defaults({"kfac": {"class_path": self.kfac_path}})

    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs: Any) -> None:
        super()._add_subcommands(parser, **kwargs)
        # Our own commands are dispatched by main() before Lightning parses; listed here for --help.
        action = getattr(parser, "_subcommands_action", None)
        if action is not None:
            for name, text in COMMAND_HELP.items():
                action.add_subcommand(name, type(parser)(description=text), help=text)

    def instantiate_classes(self) -> None:
        with val.collecting_errors() as raised:
            try:
                super().instantiate_classes()
            except (TypeError, ValueError) as err:
                ours = _our_error(err) or _quoted(err, raised)
                if ours is None:
                    raise
                sys.stderr.write(f"spdkfac: invalid configuration: {type(ours).__name__}: {ours}\n")
                raise SystemExit(2) from err

    def _kfac_group_is_default(self) -> bool:
        config = self.config.get(str(self.subcommand), self.config) if self.subcommand else self.config
        given = config.get("kfac")
        default = self._parser(self.subcommand).get_defaults().get("kfac")
        return given is not None and default is not None and given.get("init_args") == default.get("init_args")

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[pl.Callback]) -> pl.Trainer:
        listed = config.get("callbacks") or []
        listed = listed if isinstance(listed, list) else [listed]
        extra = [c for c in callbacks if c is not None]  # kfac: null
        group = next((c for c in extra if isinstance(c, KFACCallbackBody)), None)
        if group is not None and any(isinstance(c, KFACCallbackBody) for c in listed):
            if not self._kfac_group_is_default():
                sys.stderr.write(
                    "spdkfac: invalid configuration: K-FAC is configured twice, as a lightning_spdkfac.KFAC entry "
                    "of trainer.callbacks and as the kfac group (kfac: / --kfac.*); keep one: move that entry's "
                    "init_args under kfac: (or give kfac: null to use the trainer.callbacks entry)\n")
                raise SystemExit(2)
            extra.remove(group)  # an older config: its trainer.callbacks entry is the K-FAC of this run
        extra.append(self.summary_class())
        return super()._instantiate_trainer(config, extra)

    def _run_subcommand(self, subcommand: str) -> None:
        super()._run_subcommand(subcommand)
        if self.trainer.is_global_zero:
            print("\n".join(outcome_lines(self.trainer, subcommand)), flush=True)


class _CLI(_CLIBody, LightningCLI):
    __doc__ = _CLIBody.__doc__


@cache
def _flavour(namespace: str) -> tuple[type, type, type, type]:
    """(CLI class, SaveConfigCallback class, LightningModule, LightningDataModule) of ``namespace``: the same
    bodies on the Lightning classes of ``pytorch_lightning`` or of the unified ``lightning.pytorch``."""
    if namespace == "pytorch_lightning":
        return _CLI, _SaveConfig, pl.LightningModule, pl.LightningDataModule
    import lightning.pytorch as L  # noqa: N812
    from lightning.pytorch.cli import LightningCLI as UnifiedCLI
    from lightning.pytorch.cli import SaveConfigCallback as UnifiedSaveConfig

    from . import unified

    summary = type("RunSummary", (_RunSummaryBody, L.Callback), {"__doc__": _RunSummaryBody.__doc__})
    save = type("_SaveConfig", (_SaveConfigBody, UnifiedSaveConfig), {"__doc__": _SaveConfigBody.__doc__})
    cli = type("_CLI", (_CLIBody, UnifiedCLI), {"__doc__": _CLIBody.__doc__, "kfac_class": unified.KFAC,
                                                "kfac_path": "lightning_spdkfac.unified.KFAC",
                                                "summary_class": summary})
    return cli, save, L.LightningModule, L.LightningDataModule


def _configured_model(argv: Sequence[str]) -> str | None:
    """The model's class_path as ``spdkfac`` would read it from ``argv`` (its ``--config`` files, then
    ``--model``/``--model.class_path``, the last one winning), or None."""
    import yaml

    found = None
    for i, arg in enumerate(argv):
        key, eq, value = arg.partition("=")
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        if key == "--config":
            try:
                with open(value) as f:
                    config = yaml.safe_load(f)
            except (OSError, yaml.YAMLError):
                continue  # LightningCLI reports it
            model = config.get("model") if isinstance(config, dict) else None
            model = model.get("class_path") if isinstance(model, dict) else model
            found = model if isinstance(model, str) else found
        elif key in ("--model", "--model.class_path") and value and not value.startswith(("{", "-")):
            found = value
    return found


def model_namespace(argv: Sequence[str]) -> str:
    """``"lightning.pytorch"`` when the configured model subclasses the unified package's LightningModule,
    else ``"pytorch_lightning"`` (also when it cannot be imported: LightningCLI then says why)."""
    path = _configured_model(argv)
    module, _, name = (path or "").rpartition(".")
    if not module:
        return "pytorch_lightning"
    try:
        cls = getattr(importlib.import_module(module), name)
    except Exception:
        return "pytorch_lightning"
    unified = sys.modules.get("lightning.pytorch")
    if unified is not None and isinstance(cls, type) and issubclass(cls, unified.LightningModule):
        return "lightning.pytorch"
    return "pytorch_lightning"


def lightning_cli(args: Sequence[str] | None = None, run: bool = True, namespace: str | None = None) -> LightningCLI:
    """Build (and with ``run=True`` run) the LightningCLI behind ``spdkfac fit|validate|test|predict``.

    ``namespace``: the Lightning of the model, ``"pytorch_lightning"`` or ``"lightning.pytorch"`` (the unified
    package); None: the one the configured model subclasses (:func:`model_namespace`). The Trainer, the KFAC
    callback of the ``kfac`` group and the ``spdkfac*`` strategy names are then that namespace's."""
    if namespace is None:
        namespace = model_namespace(sys.argv[1:] if args is None else list(args))
    if namespace not in NAMESPACES:
        raise ValueError(f"namespace must be one of {NAMESPACES} or None (the model's), got {namespace!r}")
    cli, save, module, datamodule = _flavour(namespace)
    return cli(
        module,
        datamodule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_callback=save,
        save_config_kwargs={"overwrite": True},
        args=None if args is None else list(args),
        run=run,
    )


def _cwd_on_path() -> None:
    """Put the working directory on the import path, as ``python -m`` does: ``class_path: mymodule.Net``
    (or ``spdkfac plan --model mymodule:Net``) run from the folder of ``mymodule.py`` then imports it."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


_REPOSITORY_PACKAGES = ("examples", "benchmarks")  # folders of the clone, not of the installed package


def _refuse_repository_classes(argv: Sequence[str]) -> None:
    """A ``--config`` naming a class of the repository's ``examples/`` (configs/hf_gpt2.yaml does) where that
    folder is not importable (an installed copy, run from elsewhere): one line saying where to run it, instead
    of jsonargparse's "does not correspond to a subclass" after the whole parse."""
    paths = [a.partition("=")[2] if a.startswith("--config=") else argv[i + 1]
             for i, a in enumerate(argv) if a.startswith("--config=") or (a == "--config" and i + 1 < len(argv))]
    for path in paths:
        try:
            with open(path) as f:
                text = f.read()
        except OSError:
            continue  # LightningCLI reports a missing file itself
        for line in text.splitlines():
            value = line.partition("#")[0].strip().removeprefix("- ")
            if not value.startswith("class_path:"):
                continue
            name = value.removeprefix("class_path:").strip().strip("'\"")
            top = name.split(".")[0]
            if top in _REPOSITORY_PACKAGES and importlib.util.find_spec(top) is None:
                sys.stderr.write(
                    f"spdkfac: {path} trains {name}, which lives in the repository's {top}/ folder, not in the "
                    f"installed lightning_spdkfac package, and no {top!r} module is importable from {os.getcwd()}: "
                    f"run it from the root of a clone of the repository (cd <clone> && spdkfac fit --config "
                    f"configs/{os.path.basename(path)}), or point class_path at a module of your own\n")
                raise SystemExit(2)


def main(args: Sequence[str] | None = None) -> int:
    """Entry point of the ``spdkfac`` console script; ``args`` defaults to ``sys.argv[1:]``."""
    argv = sys.argv[1:] if args is None else list(args)
    if args is None:  # the console script (a caller passing args keeps its own sys.path)
        _cwd_on_path()
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]](argv[1:]) or 0
    _refuse_repository_classes(argv)
    lightning_cli(args)  # None: LightningCLI reads sys.argv itself
    return 0


if __name__ == "__main__":
    sys.exit(main())
