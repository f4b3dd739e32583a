"""The KL clip uses the learning rate each layer is actually stepped with.

References are computed by hand: the preconditioned gradients P_l of an unclipped preconditioner
(``kl_clip=None``, the same factors), then nu = min(1, sqrt(kl_clip / sum_l lr_l^2 P_l.g_l)) with each
layer's own group lr, then the optimizer's update.
"""

from __future__ import annotations

import copy

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from helpers.lightning_models import trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_spdkfac import KFAC, KFACPreconditioner
from lightning_spdkfac.comm.scheduler import SPDOptions

KW = dict(damping=0.01, factor_update_steps=1, inv_update_steps=1)
KL = 1e-4  # small enough that the clip is active in every test below


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def batch():
    g = torch.Generator().manual_seed(3)
    return torch.randn(16, 5, generator=g), torch.randint(0, 3, (16,), generator=g)


def unclipped(model):
    """(P_l, g_l) per Linear, in layer order: the preconditioned and the raw gradient, as [W, b] rows."""
    model = copy.deepcopy(model)
    pre = KFACPreconditioner(model, kl_clip=None, **KW)
    x, y = batch()
    F.cross_entropy(model(x), y).backward()
    raw = [torch.cat([m.weight.grad, m.bias.grad[:, None]], 1).clone() for m in model if isinstance(m, nn.Linear)]
    pre.step()
    prec = [torch.cat([m.weight.grad, m.bias.grad[:, None]], 1).clone() for m in model if isinstance(m, nn.Linear)]
    return prec, raw


def expected_update(model, lrs, kl=KL, clipped=True):
    """Per layer, the SGD step lr_l * nu * P_l (nu over the layers given in ``lrs``)."""
    prec, raw = unclipped(model)
    vg = sum(lr * lr * float((p * g).sum()) for lr, p, g in zip(lrs, prec, raw) if lr is not None)
    nu = min(1.0, (kl / vg) ** 0.5)
    assert nu < 0.5 or not clipped, "the clip must be active for the test to mean anything"
    return [None if lr is None else lr * nu * p for lr, p in zip(lrs, prec)]


def moved(before, model):
    return [torch.cat([(b.weight - m.weight), (b.bias - m.bias)[:, None]], 1).detach()
            for b, m in zip(before, model) if isinstance(m, nn.Linear)]


def assert_moves(got, want):
    """Parameter moves against the reference: float32 parameters of size ~0.5 round a move to ~3e-8."""
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-7)
        assert float((g - w).norm()) <= 1e-3 * float(w.norm()) + 1e-7 * w.numel() ** 0.5


@pytest.mark.parametrize("lrs", [(0.5, 0.005), (0.0, 0.1)], ids=["discriminative", "frozen-backbone"])
def test_each_param_group_lr_enters_the_kl_clip(lrs):
    model = make_model()
    want = expected_update(model, lrs)
    before = copy.deepcopy(model)
    opt = torch.optim.SGD([{"params": model[0].parameters(), "lr": lrs[0]},
                           {"params": model[2].parameters(), "lr": lrs[1]}], lr=1.0)
    pre = KFACPreconditioner(model, kl_clip=KL, **KW)
    x, y = batch()
    F.cross_entropy(model(x), y).backward()
    pre.step(opt)
    # The gradients K-FAC wrote are lr_l * nu * P_l / lr_l = nu * P_l: compare them (no rounding of a move).
    for m, lr, ref in zip((model[0], model[2]), lrs, want):
        if lr:
            torch.testing.assert_close(torch.cat([m.weight.grad, m.bias.grad[:, None]], 1), ref / lr,
                                       rtol=1e-5, atol=1e-8)
    opt.step()
    assert_moves(moved(before, model), want)


