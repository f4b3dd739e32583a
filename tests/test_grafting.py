"""grafting: each layer's K-FAC direction with the norm of SGD's or Adam's direction (kfac/grafting.py).

The references are computed here from an ungrafted preconditioner's output (the K-FAC directions P_l) and
the raw gradients: P_l * ||D_l|| / ||P_l||, then the KL clip on the grafted directions, by hand."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from lightning_spdkfac import KFACPreconditioner

F64 = torch.float64


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _grads(model):
    return [torch.cat([m.weight.grad.reshape(m.weight.shape[0], -1), m.bias.grad.reshape(-1, 1)], 1).clone()
            for m in model if isinstance(m, nn.Linear)]


def _step(model, pre, x, opt=None):
    model.zero_grad()
    model(x).pow(2).mean().backward()
    raw = _grads(model)
    pre.step(opt)
    return raw, _grads(model)


@pytest.mark.parametrize("kl_clip", [None, 1e-6])
def test_sgd_grafting_gives_each_layer_the_gradient_norm(kl_clip):
    base, grafted = _net(), _net()
    kw = dict(factor_update_steps=1, inv_update_steps=1, damping=0.01, lr=0.5, kl_clip=None, inv_dtype=F64)
    pre_base = KFACPreconditioner(base, **kw)
    pre = KFACPreconditioner(grafted, **{**kw, "kl_clip": kl_clip}, grafting="sgd")
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(16, 6, generator=g, dtype=F64)
        _, P = _step(base, pre_base, x)
        raw, got = _step(grafted, pre, x)
        want = [p * r.norm() / p.norm() for p, r in zip(P, raw)]
        if kl_clip is not None:
            vg = sum(0.25 * float((w * r).sum()) for w, r in zip(want, raw))  # lr^2 = 0.25
            nu = min(1.0, math.sqrt(kl_clip / abs(vg)))
            assert nu < 1.0
            want = [nu * w for w in want]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        for a, r in zip(got, raw):
            if kl_clip is None:
                torch.testing.assert_close(a.norm(), r.norm())


def test_adam_grafting_uses_a_bias_corrected_second_moment_and_the_optimizers_beta2():
    base, grafted = _net(), _net()
    kw = dict(factor_update_steps=1, inv_update_steps=1, damping=0.01, kl_clip=None, inv_dtype=F64)
    pre_base = KFACPreconditioner(base, **kw)
    pre = KFACPreconditioner(grafted, **kw, grafting="adam")
    opt = torch.optim.AdamW(grafted.parameters(), lr=1e-3, betas=(0.9, 0.99), eps=1e-6)
    v = None
    g = torch.Generator().manual_seed(2)
    for t in range(1, 4):
        x = torch.randn(16, 6, generator=g, dtype=F64)
        _, P = _step(base, pre_base, x)
        raw, got = _step(grafted, pre, x, opt)
        sq = [r.square() for r in raw]
        v = sq if v is None else v
        v = [0.99 * vi + 0.01 * s for vi, s in zip(v, sq)] if t > 1 else [0.01 * s for s in sq]
        for a, p, r, vi in zip(got, P, raw, v):
            d = r / ((vi / (1 - 0.99**t)).sqrt() + 1e-6)
            torch.testing.assert_close(a, p * d.norm() / p.norm(), rtol=1e-9, atol=1e-12)


def test_adam_grafting_moments_are_checkpointed_and_resume_exactly():
    a, b = _net(), _net()
    kw = dict(factor_update_steps=1, inv_update_steps=2, damping=0.01, kl_clip=None, grafting="adam")
    pre_a = KFACPreconditioner(a, **kw)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(16, 6, generator=g, dtype=F64) for _ in range(6)]
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    for x in xs:
        _step(a, pre_a, x)
        opt_a.step()
    pre_b = KFACPreconditioner(b, **kw)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    for x in xs[:3]:
        _step(b, pre_b, x)
        opt_b.step()
    state = copy.deepcopy(pre_b.state_dict())
    assert set(state["grafting_moments"]) == {"0", "2"}
    c = copy.deepcopy(b)
    pre_c = KFACPreconditioner(c, **kw)
    pre_c.load_state_dict(state)
    opt_c = torch.optim.SGD(c.parameters(), lr=0.1)
    for x in xs[3:]:
        _step(c, pre_c, x)
        opt_c.step()
    for p, q in zip(a.parameters(), c.parameters()):
        assert torch.equal(p, q)


def test_corrupt_grafting_moments_are_refused_and_nothing_loads():
    model = _net()
    pre = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1, kl_clip=None, grafting="adam")
    _step(model, pre, torch.randn(4, 6, dtype=F64))
    state = pre.state_dict()
    state["grafting_moments"]["0"] = {"v": -torch.ones(8, 7, dtype=F64), "t": 1}
    with pytest.raises(ValueError, match="grafting moments"):
        pre.load_state_dict(state)


def test_grafting_is_validated_by_name():
    with pytest.raises(ValueError, match="grafting"):
        KFACPreconditioner(_net(), grafting="lamb")
