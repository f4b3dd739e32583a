"""``damping="auto"`` (the default): 1e-3 under an Adam-type optimizer, 3e-2 otherwise (kfac/auto_damping.py).

References are independent runs with the damping passed explicitly: a default run must precondition exactly as the
explicit run of the damping the rule names, step for step.
"""

from __future__ import annotations

import warnings

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.core.optimizer import LightningOptimizer
from test_cli_usability import DIGITS
from torch import nn

from lightning_spdkfac import KFAC
from lightning_spdkfac.cli import lightning_cli
from lightning_spdkfac.kfac import auto_damping
from lightning_spdkfac.kfac.options import KFACOptions
from lightning_spdkfac.kfac.preconditioner import KFACPreconditioner


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))


class FusedAdam(torch.optim.Optimizer):  # a class outside torch named like DeepSpeed's
    def __init__(self, params):
        super().__init__(params, {"lr": 1e-3})


class MuonWithAdamW(FusedAdam):  # Muon combined with AdamW (the benchmarks' kind): Muon decides
    pass


class Wrapper:  # DeepSpeed's ZeRO optimizers hold the real one as .optimizer
    def __init__(self, inner):
        self.optimizer = inner
        self.param_groups = inner.param_groups


@pytest.mark.parametrize(("make", "expected"), [
    (lambda p: torch.optim.AdamW(p), auto_damping.ADAM_TYPE_DAMPING),
    (lambda p: torch.optim.Adam(p), auto_damping.ADAM_TYPE_DAMPING),
    (lambda p: torch.optim.RMSprop(p), auto_damping.ADAM_TYPE_DAMPING),
    (lambda p: torch.optim.Adagrad(p), auto_damping.ADAM_TYPE_DAMPING),
    (lambda p: FusedAdam(p), auto_damping.ADAM_TYPE_DAMPING),
    (lambda p: Wrapper(torch.optim.AdamW(p)), auto_damping.ADAM_TYPE_DAMPING),
    (lambda p: LightningOptimizer(torch.optim.AdamW(p)), auto_damping.ADAM_TYPE_DAMPING),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), auto_damping.DEFAULT_DAMPING),
    (lambda p: torch.optim.Muon([q for q in p if q.dim() == 2]), auto_damping.DEFAULT_DAMPING),
    (lambda p: MuonWithAdamW(p), auto_damping.DEFAULT_DAMPING),
    (lambda p: None, auto_damping.DEFAULT_DAMPING),
])
def test_the_rule_names_the_damping(make, expected) -> None:
    value, why = auto_damping.resolve(make(list(mlp().parameters())), "kfac")
    assert value == expected and why
    assert auto_damping.resolve(make(list(mlp().parameters())), "eigen_adam")[0] == auto_damping.DEFAULT_DAMPING


def run(opt_cls, damping, steps: int = 4, **opt_kw) -> list[torch.Tensor]:
    """The preconditioned gradients of ``steps`` steps (inverses every 2) under ``opt_cls``."""
    model = mlp()
    kw = {} if damping is None else {"damping": damping}
    pre = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=2, **kw)
    opt = opt_cls(model.parameters(), **opt_kw)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x, y = torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)
        nn.functional.mse_loss(model(x), y).backward()
        pre.step(opt)
        out += [p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
    return out


@pytest.mark.parametrize(("opt_cls", "opt_kw", "expected"), [
    (torch.optim.AdamW, {"lr": 1e-2}, 1e-3),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, 3e-2),
])
def test_a_default_run_is_the_explicit_run_of_the_damping_it_names(opt_cls, opt_kw, expected) -> None:
    assert KFACOptions().damping == "auto"
    default, explicit = run(opt_cls, None, **opt_kw), run(opt_cls, expected, **opt_kw)
    other = run(opt_cls, 3e-2 if expected == 1e-3 else 1e-3, **opt_kw)
    assert all(torch.equal(a, b) for a, b in zip(default, explicit, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(default, other, strict=True))  # (the damping matters here)


def test_explicit_damping_and_the_optimizer_argument() -> None:
    model = mlp()
    pre = KFACPreconditioner(model, damping=0.05)
    pre.choose_damping(torch.optim.AdamW(model.parameters()))
    assert pre.damping == 0.05 and pre.damping_choice is None
    pre = KFACPreconditioner(model, optimizer=torch.optim.AdamW(model.parameters()))
    assert pre.damping == 1e-3 and pre.damping_choice.startswith("0.001 (AdamW")
    pre = KFACPreconditioner(model)
    assert pre.damping == 3e-2 and pre.damping_choice is None  # (unresolved: the SGD-safe value until a step)
    with pytest.raises(TypeError, match="damping.*'auto', the default"):
        KFACPreconditioner(model, damping="automatic")


def test_a_restored_adapted_damping_is_kept() -> None:
    model = mlp()
    pre = KFACPreconditioner(model, adapt_damping=True)
    assert pre.step_size is not None
    pre.step_size.damping = 0.2  # (what load_state_dict restores under adapt_damping)
    pre.choose_damping(torch.optim.AdamW(model.parameters()))
    assert pre.damping == 0.2 and "adapted" in pre.damping_choice


class Tiny(pl.LightningModule):
    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.net, self.optimizer_name, self.seen = mlp(), optimizer, []

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-2)
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def on_train_end(self) -> None:
        (cb,) = [c for c in self.trainer.callbacks if isinstance(c, KFAC)]
        self.seen.append(cb.preconditioner.damping)


@pytest.mark.parametrize(("optimizer", "expected"), [("adamw", 1e-3), ("sgd", 3e-2)])
def test_the_callback_resolves_it_from_configure_optimizers(optimizer, expected, tmp_path) -> None:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 6, generator=g), torch.randn(64, 3, generator=g))
    module = Tiny(optimizer)
    trainer = pl.Trainer(max_steps=3, callbacks=[KFAC(summary=False)], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         accelerator="cpu", devices=1, default_root_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=16))
    assert module.seen == [expected]


def test_the_cli_takes_auto_and_numbers(isolated, tmp_path) -> None:
    for value, expected in (("auto", "auto"), ("0.001", 0.001)):
        cli = lightning_cli(["--config", str(DIGITS), f"--trainer.default_root_dir={tmp_path}",
                             f"--kfac.damping={value}"], run=False)
        (kfac,) = [c for c in cli.trainer.callbacks if isinstance(c, KFAC)]
        assert kfac.options.damping == expected
