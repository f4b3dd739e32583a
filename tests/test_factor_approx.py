"""``factor_approx="reduce"`` (K-FAC-reduce) against dense float64 references built here.

The references are computed from the raw layer inputs and output gradients captured by the tests'
own hooks (``helpers.dense_reference.Recorder``), with ``F.unfold`` for the Conv2d patches (checked
against the layer's own output), never with the helpers under test. Spec (docs/math.md):

    a_n = mean over the positions r of example n of a_{n,r}   (bias entry 1)
    g_n = sum over the positions r of example n of d_{n,r}
    A_new = (1/N) sum_n a_n a_n^T,     G_new = N sum_n g_n g_n^T

where a Conv2d's positions are its output locations and a Linear's the dims between the first and
the last of its input; "expand" (the default) is unchanged, and both agree on 2-D Linear inputs.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers.dense_reference import F64, Recorder, assert_close, damped_invs, grad_matrix
from torch import nn

from lightning_spdkfac import KFAC, KFACPreconditioner
from lightning_spdkfac.kfac.distributor import Distributor
from lightning_spdkfac.kfac.options import KFACOptions
from lightning_spdkfac.vocabulary import FACTOR_APPROXES

# ----------------------------------------------------------------------------- the reference


def conv_columns(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """Patches ``(B, C*kh*kw, Ho*Wo)`` by ``F.unfold`` in float64 (zeros, reflect or circular padding)."""
    x = x.to(F64)
    if x.dim() == 3:
        x = x.unsqueeze(0)
    dh, dw = conv.dilation
    if conv.padding == "same":  # odd kernels: symmetric
        kh, kw = conv.kernel_size
        ph, pw = dh * (kh - 1) // 2, dw * (kw - 1) // 2
    elif conv.padding == "valid":
        ph, pw = 0, 0
    else:
        ph, pw = conv.padding
    if conv.padding_mode != "zeros":
        x = F.pad(x, (pw, pw, ph, ph), mode=conv.padding_mode)
        ph, pw = 0, 0
    return F.unfold(x, conv.kernel_size, dilation=conv.dilation, padding=(ph, pw), stride=conv.stride)


def ref_a(module: nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Reduced input rows (N, in [+1]): the mean over each example's positions."""
    w = module.weight.detach().to(F64).reshape(module.weight.shape[0], -1)
    b = module.bias.detach().to(F64) if module.bias is not None else None
    if isinstance(module, nn.Conv2d):
        cols = conv_columns(module, x)  # (N, in, L)
        # the patches really are what the layer multiplied: rebuild its output from them
        y = torch.einsum("oi,nil->nol", w, cols) + (0 if b is None else b[None, :, None])
        want = out.to(F64).reshape(y.shape)
        tol = 1e-5 if out.dtype in (torch.float32, F64) else 2e-2  # bf16 outputs: their own rounding
        torch.testing.assert_close(y, want, rtol=tol, atol=tol)
        a = cols.mean(-1)
    else:
        x = x.to(F64)
        n = 1 if x.dim() == 1 else x.shape[0]
        a = x.reshape(n, -1, x.shape[-1]).mean(1)
    if b is not None:
        a = torch.cat([a, torch.ones(a.shape[0], 1, dtype=F64)], dim=1)
    return a


def ref_g(module: nn.Module, go: torch.Tensor) -> torch.Tensor:
    """Reduced output-gradient rows (N, out): the sum over each example's positions."""
    go = go.to(F64)
    if isinstance(module, nn.Conv2d):
        if go.dim() == 3:
            go = go.unsqueeze(0)
        return go.sum((2, 3))
    n = 1 if go.dim() == 1 else go.shape[0]
    return go.reshape(n, -1, go.shape[-1]).sum(1)


