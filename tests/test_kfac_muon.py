"""K-FAC composed with Muon (issue 37, docs/math.md "K-FAC with Muon"), checked numerically.

The facts stated there: Muon's update of a matrix is Newton-Schulz's orthogonalisation of its (Nesterov) momentum,
so a positive scale of the gradient does not change Muon's first update (up to Newton-Schulz's bfloat16
arithmetic, exactly for a power of two) and the update's size is set by the lr and the shape; K-FAC's KL clip
multiplies every preconditioned gradient by one ``nu``, computed with the param group's (nominal) lr, so under
``MuonWithAdamW`` (benchmarks/_tta_optimizers.py) the Muon-stepped matrices' first update is the same with or
without the clip while the AdamW-stepped layers (head, biases) receive ``nu * P`` as under AdamW alone; K-FAC +
Muon trains. References: Newton-Schulz re-implemented here in float64 from the published quintic coefficients,
``nu`` set by construction.
"""

from __future__ import annotations

import importlib
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
NS_COEFFS = (3.4445, -4.7750, 2.0315)  # Muon's quintic Newton-Schulz coefficients (Jordan et al. 2024)
BF16_TOL = 0.03  # relative Frobenius error of Newton-Schulz in bfloat16 on a random, well-conditioned gradient


def ns_reference(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Newton-Schulz orthogonalisation in float64: ``X = G / ||G||_F``, then ``steps`` quintic iterations on the
    wide orientation."""
    x = g.double()
    wide = x.shape[0] <= x.shape[1]
    x = x if wide else x.T
    x = x / x.norm()
    a, b, c = NS_COEFFS
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x if wide else x.T


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def muon_first_update(g: torch.Tensor, lr: float = 0.02) -> torch.Tensor:
    """The change torch.optim.Muon (no weight decay, its defaults otherwise) makes to a matrix in its first step."""
    w = nn.Parameter(torch.zeros_like(g))
    opt = torch.optim.Muon([w], lr=lr, weight_decay=0.0, adjust_lr_fn="match_rms_adamw")
    w.grad = g.clone()
    opt.step()
    return w.detach().clone()


@pytest.mark.parametrize("shape", [(16, 48), (64, 24)])
def test_muon_first_update_ignores_a_positive_gradient_scale(shape):
    torch.manual_seed(0)
    g = torch.randn(shape)
    lr = 0.02
    base = muon_first_update(g, lr)
    adjusted = lr * 0.2 * math.sqrt(max(shape))  # match_rms_adamw
    # against the float64 reference: Muon's first step is -adjusted_lr * NS(g) (its momentum is a multiple of g)
    assert rel(base, -adjusted * ns_reference(g)) < BF16_TOL
    # a power-of-two scale is exact in bfloat16; any other positive scale (a KL clip's nu) up to its rounding
    assert torch.equal(muon_first_update(0.25 * g, lr), base)
    for c in (0.3, 1e-3, 1e3):
        assert rel(muon_first_update(c * g, lr), base) < BF16_TOL
    # ... while another direction gives another update: the tolerance is far below what a direction change makes
    assert rel(muon_first_update(g + 0.5 * torch.randn(shape), lr), base) > 10 * BF16_TOL
    # the size is set by the lr and the shape: singular values of NS's output near 1 (the quintic's band)
    s = torch.linalg.svdvals(base.double() / adjusted)
    assert 0.5 < float(s.min()) and float(s.max()) < 1.3
    assert 0.6 < float(base.norm()) / (adjusted * math.sqrt(min(shape))) < 1.25


# ------------------------------------------------------------------------------ K-FAC + MuonWithAdamW
@pytest.fixture(scope="module")
def tta_opt():
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(REPO / "benchmarks"))
        yield importlib.import_module("_tta_optimizers")


def _module(tta_opt, lr: float, weight_decay: float = 0.0):
    import pytorch_lightning as pl

    class MLP(pl.LightningModule):
        """6 -> 16 -> 16 -> 3, tanh: two hidden matrices for Muon, the head and biases for AdamW."""

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.l1, self.l2, self.head = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 3)

        def forward(self, x):
            return self.head(torch.tanh(self.l2(torch.tanh(self.l1(x)))))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return tta_opt.build_optimizer(self, "muon", lr, weight_decay)

    return MLP()


def _data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 6, generator=g)
    y = (x @ torch.randn(6, 3, generator=g)).argmax(1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64)  # one fixed batch


def _fit(tta_opt, steps: int, lr: float, **kfac):
    """Fit with KFAC(**kfac); per step: the raw gradients, K-FAC's gradients, the parameter changes, the loss."""
    import pytorch_lightning as pl

    from lightning_spdkfac import KFAC

    rec: list[dict] = []

    class Before(pl.Callback):  # runs before KFAC's on_before_optimizer_step: the raw gradients
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            rec.append({"w0": {n: p.detach().clone() for n, p in pl_module.named_parameters()}})

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            rec[-1]["g"] = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters()}

    class After(pl.Callback):  # after KFAC's: what the optimizer steps with
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            rec[-1]["p"] = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters()}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            rec[-1]["dw"] = {n: p.detach() - rec[-1]["w0"][n] for n, p in pl_module.named_parameters()}
            rec[-1]["loss"] = float(outputs["loss"])

    model = _module(tta_opt, lr)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[Before(), KFAC(log_step_time=False, **kfac), After()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, train_dataloaders=_data())
    return model, rec


