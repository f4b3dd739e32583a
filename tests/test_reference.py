"""KFACPreconditioner against independent dense references.

Every reference here is built from the definitions (the K-FAC spec), not from the library:
the raw layer inputs and output gradients are captured with the tests' own hooks, the
im2col rows of Conv2d are built with explicit loops over output positions, and the factors,
damped inverses (``torch.linalg.inv`` in float64), preconditioned gradients and the KL clip
are computed densely in float64 (tests/helpers/dense_reference.py).

Spec (per registered layer, R rows, B = first dim of the layer input):
    A_new = (1/R) sum_r a_r a_r^T            (a_r with a trailing 1 when the layer has a bias)
    G_new = (1/B) sum_r (B d_r)(B d_r)^T      (= B sum_r d_r d_r^T)
    F <- decay F + (1 - decay) F_new          (the first update takes F_new)
    A_inv = (A + damping I)^-1, G_inv = (G + damping I)^-1   on steps k % inv_update_steps == 0
    P = G_inv [dW, db] A_inv
    nu = min(1, sqrt(kl_clip / |sum_layers lr^2 <P, grad>|)),  grad <- nu P
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.dense_reference import (
    F64,
    Recorder,
    a_rows,
    assert_close,
    check_grad_consistency,
    d_rows,
    damped_invs,
    grad_matrix,
    im2col_loops,
    pi_dampings,
    ref_factors,
    ref_precondition,
)
from torch import nn

from lightning_spdkfac import KFACPreconditioner

# ----------------------------------------------------------------------------- setups

PRECISIONS = {
    # name: (model dtype, factor_dtype, inv_dtype, tolerance)
    "f32": (torch.float32, torch.float32, torch.float32, 2e-4),
    "f64": (F64, F64, F64, 1e-9),
}


# The spec above: factors every step, inverses on steps k % inv_update_steps == 0, expand rows (the
# references build every im2col row); set here, not left to the defaults (factors every 5 steps,
# inverses every 50, "auto" = reduce for Conv2d). A test may override them.
SPEC_SCHEDULE = dict(factor_update_steps=1, inv_update_steps=10, factor_approx="expand")


def make_pre(model, prec, **kw):
    _, fdt, idt, _ = PRECISIONS[prec]
    return KFACPreconditioner(model, factor_dtype=fdt, inv_dtype=idt, **{**SPEC_SCHEDULE, **kw})


def layer_names(model):
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear | nn.Conv2d)]


def run_step(model, pre, rec, xs, loss_fn, scale=1.0):
    """One optimizer step (micro-batches xs); returns the original grad matrices before pre.step()."""
    model.zero_grad(set_to_none=True)
    rec.clear()
    for x in xs:
        (loss_fn(model(x)) * scale).backward()
    names = list(rec.modules)
    grads = {n: grad_matrix(rec.modules[n]) for n in names}
    pre.step()
    return grads


def sq_loss(out):
    # a per-example mean (so micro-batches of 8 with loss/2 equal one batch of 16)
    return (0.5 * out.pow(2) + 0.1 * out).sum(dim=-1).mean()


def check_single_step(model, pre, rec, x, prec, damping, kl_clip, lr, loss_fn=sq_loss):
    """One step: factors, inverses and preconditioned grads of every layer against the reference."""
    tol = PRECISIONS[prec][3]
    names = list(rec.modules)
    grads = run_step(model, pre, rec, [x], loss_fn)
    refs = {n: ref_factors(rec, n) for n in names}
    for n in names:
        check_grad_consistency(rec, n, grads[n], 1e-9 if prec == "f64" else 1e-4)
        A, G = refs[n]
        L = pre.layers[n]
        assert_close(L.A, A, tol)
        assert_close(L.G, G, tol)
        assert L.A.dtype == PRECISIONS[prec][1] and L.G.dtype == PRECISIONS[prec][1]
    A_invs, G_invs = zip(*(damped_invs(*refs[n], damping) for n in names))
    for n, Ai, Gi in zip(names, A_invs, G_invs, strict=True):
        assert_close(pre.layers[n].A_inv, Ai, tol)
        assert_close(pre.layers[n].G_inv, Gi, tol)
    P, nu = ref_precondition([grads[n] for n in names], A_invs, G_invs, kl_clip, lr)
    for n, p in zip(names, P, strict=True):
        got = grad_matrix(rec.modules[n])
        assert_close(got, p, tol)
        # and the write-back really changed the gradient
        assert not torch.allclose(got, grads[n], rtol=1e-3, atol=1e-6)
    return nu, grads, refs


# ----------------------------------------------------------------------------- 1. 2-D Linear


@pytest.mark.parametrize("prec", ["f32", "f64"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("clip", ["off", "active", "inactive"])
def test_linear_2d(prec, bias, clip):
    torch.manual_seed(0)
    dtype = PRECISIONS[prec][0]
    model = nn.Sequential(nn.Linear(5, 4, bias=bias)).to(dtype)
    damping, lr = 0.05, 0.3
    kl_clip = {"off": None, "active": 1e-5, "inactive": 1e6}[clip]
    pre = make_pre(model, prec, damping=damping, kl_clip=kl_clip, lr=lr, factor_decay=0.9)
    rec = Recorder(model, ["0"])
    x = torch.randn(7, 5, dtype=dtype)
    nu, _, refs = check_single_step(model, pre, rec, x, prec, damping, kl_clip, lr)
    assert refs["0"][0].shape == (5 + bias, 5 + bias)
    assert pre.layers["0"].A.shape == (5 + bias, 5 + bias)
    if clip == "active":
        assert nu < 0.5  # the clip path is really exercised
    else:
        assert nu == 1.0


# ----------------------------------------------------------------------------- 2. 3-D Linear


@pytest.mark.parametrize("prec", ["f32", "f64"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("contiguous", [True, False])
def test_linear_3d(prec, bias, contiguous):
    torch.manual_seed(1)
    dtype = PRECISIONS[prec][0]
    B, T, n_in = 3, 4, 5
    model = nn.Sequential(nn.Linear(n_in, 3, bias=bias)).to(dtype)
    damping, lr, kl_clip = 0.02, 0.1, 1e-4
    pre = make_pre(model, prec, damping=damping, kl_clip=kl_clip, lr=lr)
    rec = Recorder(model, ["0"])
    if contiguous:
        x = torch.randn(B, T, n_in, dtype=dtype)
    else:
        x = torch.randn(T, B, n_in, dtype=dtype).transpose(0, 1)
        assert not x.is_contiguous()
    assert x.shape == (B, T, n_in)
    nu, _, refs = check_single_step(model, pre, rec, x, prec, damping, kl_clip, lr)
    assert nu < 1.0
    # Every position is an example (expand): G = R * sum_r d_r d_r^T with R = B*T rows, so a
    # per-position mean loss gives G = mean_r (R d_r)(R d_r)^T whatever T is.
    d = d_rows(model[0], rec.gouts["0"][0])
    assert d.shape[0] == B * T
    assert_close(pre.layers["0"].G, B * T * d.T @ d, PRECISIONS[prec][3])


# ----------------------------------------------------------------------------- 3. Conv2d

CONV_CASES = {
    "s2p1-bias": dict(stride=2, padding=1, bias=True),
    "s2p1-nobias": dict(stride=2, padding=1, bias=False),
    "dil2-bias": dict(stride=1, padding=1, dilation=2, bias=True),
    "dil2-s2-nobias": dict(stride=2, padding=0, dilation=2, bias=False),
    "rect-kernel": dict(kernel_size=(2, 3), stride=(2, 1), padding=(1, 0), bias=True),
    "reflect-pad": dict(stride=1, padding=1, padding_mode="reflect", bias=True),
}


@pytest.mark.parametrize("prec", ["f32", "f64"])
@pytest.mark.parametrize("case", list(CONV_CASES))
def test_conv2d(prec, case):
    torch.manual_seed(2)
    dtype = PRECISIONS[prec][0]
    kw = {"kernel_size": 3, **CONV_CASES[case]}
    model = nn.Sequential(nn.Conv2d(2, 3, **kw)).to(dtype)
    kh, kwid = model[0].kernel_size
    damping, lr, kl_clip = 0.05, 0.1, 1e-4
    pre = make_pre(model, prec, damping=damping, kl_clip=kl_clip, lr=lr)
    rec = Recorder(model, ["0"])
    x = torch.randn(3, 2, 7, 6, dtype=dtype)
    nu, _, refs = check_single_step(model, pre, rec, x, prec, damping, kl_clip, lr)
    bias = CONV_CASES[case]["bias"]
    assert pre.layers["0"].A.shape == (2 * kh * kwid + bias,) * 2
    assert nu < 1.0
    # the loop im2col agrees with F.unfold (a second view of the rows; zero padding only)
    conv = model[0]
    if conv.padding_mode == "zeros":
        u = F.unfold(rec.inputs["0"][0].to(F64), conv.kernel_size, dilation=conv.dilation,
                     padding=conv.padding, stride=conv.stride)
        u = u.transpose(1, 2).reshape(-1, 2 * kh * kwid)
        loops = im2col_loops(rec.inputs["0"][0], conv)
        torch.testing.assert_close(loops, u, rtol=0, atol=0)


# ----------------------------------------------------------------------------- 4. several layers


def small_net(dtype, bias_last=True):
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, stride=2, padding=1),  # 2x6x6 -> 3x3x3
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(27, 6),
        nn.ReLU(),
        nn.Linear(6, 4, bias=bias_last),
    ).to(dtype)


@pytest.mark.parametrize("prec", ["f32", "f64"])
def test_multi_layer_global_kl_clip(prec):
    torch.manual_seed(3)
    dtype = PRECISIONS[prec][0]
    model = small_net(dtype, bias_last=False)
    names = layer_names(model)
    assert names == ["0", "3", "5"]
    damping, lr, kl_clip = 0.03, 0.2, 1e-4
    pre = make_pre(model, prec, damping=damping, kl_clip=kl_clip, lr=lr)
    assert set(pre.layers) == set(names)
    rec = Recorder(model, names)
    x = torch.randn(6, 2, 6, 6, dtype=dtype)
    target = torch.randint(0, 4, (6,))
    nu, grads, refs = check_single_step(
        model, pre, rec, x, prec, damping, kl_clip, lr, loss_fn=lambda out: F.cross_entropy(out, target)
    )
    assert nu < 1.0
    # The clip is global: per-layer clipping would give a measurably different scale.
    per_layer = []
    for n in names:
        _, nu_n = ref_precondition(
            [grads[n]], *([inv] for inv in damped_invs(*refs[n], damping)), kl_clip, lr
        )
        per_layer.append(nu_n)
    assert all(abs(nu_n - nu) > 1e-2 * nu for nu_n in per_layer)


# ----------------------------------------------------------------------------- 5. running averages, schedule


@pytest.mark.parametrize("prec", ["f32", "f64"])
@pytest.mark.parametrize("decay", [0.0, 0.7, "schedule"])
def test_running_average_and_inverse_steps(prec, decay):
    torch.manual_seed(4)
    dtype = PRECISIONS[prec][0]
    tol = PRECISIONS[prec][3]
    model = small_net(dtype)
    names = layer_names(model)
    if decay == "schedule":
        def decay_at(k):
            return 0.5 + 0.1 * k
        factor_decay = decay_at
    else:
        def decay_at(k):
            return decay
        factor_decay = decay

    def damping_at(k):
        return 0.02 * (k + 1)

    def lr_at(k):
        return 0.1 / (k + 1)

    kl_clip = 1e-4
    pre = make_pre(
        model, prec, damping=damping_at, factor_decay=factor_decay, kl_clip=kl_clip, lr=lr_at,
        inv_update_steps=2,
    )
    rec = Recorder(model, names)
    running: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    inv_src: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    inv_damping = None
    for k in range(3):
        x = torch.randn(4 + k, 2, 6, 6, dtype=dtype) * (1 + k)  # different batches, sizes, scales
        grads = run_step(model, pre, rec, [x], sq_loss)
        for n in names:
            A_new, G_new = ref_factors(rec, n)
            if k == 0:
                running[n] = (A_new, G_new)
            else:
                dcy = decay_at(k)
                A_old, G_old = running[n]
                running[n] = (dcy * A_old + (1 - dcy) * A_new, dcy * G_old + (1 - dcy) * G_new)
            assert_close(pre.layers[n].A, running[n][0], tol)
            assert_close(pre.layers[n].G, running[n][1], tol)
        if k % 2 == 0:  # inverse step
            inv_src = {n: (running[n][0].clone(), running[n][1].clone()) for n in names}
            inv_damping = damping_at(k)
        A_invs, G_invs = zip(*(damped_invs(*inv_src[n], inv_damping) for n in names))
        for n, Ai, Gi in zip(names, A_invs, G_invs, strict=True):
            assert_close(pre.layers[n].A_inv, Ai, tol)
            assert_close(pre.layers[n].G_inv, Gi, tol)
        if k == 1:
            # the inverses are stale: they must NOT match the current factors' inverses
            n = names[0]
            fresh = damped_invs(*running[n], damping_at(k))[0]
            assert not torch.allclose(pre.layers[n].A_inv.to(F64), fresh, rtol=1e-3, atol=1e-6)
        P, nu = ref_precondition([grads[n] for n in names], A_invs, G_invs, kl_clip, lr_at(k))
        assert nu < 1.0
        for n, p in zip(names, P, strict=True):
            assert_close(grad_matrix(rec.modules[n]), p, tol)
    assert pre.steps == 3


def test_factor_update_steps_freeze_factors():
    """On steps that are not factor steps the running factors stay as they were."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 3))
    pre = KFACPreconditioner(model, damping=0.1, factor_decay=0.5, kl_clip=None,
                             factor_update_steps=2, inv_update_steps=2, inv_dtype=F64)
    rec = Recorder(model, ["0"])
    run_step(model, pre, rec, [torch.randn(5, 4)], sq_loss)
    A0, G0 = ref_factors(rec, "0")
    grads = run_step(model, pre, rec, [torch.randn(5, 4) * 3], sq_loss)  # step 1: no factor update
    assert_close(pre.layers["0"].A, A0, 2e-5)
    assert_close(pre.layers["0"].G, G0, 2e-5)
    A0_inv, G0_inv = damped_invs(A0, G0, 0.1)
    P, _ = ref_precondition([grads["0"]], [A0_inv], [G0_inv], None, 0.1)
    assert_close(grad_matrix(model[0]), P[0], 2e-4)
    run_step(model, pre, rec, [torch.randn(5, 4)], sq_loss)  # step 2: update
    A2, G2 = ref_factors(rec, "0")
    assert_close(pre.layers["0"].A, 0.5 * A0 + 0.5 * A2, 2e-5)
    assert_close(pre.layers["0"].G, 0.5 * G0 + 0.5 * G2, 2e-5)