def ref_reduce_factors(rec: Recorder, name: str, examples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A and G of one step from every captured call; ``examples``: N of the step (calls share them)."""
    m = rec.modules[name]
    a = torch.cat([ref_a(m, x, o) for x, o in zip(rec.inputs[name], rec.outputs[name], strict=True)])
    g = torch.cat([ref_g(m, go) for go in rec.gouts[name]])
    return a.T @ a / a.shape[0], examples * (g.T @ g)


# ----------------------------------------------------------------------------- models


class Net(nn.Module):
    """Conv2d -> tokens -> Linear on (B, T, in) -> mean over tokens -> Linear on (B, in)."""

    def __init__(self, bias: bool = True, stride: int = 1):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1, stride=stride, bias=bias)
        self.tok = nn.Linear(4, 5, bias=bias)
        self.head = nn.Linear(5, 3, bias=bias)

    def forward(self, x):
        h = torch.relu(self.conv(x))
        h = h.flatten(2).transpose(1, 2)  # (B, Ho*Wo, 4): a non-contiguous 3-D input
        h = torch.tanh(self.tok(h)).mean(1)
        return self.head(h)


def sq_loss(out):
    return (0.5 * out.pow(2) + 0.1 * out).sum(dim=-1).mean()  # a mean over examples


COUNTS: dict[str, tuple[int, int]] = {}  # layer -> (A rows, examples) of the last one_step, before step()


def one_step(model, pre, xs, loss_fn=sq_loss):
    """Micro-batches ``xs`` (each loss divided by their number), then ``pre.step()``; grads before it."""
    model.zero_grad(set_to_none=True)
    for x in xs:
        (loss_fn(model(x)) / len(xs)).backward()
    before = {n: grad_matrix(m) for n, m in model.named_modules() if isinstance(m, nn.Linear | nn.Conv2d)}
    COUNTS.clear()
    COUNTS.update({n: (ly.rows, ly.examples) for n, ly in pre.layers.items()})
    pre.step()
    return before


# ----------------------------------------------------------------------------- Conv2d


CONVS = {
    "k3 s1 p1": dict(kernel_size=3, stride=1, padding=1),
    "k3 s2 p0": dict(kernel_size=3, stride=2, padding=0),
    "k3 s2 p1": dict(kernel_size=3, stride=2, padding=1),
    "k5 s3 p2": dict(kernel_size=5, stride=3, padding=2),
    "k(2,3) s(2,1) p(1,0)": dict(kernel_size=(2, 3), stride=(2, 1), padding=(1, 0)),
    "k1 s1 p0": dict(kernel_size=1, stride=1, padding=0),
    "k3 dil2 p2": dict(kernel_size=3, dilation=2, padding=2),
    "k3 same": dict(kernel_size=3, padding="same"),
    "k3 valid s2": dict(kernel_size=3, padding="valid", stride=2),
    "k3 reflect": dict(kernel_size=3, padding=1, padding_mode="reflect"),
    "k3 circular s2": dict(kernel_size=3, padding=2, stride=2, padding_mode="circular"),
}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("conv", list(CONVS))
def test_conv2d_reduce_factors_and_step_equal_the_dense_reference(conv, bias):
    torch.manual_seed(0)
    layer = nn.Conv2d(3, 4, bias=bias, **CONVS[conv]).to(F64)
    model = nn.Sequential(layer)
    damping = 0.03
    pre = KFACPreconditioner(model, factor_approx="reduce", factor_dtype=F64, inv_dtype=F64,
                             damping=damping, kl_clip=None)
    rec = Recorder(model, ["0"])
    x = torch.randn(5, 3, 9, 8, dtype=F64)
    before = one_step(model, pre, [x])
    A, G = ref_reduce_factors(rec, "0", examples=5)
    L = pre.layers["0"]
    assert COUNTS["0"] == (5, 5)  # one A row per example
    assert_close(L.A, A, 1e-10)
    assert_close(L.G, G, 1e-10)
    assert L.A.shape == (3 * layer.kernel_size[0] * layer.kernel_size[1] + bias,) * 2
    # the preconditioned gradient uses them: P = (G + damping I)^-1 [dW, db] (A + damping I)^-1
    A_inv, G_inv = damped_invs(A, G, damping)
    P = G_inv @ before["0"] @ A_inv
    assert_close(grad_matrix(layer), P, 1e-9)


def test_conv2d_reduce_in_float32_and_unbatched_input():
    torch.manual_seed(1)
    layer = nn.Conv2d(3, 6, 3, stride=2, padding=1)
    model = nn.Sequential(layer)
    pre = KFACPreconditioner(model, factor_approx="reduce", lr=0.1)
    rec = Recorder(model, ["0"])
    one_step(model, pre, [torch.randn(4, 3, 10, 10)])
    A, G = ref_reduce_factors(rec, "0", examples=4)
    assert pre.layers["0"].A.dtype == torch.float32
    assert_close(pre.layers["0"].A, A, 1e-5)
    assert_close(pre.layers["0"].G, G, 1e-5)
    # (C, H, W) is one example: one row
    rec.clear()
    one_step(model, pre := KFACPreconditioner(model, factor_approx="reduce", lr=0.1), [torch.randn(3, 10, 10)])
    A, G = ref_reduce_factors(rec, "0", examples=1)
    assert COUNTS["0"] == (1, 1)
    assert_close(pre.layers["0"].A, A, 1e-5)
    assert_close(pre.layers["0"].G, G, 1e-5)


def test_conv2d_reduce_with_half_precision_inputs_accumulates_in_factor_dtype():
    torch.manual_seed(2)
    layer = nn.Conv2d(3, 4, 3, padding=1).to(torch.bfloat16)
    pre = KFACPreconditioner(nn.Sequential(layer), factor_approx="reduce", lr=0.1)
    rec = Recorder(pre.model, ["0"])
    x = torch.randn(4, 3, 16, 16).to(torch.bfloat16)
    pre.model(x).float().pow(2).mean().backward()
    pre.step()
    A, G = ref_reduce_factors(rec, "0", examples=4)
    assert pre.layers["0"].A.dtype == torch.float32
    # the factors are taken in float32 from bf16 values: only the captured values' rounding is shared
    assert_close(pre.layers["0"].A, A, 1e-5)
    assert_close(pre.layers["0"].G, G, 1e-5)


# ----------------------------------------------------------------------------- Linear


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", ["BTD", "BTD-noncontiguous", "BHWD"])
def test_linear_reduce_on_inputs_with_positions(shape, bias):
    torch.manual_seed(3)
    layer = nn.Linear(6, 4, bias=bias).to(F64)
    model = nn.Sequential(layer)
    damping = 0.02
    pre = KFACPreconditioner(model, factor_approx="reduce", factor_dtype=F64, inv_dtype=F64,
                             damping=damping, kl_clip=None)
    rec = Recorder(model, ["0"])
    x = {"BTD": lambda: torch.randn(5, 7, 6, dtype=F64),
         "BTD-noncontiguous": lambda: torch.randn(7, 5, 6, dtype=F64).transpose(0, 1),
         "BHWD": lambda: torch.randn(5, 3, 2, 6, dtype=F64)}[shape]()
    before = one_step(model, pre, [x])
    A, G = ref_reduce_factors(rec, "0", examples=5)
    assert COUNTS["0"] == (5, 5)
    assert_close(pre.layers["0"].A, A, 1e-10)
    assert_close(pre.layers["0"].G, G, 1e-10)
    A_inv, G_inv = damped_invs(A, G, damping)
    P = G_inv @ before["0"] @ A_inv
    assert_close(grad_matrix(layer), P, 1e-9)


@pytest.mark.parametrize("x_shape", [(7, 6), (6,)])
def test_reduce_equals_expand_bit_for_bit_on_2d_linear_inputs(x_shape):
    def run(approx):
        torch.manual_seed(4)
        model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3, bias=False))
        pre = KFACPreconditioner(model, factor_approx=approx, factor_update_steps=1, inv_update_steps=1, lr=0.1)
        g = torch.Generator().manual_seed(5)
        for _ in range(3):
            one_step(model, pre, [torch.randn(*x_shape, generator=g)])
        return model, pre

    m_e, p_e = run("expand")
    m_r, p_r = run("reduce")
    for name, layer in p_e.layers.items():
        for f in ("A", "G", "A_inv", "G_inv"):
            assert torch.equal(getattr(p_r.layers[name], f), getattr(layer, f)), (name, f)
    for a, b in zip(m_e.parameters(), m_r.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_auto_is_the_default_reduce_for_conv_expand_for_linear_and_the_approximations_differ():
    counts = {}

    def run(**kw):
        torch.manual_seed(6)
        model = Net()
        pre = KFACPreconditioner(model, kl_clip=None, **kw)  # no KL clip: it couples the layers
        one_step(model, pre, [torch.randn(4, 2, 5, 5, generator=torch.Generator().manual_seed(7))])
        counts[kw.get("factor_approx")] = dict(COUNTS)
        return pre, {n: grad_matrix(m) for n, m in model.named_children()}  # preconditioned

    (default, g_default), (auto, _), (expand, g_expand), (reduce, g_reduce) = (
        run(), run(factor_approx="auto"), run(factor_approx="expand"), run(factor_approx="reduce"))
    assert default.options.factor_approx == "auto" and KFACOptions().factor_approx == "auto"
    assert counts["expand"] == {"conv": (100, 4), "tok": (100, 100), "head": (4, 4)}
    assert counts["reduce"] == {"conv": (4, 4), "tok": (4, 4), "head": (4, 4)}
    assert counts["auto"] == {"conv": (4, 4), "tok": (100, 100), "head": (4, 4)} == counts[None]
    # auto is reduce on the Conv2d and expand on the Linear layers, bit for bit
    same_as = {"conv": reduce, "tok": expand, "head": expand}
    for name, layer in default.layers.items():
        for f in ("A", "G", "A_inv", "G_inv"):
            assert torch.equal(getattr(same_as[name].layers[name], f), getattr(layer, f)), (name, f)
            assert torch.equal(getattr(auto.layers[name], f), getattr(layer, f)), (name, f)
    assert torch.equal(g_default["conv"], g_reduce["conv"]) and torch.equal(g_default["tok"], g_expand["tok"])
    assert not torch.allclose(g_reduce["conv"], g_expand["conv"])
    for name in ("conv", "tok"):  # weight sharing: the approximations differ
        assert not torch.allclose(reduce.layers[name].A, expand.layers[name].A)
    assert torch.equal(reduce.layers["head"].A, expand.layers["head"].A)  # a 2-D input: identical


# ----------------------------------------------------------------------------- several calls, accumulation


def test_several_calls_per_forward_each_reduce_their_own_positions():
    torch.manual_seed(8)
    lin = nn.Linear(4, 4).to(F64)
    model = nn.Sequential(lin)
    pre = KFACPreconditioner(model, factor_approx="reduce", factor_dtype=F64, inv_dtype=F64, lr=0.1)
    rec = Recorder(model, ["0"])
    x = torch.randn(3, 5, 4, dtype=F64)
    lin.zero_grad()
    sq_loss(lin(torch.tanh(lin(x)))).backward()
    assert (pre.layers["0"].rows, pre.layers["0"].examples) == (6, 3)  # 2 calls x 3 example rows; N = 3 once
    pre.step()
    assert len(rec.inputs["0"]) == 2
    A, G = ref_reduce_factors(rec, "0", examples=3)
    assert_close(pre.layers["0"].A, A, 1e-10)
    assert_close(pre.layers["0"].G, G, 1e-10)


@pytest.mark.parametrize("stride", [1, 2])
def test_reduce_accumulation_over_two_micro_batches_equals_the_larger_batch(stride):
    x = torch.randn(8, 2, 6, 6, dtype=F64, generator=torch.Generator().manual_seed(9))

    def run(xs):
        torch.manual_seed(10)
        model = Net(stride=stride).to(F64)
        pre = KFACPreconditioner(model, factor_approx="reduce", factor_dtype=F64, inv_dtype=F64, lr=0.1)
        rec = Recorder(model, ["conv", "tok", "head"])
        one_step(model, pre, xs)
        return model, pre, rec

    m_big, p_big, rec = run([x])
    m_acc, p_acc, rec_acc = run([x[:4], x[4:]])
    assert COUNTS == {"conv": (8, 8), "tok": (8, 8), "head": (8, 8)}
    for name in ("conv", "tok", "head"):
        A, G = ref_reduce_factors(rec_acc, name, examples=8)
        assert_close(p_acc.layers[name].A, A, 1e-10)
        assert_close(p_acc.layers[name].G, G, 1e-10)
        assert_close(p_acc.layers[name].A, p_big.layers[name].A, 1e-10)
        assert_close(p_acc.layers[name].G, p_big.layers[name].G, 1e-10)
    for a, b in zip(m_big.parameters(), m_acc.parameters(), strict=True):
        assert_close(b.grad, a.grad, 1e-9)


# ----------------------------------------------------------------------------- fp16 scale, non-finite, pipelining


def test_reduce_removes_the_grad_scaler_scale_from_g():
    x = torch.randn(6, 2, 5, 5, generator=torch.Generator().manual_seed(11))

    def run(scaler):
        torch.manual_seed(12)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        pre = KFACPreconditioner(model, factor_approx="reduce", grad_scaler=scaler, lr=0.1)
        loss = sq_loss(model(x))
        (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is not None:
            scaler.unscale_(opt)
        pre.step()
        return model, pre

    m_ref, p_ref = run(None)
    m_sc, p_sc = run(torch.amp.GradScaler("cpu", init_scale=2.0**10))
    for name, layer in p_ref.layers.items():
        torch.testing.assert_close(p_sc.layers[name].G, layer.G, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(p_sc.layers[name].A, layer.A, rtol=1e-6, atol=1e-7)
    for a, b in zip(m_ref.parameters(), m_sc.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7)


def test_a_non_finite_position_skips_the_reduce_factor_update():
    torch.manual_seed(13)
    model = Net()
    pre = KFACPreconditioner(model, factor_approx="reduce", max_bad_steps=None, factor_update_steps=1, lr=0.1)
    x = torch.randn(4, 2, 5, 5)
    one_step(model, pre, [x])
    before = {n: (ly.A.clone(), ly.G.clone()) for n, ly in pre.layers.items()}
    bad = x.clone()
    bad[1, 0, 2, 3] = float("nan")  # one position of one example
    one_step(model, pre, [bad])
    assert pre.skipped_factor_steps == 1
    for n, ly in pre.layers.items():
        assert torch.equal(ly.A, before[n][0]) and torch.equal(ly.G, before[n][1])


class Echo(Distributor):
    """A one-rank 'distributed' schedule that takes factors from the hooks when pipelined."""

    def __init__(self, pipelined: bool):
        self.pipelined = pipelined
        self.held: dict = {}
        self.finals = 0

    def begin_step(self, step):
        self.held = {}

    def factor_final(self, index, which, matrix):
        self.finals += 1
        self.held[(index, which)] = matrix

    def reduce_factors(self, local):
        return {**self.held, **local}


@pytest.mark.parametrize("pipelined", [False, True])
def test_reduce_through_the_distributed_and_pipelined_paths_equals_the_local_path(pipelined):
    def train(distributor):
        torch.manual_seed(14)
        model = Net(stride=2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        pre = KFACPreconditioner(model, factor_approx="reduce", factor_update_steps=1, inv_update_steps=2,
                                 distributor=distributor, lr=0.1)
        g = torch.Generator().manual_seed(15)
        for _ in range(3):
            opt.zero_grad()
            for j in range(2):
                pre.final_micro_batch = j == 1
                (sq_loss(model(torch.randn(4, 2, 6, 6, generator=g))) / 2).backward()
            pre.step()
            opt.step()
        return model, pre

    ref, p_ref = train(None)
    echo = Echo(pipelined)
    got, p_got = train(echo)
    for a, b in zip(ref.parameters(), got.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    for name, layer in p_ref.layers.items():
        torch.testing.assert_close(p_got.layers[name].A, layer.A, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(p_got.layers[name].G, layer.G, rtol=1e-5, atol=1e-7)
    assert echo.finals == (2 * 3 * 2 if pipelined else 0)  # steps 1 and 2: 3 layers x (A, G) from the hooks


# ----------------------------------------------------------------------------- training, options


def test_one_reduce_step_trains():
    torch.manual_seed(16)
    model = Net(stride=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    pre = KFACPreconditioner(model, factor_approx="reduce", damping=0.01, lr=0.1)
    x = torch.randn(8, 2, 6, 6)
    y = torch.randint(0, 3, (8,))
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        raw = {n: p.grad.clone() for n, p in model.named_parameters()}
        pre.step()
        for n, p in model.named_parameters():
            assert torch.isfinite(p.grad).all(), n
            assert not torch.allclose(p.grad, raw[n]), n  # preconditioned
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert pre.skipped_factor_steps == 0 and pre.inverse_fallbacks == 0


def test_factor_approx_is_validated_and_reaches_the_preconditioner():
    assert FACTOR_APPROXES == ("auto", "expand", "reduce")
    with pytest.raises(ValueError, match=r"factor_approx must be one of 'auto', 'expand', 'reduce', got 'x'"):
        KFACOptions(factor_approx="x")
    with pytest.raises(TypeError, match=r"factor_approx must be one of 'auto', 'expand', 'reduce', got int 1"):
        KFACOptions(factor_approx=1)
    with pytest.raises(TypeError, match=r"factor_approx .*got None"):
        KFACOptions(factor_approx=None)
    with pytest.raises(ValueError, match=r"factor_approx must be one of 'auto', 'expand', 'reduce', got 'Reduce'"):
        KFAC(factor_approx="Reduce")
    with pytest.raises(ValueError, match=r"factor_approx"):
        KFACPreconditioner(nn.Linear(2, 2), factor_approx="kfc", lr=0.1)
    assert KFAC(factor_approx="reduce").options.factor_approx == "reduce"
    assert KFAC().options.factor_approx == "auto"
    pre = KFACPreconditioner(nn.Linear(2, 2), KFACOptions(factor_approx="reduce"), lr=0.1)
    assert pre.options.factor_approx == "reduce" and all(ly.reduce for ly in pre.layers.values())


def test_a_state_of_the_other_approximation_loads_with_a_warning_never_silently():
    torch.manual_seed(0)
    x = torch.randn(4, 2, 6, 6)
    reduce_model = Net()
    pre_reduce = KFACPreconditioner(reduce_model, factor_approx="reduce", inv_update_steps=1, lr=0.1)
    one_step(reduce_model, pre_reduce, [x])
    state = pre_reduce.state_dict()
    assert state["factor_approx"] == "reduce"
    expand = KFACPreconditioner(Net(), factor_approx="expand", inv_update_steps=1, lr=0.1)
    with pytest.warns(UserWarning, match=r"saved with factor_approx='reduce' and this run uses 'expand'"):
        expand.load_state_dict(state)
    assert torch.equal(expand.layers["conv"].A, pre_reduce.layers["conv"].A)  # loaded all the same
    same = KFACPreconditioner(Net(), factor_approx="reduce", inv_update_steps=1, lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same.load_state_dict(state)  # same approximation: silent
        older = {k: v for k, v in state.items() if k != "factor_approx"}
        same.load_state_dict(older)  # states written before the key existed: silent
    with pytest.raises(ValueError, match=r"'factor_approx' must be one of \('auto', 'expand', 'reduce'\), got 'mean'"):
        same.load_state_dict({**state, "factor_approx": "mean"})
