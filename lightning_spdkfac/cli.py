"""The ``spdkfac`` command line: Lightning's CLI with any LightningModule / LightningDataModule.

Examples::

    spdkfac fit --config configs/digits.yaml
    spdkfac fit --config configs/digits.yaml --trainer.max_epochs=3 --trainer.default_root_dir=/tmp/run
    spdkfac fit --print_config --config configs/digits_sgd.yaml
    spdkfac plan --paper resnet50

``fit``, ``validate``, ``test`` and ``predict`` are Lightning's subcommands; the model and data
module are named by ``class_path`` in the config (subclass mode), and K-FAC is added as a
``trainer.callbacks`` entry with ``class_path: lightning_spdkfac.KFAC``. Commands of our own
that are not Trainer methods go into :data:`COMMANDS`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence

import pytorch_lightning as pl
from pytorch_lightning.cli import LightningCLI

from . import validation as val

# Our own subcommands: name -> function(argv after the name) -> exit code. Checked before
# Lightning's (fit, validate, test, predict).
COMMANDS: dict[str, Callable[[list[str]], int | None]] = {}


def _plan(argv: list[str]) -> int:
    """``spdkfac plan``: the recommended K-FAC schedule for a model on a cluster (the simulator)."""
    from .simulate.plan_cli import main as plan_main  # imported on use: the simulator is not needed to train

    return plan_main(argv)


COMMANDS["plan"] = _plan


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


class _CLI(LightningCLI):
    """LightningCLI whose construction errors read as one line.

    jsonargparse reports a constructor's ValueError/TypeError (our "damping must be >= 0, got -1.0") inside
    its own "Does not validate against any of the Union subtypes" error and a traceback; the user then has
    to dig for the one line that matters. Here the root cause is printed alone and the command exits 2,
    as for any other invalid argument. Other errors, and errors raised later (during fit), keep their
    traceback.
    """

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


def lightning_cli(args: Sequence[str] | None = None, run: bool = True) -> LightningCLI:
    """Build (and with ``run=True`` run) the LightningCLI behind ``spdkfac fit|validate|test|predict``."""
    return _CLI(
        pl.LightningModule,
        pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=None if args is None else list(args),
        run=run,
    )


def main(args: Sequence[str] | None = None) -> int:
    """Entry point of the ``spdkfac`` console script; ``args`` defaults to ``sys.argv[1:]``."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]](argv[1:]) or 0
    lightning_cli(args)  # None: LightningCLI reads sys.argv itself
    return 0


if __name__ == "__main__":
    sys.exit(main())