# ----------------------------------------------------------------------------- 6. undamped factors


@pytest.mark.parametrize("prec", ["f32", "f64"])
def test_stored_factors_are_undamped(prec):
    torch.manual_seed(6)
    dtype = PRECISIONS[prec][0]
    tol = PRECISIONS[prec][3]
    model = small_net(dtype)
    names = layer_names(model)
    damping = 0.5  # large, so A and A + damping*I are far apart
    pre = make_pre(model, prec, damping=damping, kl_clip=None, factor_decay=0.0)
    rec = Recorder(model, names)
    x = torch.randn(5, 2, 6, 6, dtype=dtype)
    run_step(model, pre, rec, [x], sq_loss)
    for n in names:
        A, G = ref_factors(rec, n)
        L = pre.layers[n]
        dA, dG = pi_dampings(A, G, damping)
        for got, ref, d in ((L.A, A, dA), (L.G, G, dG)):
            assert_close(got, ref, tol)
            damped = ref + d * torch.eye(ref.shape[0], dtype=F64)
            assert not torch.allclose(got.to(F64), damped, rtol=1e-3, atol=1e-3)
        eye_a = torch.eye(A.shape[0], dtype=F64)
        eye_g = torch.eye(G.shape[0], dtype=F64)
        assert_close((A + dA * eye_a) @ L.A_inv.to(F64), eye_a, 10 * tol)
        assert_close((G + dG * eye_g) @ L.G_inv.to(F64), eye_g, 10 * tol)
    # and a second (non-inverse) step does not leak damping into the factors either
    run_step(model, pre, rec, [x], sq_loss)
    for n in names:
        A, G = ref_factors(rec, n)
        assert_close(pre.layers[n].A, A, tol)
        assert_close(pre.layers[n].G, G, tol)


