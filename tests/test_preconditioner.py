"""Behaviour of KFACPreconditioner beyond the formulas: schedules, accumulation, skip rules,
modules that never run, shared weights, mixed precision, state round-trips and bad input.

References are computed in the tests from raw inputs and output gradients (dense matrices),
or by comparing two runs that must agree (e.g. accumulation vs the larger batch).
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_spdkfac import KFACPreconditioner
from lightning_spdkfac.kfac.gradients import GradAccess
from lightning_spdkfac.kfac.options import KFACOptions


def mlp(seed: int = 0, bias: bool = True) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5, bias=bias), nn.Tanh(), nn.Linear(5, 3, bias=bias))


def batch(n: int, seed: int = 1, d_in: int = 6, classes: int = 3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=g), torch.randint(0, classes, (n,), generator=g)


def one_step(model, pre, x, y, opt=None, loss_scale: float = 1.0):
    model.zero_grad(set_to_none=True)
    (F.cross_entropy(model(x), y) * loss_scale).backward()
    pre.step()
    if opt is not None:
        opt.step()


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


# --------------------------------------------------------------------------- schedules
def test_callable_hyperparameters_equal_constants():
    x, y = batch(16)
    ref_model, sched_model = mlp(), mlp()
    calls = []

    def damping(step):
        calls.append(step)
        return 0.01

    ref = KFACPreconditioner(ref_model, damping=0.01, factor_decay=0.9, kl_clip=0.01, lr=0.1, factor_update_steps=1)
    sch = KFACPreconditioner(
        sched_model, damping=damping, factor_decay=lambda s: 0.9, kl_clip=lambda s: 0.01, lr=lambda s: 0.1,
        factor_update_steps=1, inv_update_steps=1,
    )
    ref.inv_update_steps = 1
    for _ in range(3):
        one_step(ref_model, ref, x, y)
        one_step(sched_model, sch, x, y)
        for a, b in zip(grads(ref_model), grads(sched_model)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert calls == [0, 0, 1, 2]  # (the first: KFACOptions' check at construction)


def test_damping_schedule_is_applied_at_each_inverse_step():
    model = mlp()
    pre = KFACPreconditioner(model, damping=lambda s: 0.1 * (s + 1), factor_update_steps=1, inv_update_steps=1,
                             kl_clip=None)
    x, y = batch(16)
    for step in range(3):
        one_step(model, pre, x, y)
        layer = pre.layers["0"]
        A, G = layer.A.double(), layer.G.double()
        pi = ((A.trace() / A.shape[0]) / (G.trace() / G.shape[0])).sqrt().item()
        d = 0.1 * (step + 1)
        want = torch.linalg.inv(A + pi * d**0.5 * torch.eye(A.shape[0], dtype=torch.float64))
        torch.testing.assert_close(layer.A_inv.double(), want, rtol=1e-4, atol=1e-5)
        want = torch.linalg.inv(G + d**0.5 / pi * torch.eye(G.shape[0], dtype=torch.float64))
        torch.testing.assert_close(layer.G_inv.double(), want, rtol=1e-4, atol=1e-5)


def test_lr_callable_reads_the_optimizer_for_the_kl_clip():
    x, y = batch(16)
    m1, m2 = mlp(), mlp()
    opt = torch.optim.SGD(m1.parameters(), lr=0.3)
    p1 = KFACPreconditioner(m1, kl_clip=1e-4, lr=lambda s: opt.param_groups[0]["lr"])
    p2 = KFACPreconditioner(m2, kl_clip=1e-4, lr=0.3)
    one_step(m1, p1, x, y)
    one_step(m2, p2, x, y)
    for a, b in zip(grads(m1), grads(m2)):
        torch.testing.assert_close(a, b)
    # A different lr must change the clipped gradient (the clip is active at this kl_clip).
    m3 = mlp()
    p3 = KFACPreconditioner(m3, kl_clip=1e-4, lr=0.6)
    one_step(m3, p3, x, y)
    assert not torch.allclose(grads(m3)[0], grads(m1)[0])


def test_schedule_returning_bad_value_names_argument_and_step():
    model = mlp()
    with pytest.raises(ValueError, match=r"damping\(step=0\).*>= 0"):  # step 0: at construction (KFACOptions)
        KFACPreconditioner(model, damping=lambda s: -1.0, lr=0.1)
    pre = KFACPreconditioner(model, damping=lambda s: 0.1 if s == 0 else -1.0, lr=0.1, factor_update_steps=1,
                             inv_update_steps=1)
    x, y = batch(8)
    model(x).sum().backward()
    pre.step()
    model(x).sum().backward()
    with pytest.raises(ValueError, match=r"damping\(step=1\).*>= 0"):
        pre.step()


# --------------------------------------------------------------------------- accumulation
@pytest.mark.parametrize("bias", [True, False])
def test_accumulation_equals_larger_batch(bias):
    x, y = batch(16)
    big_model, acc_model = mlp(bias=bias), mlp(bias=bias)
    big = KFACPreconditioner(big_model, kl_clip=1e-3, damping=0.05, lr=0.1)
    acc = KFACPreconditioner(acc_model, kl_clip=1e-3, damping=0.05, lr=0.1)
    big_model.zero_grad()
    F.cross_entropy(big_model(x), y).backward()
    big.step()
    acc_model.zero_grad()
    for xs, ys in ((x[:8], y[:8]), (x[8:], y[8:])):
        (F.cross_entropy(acc_model(xs), ys) / 2).backward()
    acc.step()
    for name in big.layers:
        torch.testing.assert_close(acc.layers[name].A, big.layers[name].A)
        torch.testing.assert_close(acc.layers[name].G, big.layers[name].G)
    for a, b in zip(grads(big_model), grads(acc_model)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_factor_update_steps_skips_collection():
    model = mlp()
    pre = KFACPreconditioner(model, factor_update_steps=2, inv_update_steps=2, lr=0.1)
    x, y = batch(16)
    one_step(model, pre, x, y)
    A0 = pre.layers["0"].A.clone()
    x2, y2 = batch(16, seed=5)
    one_step(model, pre, x2, y2)  # step 1: no factor collection
    torch.testing.assert_close(pre.layers["0"].A, A0, rtol=0, atol=0)
    one_step(model, pre, x2, y2)  # step 2: collected again
    assert not torch.equal(pre.layers["0"].A, A0)


# --------------------------------------------------------------------------- layer selection
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.grouped = nn.ConvTranspose2d(4, 4, 3, padding=1)  # a type K-FAC does not support: named once
        self.head = nn.Linear(4 * 16, 3)
        self.frozen = nn.Linear(3, 3)
        self.frozen.weight.requires_grad_(False)

    def forward(self, x):
        h = self.grouped(torch.relu(self.conv(x)))
        return self.frozen(self.head(h.flatten(1)))


def test_skip_rules():
    with pytest.warns(UserWarning, match="transposed") as rec:
        pre = KFACPreconditioner(Net(), skip_layers=[r"^head$"], lr=0.1)
    assert sum("transposed" in str(w.message) for w in rec) == 1
    assert set(pre.layers) == {"conv"}  # a frozen layer is registered once it trains (test_layer_setups.py)
    assert set(pre.frozen_layers) == {"frozen"}
    assert "grouped" in pre.skipped and "head" in pre.skipped and "frozen" not in pre.skipped
    with pytest.warns(UserWarning):
        by_class = KFACPreconditioner(Net(), skip_layers="Conv2d", lr=0.1)
    assert set(by_class.layers) == {"head"} and set(by_class.frozen_layers) == {"frozen"}


def test_model_without_supported_layers_lists_what_it_found():
    with pytest.raises(ValueError, match=r"no supported layer.*BatchNorm1d.*ReLU"):
        KFACPreconditioner(nn.Sequential(nn.BatchNorm1d(3), nn.ReLU()), lr=0.1)


class Sometimes(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)
        self.use_a = True

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)) if self.use_a else x)


def test_module_whose_forward_did_not_run_is_skipped_for_that_step():
    model = Sometimes()
    pre = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1, lr=0.1)
    x = torch.randn(8, 4)
    model(x).pow(2).mean().backward()
    pre.step()
    A_before = pre.layers["a"].A.clone()
    model.zero_grad()
    model.use_a = False
    model(x).pow(2).mean().backward()
    model.a.weight.grad = torch.ones_like(model.a.weight)  # a stale gradient must stay untouched
    pre.step()
    torch.testing.assert_close(pre.layers["a"].A, A_before, rtol=0, atol=0)
    assert torch.equal(model.a.weight.grad, torch.ones_like(model.a.weight))
    model.use_a = True
    model.zero_grad()
    model(x).pow(2).mean().backward()
    pre.step()  # runs again: preconditioned again
    assert not torch.equal(model.a.weight.grad, torch.ones_like(model.a.weight))


def test_multihead_attention_projections_are_preconditioned():
    """Its out_proj used to be registered but never run (F.linear on its weight); now the q, k, v and output
    projections are blocks whose factors fill (dense references: tests/test_layer_coverage.py)."""
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(8, 2, batch_first=True)
    model = nn.ModuleDict({"attn": attn, "head": nn.Linear(8, 2)})
    pre = KFACPreconditioner(model, lr=0.1, factor_update_steps=1, inv_update_steps=1)
    assert set(pre.layers) == {"attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj", "head"}
    x = torch.randn(4, 5, 8)
    for _ in range(2):
        model.zero_grad()
        out, _ = attn(x, x, x)
        model["head"](out).pow(2).mean().backward()
        raw = [p.grad.clone() for p in attn.parameters()]
        pre.step()
        assert not any(torch.equal(p.grad, r) for p, r in zip(attn.parameters(), raw))
    assert all(layer.A is not None for layer in pre.layers.values())


def test_shared_weights_accumulate_over_calls():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    pre = KFACPreconditioner(lin, factor_decay=0.0, lr=0.1)
    x = torch.randn(6, 4)
    inputs, outs = [], []
    h = x
    for _ in range(2):
        inputs.append(h.detach())
        h = lin(h)
        h.retain_grad()
        outs.append(h)
        h = torch.tanh(h)
    h.pow(2).mean().backward()
    pre.step()
    a = torch.cat([torch.cat([i, torch.ones(6, 1)], 1) for i in inputs])
    d = torch.cat([o.grad for o in outs])
    B = 6
    torch.testing.assert_close(pre.layers[""].A, a.T @ a / a.shape[0])
    # Calls of one forward share the examples: G = (1/B) sum over all rows of (B d)(B d)^T.
    torch.testing.assert_close(pre.layers[""].G, (B * d).T @ (B * d) / B)


def test_inplace_activation_after_linear_sees_the_linear_output_gradient():
    torch.manual_seed(0)
    m_inplace = nn.Sequential(nn.Linear(5, 5), nn.ReLU(inplace=True), nn.Linear(5, 2))
    m_plain = copy.deepcopy(m_inplace)
    m_plain[1] = nn.ReLU()
    p1, p2 = KFACPreconditioner(m_inplace, lr=0.1), KFACPreconditioner(m_plain, lr=0.1)
    x = torch.randn(7, 5)
    for m, p in ((m_inplace, p1), (m_plain, p2)):
        m(x).pow(2).sum().backward()
        p.step()
    torch.testing.assert_close(p1.layers["0"].G, p2.layers["0"].G)


# --------------------------------------------------------------------------- mixed precision
def test_bf16_autocast_keeps_factors_fp32_and_close_to_fp32():
    x, y = batch(32)
    m32, m16 = mlp(), mlp()
    p32, p16 = KFACPreconditioner(m32, lr=0.1), KFACPreconditioner(m16, lr=0.1)
    one_step(m32, p32, x, y)
    m16.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(m16(x), y)
    loss.backward()
    p16.step()
    for name in p32.layers:
        for f in ("A", "G", "A_inv", "G_inv"):
            t16 = getattr(p16.layers[name], f)
            assert t16.dtype == torch.float32 and torch.isfinite(t16).all()
        torch.testing.assert_close(p16.layers[name].A, p32.layers[name].A, rtol=0.05, atol=0.02)
        rel = (p16.layers[name].G - p32.layers[name].G).norm() / p32.layers[name].G.norm()
        assert rel < 0.05


def test_grad_scaler_unscales_g_and_overflow_skips_factor_update():
    x, y = batch(16)
    m_ref, m_sc = mlp(), mlp()
    p_ref = KFACPreconditioner(m_ref, factor_update_steps=1, inv_update_steps=10, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    opt = torch.optim.SGD(m_sc.parameters(), lr=0.1)
    p_sc = KFACPreconditioner(m_sc, grad_scaler=scaler, factor_update_steps=1, inv_update_steps=10, lr=0.1)
    one_step(m_ref, p_ref, x, y)
    opt.zero_grad()
    scaler.scale(F.cross_entropy(m_sc(x), y)).backward()
    scaler.unscale_(opt)
    p_sc.step()
    for name in p_ref.layers:
        torch.testing.assert_close(p_sc.layers[name].G, p_ref.layers[name].G, rtol=1e-5, atol=1e-7)
    for a, b in zip(grads(m_ref), grads(m_sc)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    scaler.step(opt)
    scaler.update()
    # An overflow step: factors untouched, counted, and the scaler skips the step.
    before = {n: (layer.A.clone(), layer.G.clone()) for n, layer in p_sc.layers.items()}
    params_before = [p.detach().clone() for p in m_sc.parameters()]
    opt.zero_grad()
    scaler.scale(F.cross_entropy(m_sc(x), y)).backward()
    m_sc[2].bias.grad[0] = float("inf")
    scaler.unscale_(opt)
    p_sc.step()
    scaler.step(opt)
    scaler.update()
    assert p_sc.skipped_factor_steps == 1
    for n, layer in p_sc.layers.items():
        assert torch.equal(layer.A, before[n][0]) and torch.equal(layer.G, before[n][1])
    for p, q in zip(m_sc.parameters(), params_before):
        assert torch.equal(p, q)


class _StillScaledGrads(GradAccess):
    """Gradients that still carry a dynamic loss scale when K-FAC steps, as DeepSpeed's fp16 engine hands
    them over (it unscales inside its own optimizer step)."""

    def __init__(self, scale: float):
        self.scale = scale

    def loss_scale(self) -> float:
        return self.scale


def test_loss_scale_still_in_the_gradients_is_taken_out_of_g_and_the_kl_clip_and_overflow_skips():
    """The fp16 behaviour of the DeepSpeed path, on any CPU: the loss is multiplied by S before backward,
    the preconditioned gradients (which keep S) are unscaled by the "engine" after K-FAC, an overflow
    step halves S and is skipped. Reference: the same training without any scale. S is a power of two,
    so scaling is exact and the runs agree to round-off."""
    data = [batch(16, seed=s) for s in range(6)]
    kw = dict(kl_clip=1e-4, lr=0.1, factor_update_steps=1, inv_update_steps=1)
    m_ref, m_sc = mlp(), mlp()
    p_ref = KFACPreconditioner(m_ref, **kw)
    access = _StillScaledGrads(2.0**10)
    p_sc = KFACPreconditioner(m_sc, grad_access=access, **kw)
    o_ref = torch.optim.SGD(m_ref.parameters(), lr=0.1)
    o_sc = torch.optim.SGD(m_sc.parameters(), lr=0.1)
    overflow_at = 3
    clipped = []
    for i, (x, y) in enumerate(data):
        m_sc.zero_grad(set_to_none=True)
        (F.cross_entropy(m_sc(x), y) * access.scale).backward()
        if i == overflow_at:
            m_sc[2].bias.grad[1] = float("inf")
            saved = {n: (ly.A.clone(), ly.G.clone()) for n, ly in p_sc.layers.items()}
            params = [p.detach().clone() for p in m_sc.parameters()]
        p_sc.step()
        grads_sc = [p.grad / access.scale for p in m_sc.parameters()]  # the engine unscales in its step
        if not all(torch.isfinite(g).all() for g in grads_sc):  # the engine skips the step, halves S
            assert i == overflow_at
            assert (p_sc.skipped_factor_steps, p_sc.skipped_precondition_steps) == (1, 1)
            for n, ly in p_sc.layers.items():
                assert torch.equal(ly.A, saved[n][0]) and torch.equal(ly.G, saved[n][1])
            assert all(torch.equal(p, q) for p, q in zip(m_sc.parameters(), params))
            access.scale /= 2
            continue
        for p, g in zip(m_sc.parameters(), grads_sc):
            p.grad = g
        o_sc.step()
        raw = one_step_grads(m_ref, x, y)
        p_ref.step()
        # The clip bites in this run (otherwise a wrong S in it would go unnoticed).
        clipped.append(max(float((g - r).abs().max()) for g, r in zip(grads(m_ref), raw)) > 0)
        for a, b in zip(grads_sc, grads(m_ref)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        o_ref.step()
        for n in p_ref.layers:
            torch.testing.assert_close(p_sc.layers[n].G, p_ref.layers[n].G, rtol=1e-5, atol=1e-9)
            torch.testing.assert_close(p_sc.layers[n].A, p_ref.layers[n].A, rtol=1e-6, atol=1e-9)
    assert access.scale == 2.0**9 and all(clipped) and len(clipped) == len(data) - 1
    for a, b in zip(m_sc.parameters(), m_ref.parameters()):  # trained on past the overflow, like the reference
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def one_step_grads(model, x, y):
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    return grads(model)


def test_nonfinite_activation_skips_factor_update():
    model = mlp()
    pre = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=10, lr=0.1)
    x, y = batch(8)
    one_step(model, pre, x, y)
    A0 = pre.layers["0"].A.clone()
    x_bad = x.clone()
    x_bad[0, 0] = float("nan")
    one_step(model, pre, x_bad, y)
    assert pre.skipped_factor_steps == 1
    assert torch.equal(pre.layers["0"].A, A0)


# --------------------------------------------------------------------------- state
@pytest.mark.parametrize("resume_at", [3, 4])
def test_state_dict_round_trip_continues_like_uninterrupted(resume_at):
    data = [batch(16, seed=s) for s in range(6)]

    def make():
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        pre = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=3, lr=0.1)
        return model, opt, pre

    model, opt, pre = make()
    for x, y in data[:resume_at]:
        one_step(model, pre, x, y, opt)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), pre.state_dict()))
    for x, y in data[resume_at:]:
        one_step(model, pre, x, y, opt)
    m2, o2, p2 = make()
    m2.load_state_dict(saved[0])
    o2.load_state_dict(saved[1])
    p2.load_state_dict(saved[2])
    assert p2.steps == resume_at
    for x, y in data[resume_at:]:
        one_step(m2, p2, x, y, o2)
    for a, b in zip(model.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_load_state_of_another_model_is_refused_and_changes_nothing():
    model = mlp()
    pre = KFACPreconditioner(model, lr=0.1)
    one_step(model, pre, *batch(8))
    other = KFACPreconditioner(nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3)), lr=0.1)
    before = pre.state_dict()
    with pytest.raises(ValueError, match=r"(?s)does not match.*'0': factor shapes \(7, 7\), \(5, 5\).*needs \(7, 7\), \(4, 4\)"):
        other.load_state_dict(before)
    with pytest.raises(ValueError, match="not a KFACPreconditioner state"):
        pre.load_state_dict({"foo": 1})
    assert pre.state_dict()["steps"] == 1


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"damping": -1e-3}, r"damping must be >= 0"),
        ({"factor_decay": 1.0}, r"factor_decay must be in \[0, 1\)"),
        ({"factor_decay": -0.1}, r"factor_decay must be in \[0, 1\)"),
        ({"kl_clip": 0.0}, r"kl_clip must be > 0.*kl_clip=None"),
        ({"kl_clip": -1.0}, r"kl_clip must be > 0"),
        ({"factor_update_steps": 0}, r"factor_update_steps must be a positive integer"),
        ({"inv_update_steps": -2}, r"inv_update_steps must be a positive integer"),
        ({"lr": -0.1}, r"lr must be >= 0"),
        ({"damping": float("nan")}, r"damping must be >= 0"),
        ({"inv_dtype": torch.float16}, r"inv_dtype must be a torch dtype name .*'float32', 'float64'"),
        ({"skip_layers": ["("]}, r"skip_layers must be a regular expression.*not a valid regular expression"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KFACPreconditioner(mlp(), **kwargs)


def test_bad_types():
    with pytest.raises(TypeError, match="damping must be a number or a callable"):
        KFACPreconditioner(mlp(), damping="big", lr=0.1)
    with pytest.raises(TypeError, match="inv_update_steps must be a positive integer"):
        KFACPreconditioner(mlp(), inv_update_steps=1.5, lr=0.1)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        KFACPreconditioner("model", lr=0.1)


def test_options_object_and_overrides_are_one_and_the_same():
    opts = KFACOptions(damping=0.01, inv_update_steps=1, skip_layers="^2$", factor_dtype="float64")
    assert opts.skip_layers == ("^2$",) and opts.factor_dtype is torch.float64  # normalized once
    x, y = batch(16)
    a, b = mlp(), mlp()
    pa = KFACPreconditioner(a, opts, lr=0.1)
    pb = KFACPreconditioner(b, damping=0.01, inv_update_steps=1, skip_layers=["^2$"], factor_dtype=torch.float64, lr=0.1)
    assert pa.options == pb.options and list(pa.layers) == ["0"]
    for _ in range(2):
        one_step(a, pa, x, y)
        one_step(b, pb, x, y)
    assert all(torch.equal(g, h) for g, h in zip(grads(a), grads(b)))
    # keyword overrides apply on top of an options object; an unknown name is refused by name
    assert KFACPreconditioner(mlp(), opts, damping=0.5, lr=0.1).options.damping == 0.5
    with pytest.raises(TypeError, match="'dampnig' is not a K-FAC option; the options are damping, "):
        KFACPreconditioner(mlp(), dampnig=0.1, lr=0.1)
    with pytest.raises(TypeError, match="options must be None or a KFACOptions, got dict"):
        KFACPreconditioner(mlp(), {"damping": 0.1}, lr=0.1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.damping = 1.0


def test_inv_update_steps_not_multiple_of_factor_update_steps_warns():
    with pytest.warns(UserWarning, match="not a multiple of factor_update_steps"):
        KFACPreconditioner(mlp(), factor_update_steps=3, inv_update_steps=10, lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        KFACPreconditioner(mlp(), factor_update_steps=5, inv_update_steps=10, lr=0.1)
