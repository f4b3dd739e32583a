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

import sys
from collections.abc import Callable, Sequence

import pytorch_lightning as pl
from pytorch_lightning.cli import LightningCLI

# Our own subcommands: name -> function(argv after the name) -> exit code. Checked before
# Lightning's (fit, validate, test, predict).
COMMANDS: dict[str, Callable[[list[str]], int | None]] = {}


def _plan(argv: list[str]) -> int:
    """``spdkfac plan``: the recommended K-FAC schedule for a model on a cluster (the simulator)."""
    from .simulate.plan import main as plan_main  # imported on use: the simulator is not needed to train

    return plan_main(argv)


COMMANDS["plan"] = _plan


def lightning_cli(args: Sequence[str] | None = None, run: bool = True) -> LightningCLI:
    """Build (and with ``run=True`` run) the LightningCLI behind ``spdkfac fit|validate|test|predict``."""
    return LightningCLI(
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