# ----------------------------------------------------------------------------- 7. accumulation


@pytest.mark.parametrize("prec", ["f32", "f64"])
def test_gradient_accumulation_matches_full_batch(prec):
    torch.manual_seed(7)
    dtype = PRECISIONS[prec][0]
    tol = PRECISIONS[prec][3]
    model = small_net(dtype)
    names = layer_names(model)
    x = torch.randn(16, 2, 6, 6, dtype=dtype)
    kw = dict(damping=0.05, kl_clip=1e-4, lr=0.1, factor_decay=0.9)

    # two micro-batches of 8, loss / 2 each
    pre = make_pre(model, prec, **kw)
    rec = Recorder(model, names)
    grads = run_step(model, pre, rec, [x[:8], x[8:]], sq_loss, scale=0.5)
    accum = {}
    for n in names:
        assert len(rec.inputs[n]) == 2 and len(rec.gouts[n]) == 2
        A, G = ref_factors(rec, n)  # mean over all rows; N=16 times sum of d d^T
        d = torch.cat([d_rows(rec.modules[n], g) for g in rec.gouts[n]])
        assert_close(G, 16 * d.T @ d, 1e-12)
        assert_close(pre.layers[n].A, A, tol)
        assert_close(pre.layers[n].G, G, tol)
        accum[n] = (pre.layers[n].A.clone(), pre.layers[n].G.clone(), grad_matrix(rec.modules[n]))
    A_invs, G_invs = zip(*(damped_invs(*ref_factors(rec, n), 0.05) for n in names))
    P, nu = ref_precondition([grads[n] for n in names], A_invs, G_invs, 1e-4, 0.1)
    assert nu < 1.0
    for n, p in zip(names, P, strict=True):
        assert_close(grad_matrix(rec.modules[n]), p, tol)
    rec.remove()
    pre.remove_hooks()

    # one batch of 16 with the mean loss gives the same factors and preconditioned grads
    pre16 = make_pre(model, prec, **kw)
    rec16 = Recorder(model, names)
    run_step(model, pre16, rec16, [x], sq_loss)
    for n in names:
        A16, G16 = ref_factors(rec16, n)
        assert_close(pre16.layers[n].A, A16, tol)
        assert_close(pre16.layers[n].G, G16, tol)
        assert_close(accum[n][0], pre16.layers[n].A, 10 * tol)
        assert_close(accum[n][1], pre16.layers[n].G, 10 * tol)
        assert_close(accum[n][2], grad_matrix(rec16.modules[n]), 10 * tol)


