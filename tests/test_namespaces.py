"""Both Lightning namespaces: ``pytorch_lightning`` (``lightning_spdkfac``) and the unified package's
``lightning.pytorch`` (``lightning_spdkfac.unified``) get the callback, both strategies and the registered
``"spdkfac*"`` names, from one implementation. Import order matters for registration, so those checks run
in fresh interpreters."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_spdkfac.multiprocess import run_distributed
from lightning_spdkfac.vocabulary import DDP_STRATEGY_NAMES, DEEPSPEED_STRATEGY_NAMES

pytest.importorskip("lightning", reason="the unified `lightning` package is not installed (the dev extras install it)")

NAMESPACES = ("pytorch_lightning", "lightning.pytorch")
NAMES = sorted(set(DDP_STRATEGY_NAMES) | set(DEEPSPEED_STRATEGY_NAMES))
KW = dict(damping=0.01, kl_clip=0.01, factor_update_steps=1, inv_update_steps=3)


def _python(code: str) -> str:
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def _flavour(namespace: str):
    """(Lightning, the module with KFAC / SPDKFACStrategy / SPDKFACDeepSpeedStrategy for it)."""
    package = "lightning_spdkfac" if namespace == "pytorch_lightning" else "lightning_spdkfac.unified"
    return importlib.import_module(namespace), importlib.import_module(package)


def _data(n=32):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _tiny(L, batch_size=8, interleaved=False):
    """tests/helpers/lightning_models.Tiny (TinyInterleaved) as a LightningModule of namespace ``L``."""

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))

        def training_step(self, batch, _):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)

        def train_dataloader(self):
            ds = TensorDataset(*_data())
            sampler = DistributedSampler(ds, shuffle=False) if interleaved else None
            return DataLoader(ds, batch_size=batch_size, shuffle=False, sampler=sampler)

    return Tiny()


def _trainer(L, **kw):
    return L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, **kw)


def _fit(namespace, rank=0, world=1, steps=6, strategy=None):
    """A K-FAC fit of Tiny in ``namespace``: the parameters, and the K-FAC steps taken."""
    L, flavour = _flavour(namespace)
    if world > 1:
        os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
        warnings.filterwarnings("ignore")
        torch.set_num_threads(1)
    model = _tiny(L, batch_size=8 // world, interleaved=world > 1)
    cb = flavour.KFAC(**KW)
    kw = dict(strategy=strategy, use_distributed_sampler=False) if strategy is not None else {}
    t = _trainer(L, max_steps=steps, devices=world, callbacks=[cb], **kw)
    t.fit(model)
    return [p.detach().clone() for p in model.net.parameters()], cb.state_dict()["steps"], type(t.strategy).__module__


def _fit_by_name_on_ranks(rank, world, namespace, name):  # module level: run_distributed pickles it by reference
    return _fit(namespace, rank, world, steps=6, strategy=name)


def _deepspeed_fit_on_ranks(rank, world, steps):
    L, flavour = _flavour("lightning.pytorch")
    strategy = flavour.SPDKFACDeepSpeedStrategy(stage=2, profile_steps=(1, 2), logging_batch_size_per_gpu=4)
    return _fit("lightning.pytorch", rank, world, steps=steps, strategy=strategy)


def test_a_lightning_pytorch_user_gets_the_callback_both_strategies_and_every_name():
    out = _python(f"""
        import sys
        import lightning.pytorch as L
        from lightning_spdkfac.unified import KFAC, SPDKFACDeepSpeedStrategy, SPDKFACStrategy
        from lightning_spdkfac.lightning.protocol import KFACStrategy
        quiet = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
        t = L.Trainer(callbacks=[KFAC(damping=0.01)], strategy="spdkfac", **quiet)
        assert type(t.strategy) is SPDKFACStrategy and isinstance(t.strategy, KFACStrategy)
        assert [c for c in t.callbacks if isinstance(c, KFAC)] and all(isinstance(c, L.Callback) for c in t.callbacks)
        t = L.Trainer(callbacks=[KFAC()], strategy=SPDKFACStrategy(schedule="mpd"), **quiet)
        assert t.strategy.spd_options.placement == "round_robin"
        t = L.Trainer(strategy=SPDKFACDeepSpeedStrategy(stage=1), **quiet)
        assert t.strategy.config["zero_optimization"]["stage"] == 1 and isinstance(t.strategy, KFACStrategy)
        for name in {NAMES!r}:
            t = L.Trainer(strategy=name, **quiet)
            assert type(t.strategy) in (SPDKFACStrategy, SPDKFACDeepSpeedStrategy), (name, type(t.strategy))
            print(name, type(t.strategy).__name__, t.strategy.spd_options.schedule)
    """)
    lines = out.strip().splitlines()[-len(NAMES):]
    assert [line.split()[0] for line in lines] == NAMES
    assert "spdkfac_mpd SPDKFACStrategy mpd" in lines
    assert "spdkfac_deepspeed_stage_1 SPDKFACDeepSpeedStrategy spd" in lines


def test_lightning_pytorchs_own_cli_takes_the_callback_and_the_strategy_by_name():
    out = _python("""
        import torch
        import lightning.pytorch as L
        from lightning.pytorch.cli import LightningCLI

        class Model(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Linear(2, 2)

        args = ["--trainer.callbacks", "lightning_spdkfac.unified.KFAC", "--trainer.callbacks.damping", "0.02",
                "--trainer.strategy", "spdkfac_mpd", "--trainer.accelerator", "cpu", "--trainer.devices", "1",
                "--trainer.logger", "false", "--trainer.enable_progress_bar", "false"]
        cli = LightningCLI(Model, run=False, args=args)
        kfac = [c for c in cli.trainer.callbacks if type(c).__name__ == "KFAC"]
        print(type(kfac[0]).__module__, kfac[0].options.damping, type(cli.trainer.strategy).__module__,
              cli.trainer.strategy.spd_options.schedule)
    """)
    assert out.strip().splitlines()[-1] == "lightning_spdkfac.unified 0.02 lightning_spdkfac.unified mpd"


# The first order in the 10-minute suite, the others in make test-slow (each a fresh interpreter: ~9 s).
@pytest.mark.parametrize("imports", [
    "import lightning_spdkfac; import lightning.pytorch as L",
    pytest.param("import lightning as L; import lightning_spdkfac; L = L.pytorch", marks=pytest.mark.slow),
    pytest.param("import lightning_spdkfac; import lightning as L; import pytorch_lightning; L = L.pytorch",
                 marks=pytest.mark.slow),
    pytest.param("import pytorch_lightning; import lightning.pytorch as L; import lightning_spdkfac",
                 marks=pytest.mark.slow),
], ids=["package-first", "lightning-first", "package-lightning-pytorch_lightning", "both-namespaces-first"])
def test_every_import_order_registers_the_names_in_each_imported_namespace(imports):
    out = _python(f"""
        import sys
        {imports}
        names = {NAMES!r}
        missing = [n for n in names if n not in L.strategies.StrategyRegistry]
        assert not missing, missing
        t = L.Trainer(strategy="spdkfac", accelerator="cpu", devices=1, logger=False)
        assert isinstance(t.strategy, L.strategies.DDPStrategy)
        print("lightning.pytorch:", type(t.strategy).__module__)
        if "pytorch_lightning" in sys.modules:
            import pytorch_lightning as pl
            assert not [n for n in names if n not in pl.strategies.StrategyRegistry]
            t = pl.Trainer(strategy="spdkfac", accelerator="cpu", devices=1, logger=False)
            print("pytorch_lightning:", type(t.strategy).__module__)
    """)
    assert "lightning.pytorch: lightning_spdkfac.unified" in out
    if "pytorch_lightning" in imports:
        assert "pytorch_lightning: lightning_spdkfac.lightning.strategy" in out


def test_the_package_root_waits_for_lightning_before_registering_in_it():
    out = _python("""
        import sys
        import lightning_spdkfac
        print(sorted(m for m in ("lightning", "lightning_spdkfac.unified", "pytorch_lightning") if m in sys.modules))
        import lightning.pytorch
        print("lightning_spdkfac.unified" in sys.modules)
    """)
    assert out.split("\n")[:2] == ["[]", "True"]


def test_the_two_flavours_are_one_implementation():
    import lightning.pytorch as L
    import pytorch_lightning as pl

    import lightning_spdkfac as root
    from lightning_spdkfac import unified
    from lightning_spdkfac.lightning.callback import KFACCallbackBody
    from lightning_spdkfac.lightning.deepspeed import SPDKFACDeepSpeedStrategyBody
    from lightning_spdkfac.lightning.strategy import SPDKFACStrategyBody

    pairs = [(root.KFAC, unified.KFAC, KFACCallbackBody, pl.Callback, L.Callback),
             (root.SPDKFACStrategy, unified.SPDKFACStrategy, SPDKFACStrategyBody,
              pl.strategies.DDPStrategy, L.strategies.DDPStrategy),
             (root.SPDKFACDeepSpeedStrategy, unified.SPDKFACDeepSpeedStrategy, SPDKFACDeepSpeedStrategyBody,
              pl.strategies.DeepSpeedStrategy, L.strategies.DeepSpeedStrategy)]
    for classic, new, body, classic_base, new_base in pairs:
        assert classic.__mro__[1] is body and new.__mro__[1] is body  # the code lives in the body, once
        assert issubclass(classic, classic_base) and not issubclass(classic, new_base)
        assert issubclass(new, new_base) and not issubclass(new, classic_base)
        # nothing but the namespace is the flavour's own (the rest: Python's bookkeeping, the docstring)
        own = {k for k in vars(new) if not (k.startswith("__") or k == "_abc_impl")}
        assert own <= {"lightning_package"}, own
        assert new.__doc__ == classic.__doc__ == body.__doc__ and "{spd_arguments}" not in body.__doc__


def test_a_one_process_fit_is_bitwise_the_same_in_both_namespaces(isolated):
    ref, ref_steps, _ = _fit("pytorch_lightning")
    new, new_steps, _ = _fit("lightning.pytorch")
    assert ref_steps == new_steps == 6
    init = list(_tiny(_flavour("lightning.pytorch")[0]).net.parameters())
    assert not all(torch.equal(a, b) for a, b in zip(ref, init))  # it trained
    for a, b in zip(ref, new):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_two_ranks_by_name_under_lightning_pytorch_train_bitwise_equal_replicas_as_pytorch_lightning_does():
    new = run_distributed(_fit_by_name_on_ranks, 2, "lightning.pytorch", "spdkfac", timeout=120)
    ref = run_distributed(_fit_by_name_on_ranks, 2, "pytorch_lightning", "spdkfac", timeout=120)
    assert [r[2] for r in new] == ["lightning_spdkfac.unified"] * 2
    assert [r[1] for r in new] == [6, 6]
    for a, b in zip(new[0][0], new[1][0]):
        assert torch.equal(a, b)
    for a, b in zip(new[0][0], ref[0][0]):  # and the same training as the pytorch_lightning flavour
        assert torch.equal(a, b)
    one, _, _ = _fit("lightning.pytorch")  # ... which on one process is the fit on the joint batch
    for a, b in zip(new[0][0], one):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_deepspeed_strategy_under_lightning_pytorch_fits_on_two_ranks():
    pytest.importorskip("deepspeed")
    results = run_distributed(_deepspeed_fit_on_ranks, 2, 3, timeout=240)
    assert [r[2] for r in results] == ["lightning_spdkfac.unified"] * 2
    assert [r[1] for r in results] == [3, 3]
    for a, b in zip(results[0][0], results[1][0]):
        assert torch.equal(a, b)