MUON = ("l1.weight", "l2.weight")  # split_muon_params: hidden matrices; the head and every bias go to AdamW


def test_split_is_what_the_composition_assumes(tta_opt):
    m = _module(tta_opt, 0.01)
    muon, adamw = tta_opt.split_muon_params(m)
    names = {id(p): n for n, p in m.named_parameters()}
    assert sorted(names[id(p)] for p in muon) == sorted(MUON)
    assert {names[id(p)] for p in adamw} == {"l1.bias", "l2.bias", "head.weight", "head.bias"}


@pytest.mark.parametrize("nu_set", [0.25, 0.3])
def test_kl_clip_under_muon(tta_opt, nu_set):
    """One nu on every preconditioned gradient, from the nominal lr; Muon's update of the hidden matrices does not
    see it (bit for bit at a power of two, else up to bfloat16 rounding), the AdamW-stepped head and biases receive
    nu * P."""
    lr = 0.01
    every = {"factor_update_steps": 1, "inv_update_steps": 1}
    _, free = _fit(tta_opt, 1, lr, kl_clip=None, **every)
    step = free[0]
    pre = [n for n in step["g"] if not torch.equal(step["g"][n], step["p"][n])]
    assert set(pre) == {"l1.weight", "l1.bias", "l2.weight", "l2.bias", "head.weight", "head.bias"}, pre
    # the KL sum: lr^2 <P, g> over the preconditioned layers (float64), lr the groups' nominal lr (all equal here)
    s = sum(float((step["p"][n].double() * step["g"][n].double()).sum()) for n in pre)
    assert s > 0
    kl_clip = nu_set ** 2 * lr ** 2 * s  # so that nu = sqrt(kl_clip / (lr^2 s)) = nu_set
    _, clipped = _fit(tta_opt, 1, lr, kl_clip=kl_clip, **every)
    c = clipped[0]
    for n in pre:  # the same factors and inverses (same data and weights): every gradient is nu_set * P
        torch.testing.assert_close(c["p"][n], nu_set * step["p"][n], rtol=1e-5, atol=1e-9)
    for n in MUON:
        adjusted = lr * 0.2 * math.sqrt(max(step["p"][n].shape))
        ref = -adjusted * ns_reference(step["p"][n])  # float64: exactly invariant to nu
        torch.testing.assert_close(ns_reference(nu_set * step["p"][n].double()), ns_reference(step["p"][n]), rtol=1e-9, atol=1e-12)
        if nu_set == 0.25:  # bfloat16 scales a power of two exactly: the same update, bit for bit
            assert torch.equal(c["dw"][n], step["dw"][n])
        else:  # any other nu changes Muon's update only by bfloat16's rounding (what separates each from ref)
            noise = rel(step["dw"][n], ref) + rel(c["dw"][n], ref)
            assert rel(c["dw"][n], step["dw"][n]) <= 1.5 * noise + 1e-6
        # the first step is -adjusted_lr * NS(P) (the momentum is a multiple of P), P K-FAC's direction, which is
        # not plain Muon's -adjusted_lr * NS(g): K-FAC changed the direction (the singular vectors)
        assert rel(step["dw"][n], ref) < 0.15
        assert rel(ref, -adjusted * ns_reference(step["g"][n])) > 0.15


def test_kfac_on_muon_with_adamw_trains(tta_opt):
    _, rec = _fit(tta_opt, 40, 0.02, factor_update_steps=1, inv_update_steps=5)
    losses = [r["loss"] for r in rec]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.5 * losses[0], losses
    last = rec[-1]
    assert all(not torch.equal(last["g"][n], last["p"][n]) for n in MUON)  # still preconditioned at the end


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