# ----------------------------------------------------------------------------- 8. shared layer


class SharedTwice(nn.Module):
    """The same Linear applied twice in one forward: its rows come from both calls, N = B."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2, bias=False)

    def forward(self, x):
        return self.head(self.lin(torch.tanh(self.lin(x))))


@pytest.mark.parametrize("prec", ["f32", "f64"])
def test_layer_called_twice_per_forward(prec):
    torch.manual_seed(8)
    dtype = PRECISIONS[prec][0]
    tol = PRECISIONS[prec][3]
    model = SharedTwice().to(dtype)
    damping, lr, kl_clip = 0.05, 0.1, 1e-4
    pre = make_pre(model, prec, damping=damping, kl_clip=kl_clip, lr=lr)
    rec = Recorder(model, ["lin", "head"])
    B = 6
    grads = run_step(model, pre, rec, [torch.randn(B, 4, dtype=dtype)], sq_loss)
    assert len(rec.inputs["lin"]) == 2 and len(rec.gouts["lin"]) == 2
    m = model.lin
    a = torch.cat([a_rows(m, x) for x in rec.inputs["lin"]])
    d = torch.cat([d_rows(m, g) for g in rec.gouts["lin"]])
    assert a.shape[0] == d.shape[0] == 2 * B
    # backward visits the calls in reverse order: pair call i's input with its own gradient
    d_paired = torch.cat([d_rows(m, g) for g in reversed(rec.gouts["lin"])])
    assert_close(d_paired.T @ a, grads["lin"], 1e-9 if prec == "f64" else 1e-4)
    A = a.T @ a / (2 * B)  # mean over all 2B rows
    G = B * (d.T @ d)  # (1/B) sum_r (B d_r)(B d_r)^T over all rows: B examples, not 2B
    assert_close(pre.layers["lin"].A, A, tol)
    assert_close(pre.layers["lin"].G, G, tol)
    A_h, G_h = ref_factors(rec, "head")
    assert_close(pre.layers["head"].A, A_h, tol)
    assert_close(pre.layers["head"].G, G_h, tol)
    P, nu = ref_precondition(
        [grads["lin"], grads["head"]],
        *zip(damped_invs(A, G, damping), damped_invs(A_h, G_h, damping)),
        kl_clip, lr,
    )
    assert nu < 1.0
    assert_close(grad_matrix(model.lin), P[0], tol)
    assert_close(grad_matrix(model.head), P[1], tol)