class TwoOptimizers(pl.LightningModule):
    """Manual optimization: one backward, then each optimizer steps its own layer."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.net = make_model()

    def training_step(self, b, _):
        x, y = b
        first, second = self.optimizers()
        first.zero_grad()
        second.zero_grad()
        self.manual_backward(F.cross_entropy(self.net(x), y))
        first.step()
        second.step()

    def configure_optimizers(self):
        return (torch.optim.SGD(self.net[0].parameters(), lr=0.5),
                torch.optim.SGD(self.net[2].parameters(), lr=0.005))

    def train_dataloader(self):
        return DataLoader(TensorDataset(*batch()), batch_size=16)


def test_two_optimizers_each_clip_with_their_own_lr_and_precondition_once():
    module = TwoOptimizers()
    before = copy.deepcopy(module.net)
    # Each optimizer's step is clipped on its own layer: nu_1 from lr 0.5 and layer 0 (active), nu_2 from
    # lr 0.005 and layer 2 (1: not clipped; with the first optimizer's lr it would be, about 80x too small).
    want = [expected_update(before, (0.5, None))[0], expected_update(before, (None, 0.005), clipped=False)[1]]
    trainer(max_steps=1, callbacks=[KFAC(kl_clip=KL, **KW)]).fit(module)
    assert_moves(moved(before, module.net), want)


class Grouped(pl.LightningModule):
    def __init__(self, lrs):
        super().__init__()
        self.net, self.lrs = make_model(), lrs

    def training_step(self, b, _):
        x, y = b
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD([{"params": self.net[0].parameters(), "lr": self.lrs[0]},
                                {"params": self.net[2].parameters(), "lr": self.lrs[1]}], lr=1.0)

    def train_dataloader(self):
        return DataLoader(TensorDataset(*batch()), batch_size=16)


def test_the_callback_uses_each_layers_group_lr():
    module = Grouped((0.0, 0.1))  # a frozen-backbone warm-up: the first group at lr 0
    before = copy.deepcopy(module.net)
    want = expected_update(before, (0.0, 0.1))
    trainer(max_steps=1, callbacks=[KFAC(kl_clip=KL, **KW)]).fit(module)
    assert_moves(moved(before, module.net), want)


def test_an_extreme_lr_is_clipped_not_zeroed():
    """lr**2 = 1e40 overflows float32: the update must still be the clipped one, as at any clipped lr."""
    steps = {}
    for lr in (1e3, 1e20):
        model = make_model()
        before = copy.deepcopy(model)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        pre = KFACPreconditioner(model, kl_clip=KL, **KW)
        x, y = batch()
        F.cross_entropy(model(x), y).backward()
        pre.step(opt)
        opt.step()
        steps[lr] = moved(before, model)
    for big, small in zip(steps[1e20], steps[1e3]):
        assert torch.isfinite(big).all() and big.abs().max() > 0
        torch.testing.assert_close(big, small, rtol=1e-3, atol=1e-7)


def test_step_without_an_optimizer_or_lr_refuses_to_guess():
    model = make_model()
    pre = KFACPreconditioner(model, kl_clip=KL, **KW)
    x, y = batch()
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(ValueError, match=r"step\(optimizer\).*lr="):
        pre.step()
    assert pre.steps == 0  # refused before anything changed


def test_a_layer_split_between_two_optimizers_is_named():
    model = make_model()
    opt = torch.optim.SGD([model[0].weight, *model[2].parameters()], lr=0.1)
    pre = KFACPreconditioner(model, kl_clip=KL, **KW)
    x, y = batch()
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(ValueError, match=r"K-FAC layer '0'.*only its weight"):
        pre.step(opt)


def test_comm_timeout_below_a_millisecond_is_refused():
    with pytest.raises(ValueError, match=r"comm_timeout_s must be >= 0.001.*no timeout"):
        SPDOptions.from_schedule("spd", comm_timeout_s=1e-7)
    assert SPDOptions.from_schedule("spd", comm_timeout_s=1e-3).comm_timeout_s == 1e-3
