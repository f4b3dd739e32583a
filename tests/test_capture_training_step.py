"""A weight used through a function directly in ``LightningModule.training_step`` (outside every module's forward):
the ``KFAC`` callback opens the function capture's scope around the training step's own code (lightning/step_scope.py),
so the layer gets the factors and the preconditioned gradient a module call would have given it.

The reference is the twin that calls the layer as a module (``self.proj(h)``, the module-hook path, itself checked
against dense matrices in tests/test_reference.py)."""

from __future__ import annotations

import warnings

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

from lightning_spdkfac.kfac.capture import FunctionCapture
from lightning_spdkfac.lightning import KFAC


def _modes() -> int:
    return torch._C._len_torch_function_stack()


class StepModel(pl.LightningModule):
    """``proj`` used as ``F.linear`` in training_step (``functional``) or called as a module (its twin)."""

    def __init__(self, functional: bool, fail_at: int | None = None, skip_at: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(6, 5)
        self.proj = nn.Linear(5, 3)
        self.functional, self.fail_at, self.skip_at = functional, fail_at, skip_at
        self.modes: list[int] = []  # torch-function modes active in each training_step

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        self.modes.append(_modes())
        if batch_idx == self.fail_at:
            raise RuntimeError("boom")
        if batch_idx == self.skip_at:
            return None  # no loss: no backward, the scope closes at on_train_batch_end
        x, y = batch
        h = torch.tanh(self.body(x))
        out = F.linear(h, self.proj.weight, self.proj.bias) if self.functional else self.proj(h)
        return F.mse_loss(out, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(24, 6, generator=g), torch.randn(24, 3, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


class Record(pl.Callback):
    """After KFAC's on_before_optimizer_step (listed after it): the preconditioned gradients; at the end the factors,
    the layers left out and the capture's state."""

    def __init__(self, kfac: KFAC) -> None:
        self.kfac = kfac
        self.grads: list[torch.Tensor] = []
        self.factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.left_out: dict[str, str] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: object) -> None:
        grad = pl_module.proj.weight.grad
        if grad is not None:  # (None: a training_step that returned no loss)
            self.grads.append(grad.detach().clone())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pre = self.kfac.preconditioner
        assert pre is not None
        self.factors = {n: (ly.A.clone(), ly.G.clone()) for n, ly in pre.layers.items() if ly.A is not None}
        self.left_out = {x.name: x.reason for x in pre.summary().left_out}
        self.unfactored = dict(pre.unfactored)


def _fit(model: StepModel, capture: bool | str = "auto", max_steps: int = 3) -> tuple[Record, list[str]]:
    kfac = KFAC(factor_update_steps=1, inv_update_steps=1, summary=False, capture=capture)
    record = Record(kfac)
    trainer = pl.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[kfac, record])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    return record, [str(w.message) for w in caught if "K-FAC" in str(w.message)]


@pytest.mark.parametrize("capture", ["auto", True])
def test_a_function_in_training_step_gets_the_factors_and_gradient_of_a_module_call(capture: bool | str) -> None:
    base = _modes()
    fun, mod = StepModel(functional=True), StepModel(functional=False)
    mod.load_state_dict(fun.state_dict())
    rec_f, warned_f = _fit(fun, capture)
    rec_m, warned_m = _fit(mod, capture)
    assert warned_f == [] and warned_m == []
    assert "proj" not in rec_f.left_out and not rec_f.unfactored
    assert set(rec_f.factors) == set(rec_m.factors) == {"body", "proj"}
    for name in ("body", "proj"):
        for a, b in zip(rec_f.factors[name], rec_m.factors[name], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
    assert len(rec_f.grads) == len(rec_m.grads) == 3
    for a, b in zip(rec_f.grads, rec_m.grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    for p, q in zip(fun.parameters(), mod.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    # The scope was open during every functional training_step, and closed after each and after the fit.
    assert fun.modes == [base + 1] * 3 and _modes() == base
    if capture == "auto":  # the twin that uses no function is probed on the first factor step only, then pays nothing
        assert mod.modes == [base + 1, base, base]


def test_the_scope_closes_on_a_step_without_loss_and_on_an_exception() -> None:
    base = _modes()
    skip = StepModel(functional=True, skip_at=1)
    _fit(skip, max_steps=3)
    assert skip.modes[:3] == [base + 1] * 3 and _modes() == base  # (the skipped step's scope did not leak into step 2)
    fail = StepModel(functional=True, fail_at=1)
    with pytest.raises(RuntimeError, match="boom"):
        _fit(fail)
    assert fail.modes == [base + 1, base + 1] and _modes() == base


def test_open_scope_does_nothing_on_a_model_holding_a_compiled_module() -> None:
    model = nn.Sequential(nn.Linear(3, 3), torch.compile(nn.Linear(3, 3)))
    capture = FunctionCapture(model, lambda *a: None)
    assert capture.open_scope() is False and not capture.active
    capture.close_scope()  # (nothing open: nothing happens)
    with capture.scope():
        assert not capture.active
    eager = FunctionCapture(nn.Linear(3, 3), lambda *a: None)
    assert eager.open_scope() is True and eager.active
    eager.close_scope()
    eager.probing = {"lin"}  # (what capture="auto" sets for its first factor step: scope() opens only then)
    with eager.scope():
        assert eager.active
        with eager.scope():  # nests
            assert eager.active
        assert eager.active
    assert not eager.active
    eager.probing = set()
    with eager.scope():  # nothing followed: nothing to pay
        assert not eager.active


def test_a_plain_loop_follows_its_own_function_uses_under_capture_scope() -> None:
    """Without Lightning: ``with pre.capture.scope():`` around the loop's own code, as the callback does."""
    from lightning_spdkfac.kfac.preconditioner import KFACPreconditioner

    def run(functional: bool) -> tuple[KFACPreconditioner, nn.Module]:
        torch.manual_seed(0)
        model = nn.ModuleDict({"body": nn.Linear(6, 5), "proj": nn.Linear(5, 3)})
        pre = KFACPreconditioner(model, lr=0.1, factor_update_steps=1, inv_update_steps=1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
            opt.zero_grad()
            with pre.capture.scope():
                h = torch.tanh(model["body"](x))
                out = F.linear(h, model["proj"].weight, model["proj"].bias) if functional else model["proj"](h)
                loss = F.mse_loss(out, y)
            loss.backward()
            pre.step(opt)
            opt.step()
        return pre, model

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a layer left out would warn)
        (pre_f, fun), (pre_m, mod) = run(True), run(False)
    assert not pre_f.unfactored and set(pre_f.capture.layers) == {"proj"}
    for name in ("body", "proj"):
        torch.testing.assert_close(pre_f.layers[name].A, pre_m.layers[name].A, rtol=0, atol=1e-6)
        torch.testing.assert_close(pre_f.layers[name].G, pre_m.layers[name].G, rtol=0, atol=1e-6)
    for p, q in zip(fun.parameters(), mod.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_a_weight_times_a_weight_in_the_step_is_not_a_call_of_the_layer() -> None:
    """An orthogonality regularizer ``W @ W.T`` in the step's own code (now under the capture's scope) is no map of the
    layer's inputs: the factors after one step equal those of the same step without it."""
    from lightning_spdkfac.kfac.preconditioner import KFACPreconditioner

    def factors(regularized: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.ModuleDict({"body": nn.Linear(6, 5), "proj": nn.Linear(5, 3)})
        pre = KFACPreconditioner(model, lr=0.1, factor_update_steps=1, inv_update_steps=1)
        g = torch.Generator().manual_seed(3)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        with pre.capture.scope():
            w = model["proj"].weight
            loss = F.mse_loss(F.linear(torch.tanh(model["body"](x)), w, model["proj"].bias), y)
            if regularized:
                loss = loss + 1e-2 * (w @ w.T - torch.eye(3)).square().sum() + 1e-2 * (w.T @ w).trace()
        loss.backward()
        pre.step()
        return [t for n in ("body", "proj") for t in (pre.layers[n].A, pre.layers[n].G)]

    for a, b in zip(factors(True), factors(False), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
