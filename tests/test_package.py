"""The package's shape: a lazy root that serves plain PyTorch without Lightning, strategies registered for
Lightning users in either import order, and one source for every default."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import pytest
import torch

from lightning_spdkfac import (
    KFAC,
    KFACOptions,
    KFACPreconditioner,
    SPDKFACDeepSpeedStrategy,
    SPDKFACStrategy,
    SPDOptions,
)
from lightning_spdkfac.kfac.options import dtype
from lightning_spdkfac.vocabulary import SCHEDULE_PARTS


def _python(code: str) -> str:
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def test_core_imports_without_lightning_and_strategies_register_when_lightning_comes():
    out = _python("""
        import sys
        from lightning_spdkfac import KFACPreconditioner, SPDDistributor, SPDOptions
        assert "pytorch_lightning" not in sys.modules and "lightning_fabric" not in sys.modules
        import lightning_spdkfac.kfac, lightning_spdkfac.comm, lightning_spdkfac.schedule
        assert "pytorch_lightning" not in sys.modules
        import pytorch_lightning as pl
        from pytorch_lightning.strategies import StrategyRegistry
        assert "spdkfac" in StrategyRegistry and "spdkfac_deepspeed_stage_1" in StrategyRegistry
        t = pl.Trainer(strategy="spdkfac", accelerator="cpu", devices=1, logger=False)
        print(type(t.strategy).__name__)
    """)
    assert out.strip().endswith("SPDKFACStrategy")


def test_core_trains_where_lightning_is_not_installed():
    out = _python("""
        import sys, importlib.abc
        class NoLightning(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in ("pytorch_lightning", "lightning_fabric", "lightning"):
                    raise ModuleNotFoundError(f"No module named {name!r}")
        sys.meta_path.insert(0, NoLightning())
        import torch
        import lightning_spdkfac
        from lightning_spdkfac import KFACPreconditioner, SPDDistributor, SPDOptions
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
        pre = KFACPreconditioner(model, damping=0.01, lr=0.1)
        model(torch.randn(8, 4)).square().sum().backward()
        pre.step()
        assert pre.steps == 1 and SPDOptions().schedule == "spd"
        try:
            lightning_spdkfac.KFAC
        except ModuleNotFoundError as e:
            print("refused:", e)
    """)
    assert "refused: No module named 'pytorch_lightning'" in out


def test_the_callback_the_core_and_kfac_options_share_every_default():
    options = KFACOptions()
    assert KFACPreconditioner(torch.nn.Linear(2, 2)).options == options
    callback = inspect.signature(KFAC.__init__).parameters
    for name, value in vars(options).items():
        shown = callback[name].default
        if name == "lr":
            assert shown is None  # documented: None follows the optimizer's learning rate
        elif name.endswith("_dtype"):
            assert dtype(name, shown, (str(value).removeprefix("torch."),)) is value
        else:
            assert shown == value, name
    assert KFAC().options == KFACOptions()


@pytest.mark.parametrize("strategy", [SPDKFACStrategy, SPDKFACDeepSpeedStrategy])
def test_both_strategies_take_their_defaults_from_spd_options(strategy):
    defaults = SPDOptions()
    shown = inspect.signature(strategy.__init__).parameters
    for name, value in vars(defaults).items():
        if name == "fuse_g":  # an ablation of the simulator and benchmarks, not a strategy argument
            assert name not in shown
        elif name in SCHEDULE_PARTS["spd"]:
            assert shown[name].default is None  # None: the schedule's own choice
        else:
            assert shown[name].default == value, name
    assert strategy().spd_options == defaults


@pytest.mark.parametrize("strategy", [SPDKFACStrategy, SPDKFACDeepSpeedStrategy])
def test_both_strategies_document_every_spd_argument_from_one_text(strategy):
    from lightning_spdkfac.lightning.strategy import SPD_ARGUMENTS, SPD_ARGUMENTS_DOC, SPD_RULES_DOC

    doc = strategy.__doc__
    assert "{spd_" not in doc and SPD_ARGUMENTS_DOC in doc and SPD_RULES_DOC in doc
    for name in ("schedule", *SPD_ARGUMENTS):
        assert f"\n        {name}: " in "\n" + SPD_ARGUMENTS_DOC, name
