"""Function capture (kfac/capture.py): a layer whose weight is used through F.linear, matmul or a functional
convolution gets the factors a module call would have given it.

The references are twins of the same weights that call their layers as modules (the module-hook path, itself checked
against dense matrices in tests/test_reference.py), and dense matrices computed here for the transposed use."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_spdkfac.kfac.capture import TRANSPOSED_USE
from lightning_spdkfac.kfac.coverage import CAPTURE_MISSED
from lightning_spdkfac.kfac.preconditioner import KFACPreconditioner

KW = dict(lr=0.1, factor_update_steps=1, inv_update_steps=1, damping=1e-2)


class Block(nn.Module):
    """Three ways of using a linear layer's weight without calling it, as torchvision's Swin, timm's EVA and Mamba do;
    ``functional=False`` is the twin that calls the modules."""

    def __init__(self, functional: bool) -> None:
        super().__init__()
        self.functional = functional
        self.qkv = nn.Linear(8, 24)
        self.proj = nn.Linear(8, 8)
        self.dt = nn.Linear(5, 8, bias=False)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: B x T x 8
        if self.functional:
            q, k, v = F.linear(x, weight=self.qkv.weight, bias=self.qkv.bias).chunk(3, -1)
        else:
            q, k, v = self.qkv(x).chunk(3, -1)
        h = torch.softmax(q @ k.transpose(-1, -2), -1) @ v
        h = h @ self.proj.weight.T + self.proj.bias if self.functional else self.proj(h)
        u = x[..., :5]
        if self.functional:  # Mamba's dt_proj.weight @ x: the weight on the left, the inputs as columns
            d = (self.dt.weight @ u.transpose(-1, -2)).transpose(-1, -2)
        else:
            d = self.dt(u)
        return self.head(torch.tanh(h + d)).mean(1)


def _pair(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    fun, mod = Block(True), Block(False)
    mod.load_state_dict(fun.state_dict())
    return fun, mod


def _steps(model: nn.Module, pre: KFACPreconditioner, steps: int) -> list[str]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for step in range(steps):
            g = torch.Generator().manual_seed(100 + step)
            x, y = torch.randn(4, 6, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            pre.step(opt)
            opt.step()
    return [str(w.message) for w in record if "K-FAC" in str(w.message)]


@pytest.mark.parametrize("capture", [True, "auto"])
def test_functional_uses_get_the_factors_and_updates_of_module_calls(capture: bool | str) -> None:
    """capture=True follows every layer; "auto" follows every layer during the first factor step and keeps those a
    function used: the same factors and updates as the module twin from the first step, and no warning."""
    fun, mod = _pair()
    pre_f = KFACPreconditioner(fun, capture=capture, **KW)
    pre_m = KFACPreconditioner(mod, **KW)
    assert _steps(fun, pre_f, 3) == [] and _steps(mod, pre_m, 3) == []
    for name in ("qkv", "proj", "dt", "head"):
        a, b = pre_f.layers[name], pre_m.layers[name]
        torch.testing.assert_close(a.A, b.A, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(a.G, b.G, rtol=1e-5, atol=1e-6, msg=name)
    for p, q in zip(fun.parameters(), mod.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert pre_f.capture.calls == 3 * 3  # qkv, proj and dt in each of the three forwards
    assert not pre_f.unfactored
    if capture == "auto":  # "head" is called as a module only: no longer followed after the first factor step
        assert set(pre_f.capture.layers) == {"qkv", "proj", "dt"}
        assert not pre_m.capture.layers and not pre_m.capture._handles  # the twin needs none: nothing left on it


def test_a_use_that_starts_later_is_named_once_then_followed() -> None:
    """A functional use the first factor step did not see (a branch taken later) is found by the coverage check:
    named once, followed from the next factor step."""

    class Later(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 6)
            self.head = nn.Linear(6, 2)
            self.functional = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = F.linear(x, self.lin.weight, self.lin.bias) if self.functional else self.lin(x)
            return self.head(torch.tanh(h))

    model = Later()
    pre = KFACPreconditioner(model, **KW)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    msgs = []
    for step in range(4):
        model.functional = step >= 1
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            opt.zero_grad()
            F.cross_entropy(model(torch.randn(5, 6)), torch.randint(0, 2, (5,))).backward()
            pre.step(opt)
            opt.step()
        msgs.append([str(w.message) for w in record if "'lin'" in str(w.message)])
        if step == 1:
            A1 = pre.layers["lin"].A.clone()
    assert msgs[0] == [] and len(msgs[1]) == 1 and "from the next factor step" in msgs[1][0] and msgs[2:] == [[], []]
    assert not torch.equal(pre.layers["lin"].A, A1)  # followed from step 2 on
    assert not pre.unfactored and set(pre.capture.layers) == {"lin"}


def test_a_model_that_needs_no_capture_runs_without_it_after_the_first_step() -> None:
    _, mod = _pair()
    pre = KFACPreconditioner(mod, **KW)
    _steps(mod, pre, 1)  # the first factor step follows every layer (capture="auto")
    assert not pre.capture.layers and not pre.capture._handles and not pre.capture._busy_handles
    entered = []
    pre.capture._enter = lambda *a: entered.append(1)  # type: ignore[method-assign]
    _steps(mod, pre, 2)
    assert not entered and pre.capture.calls == 0
    pre_off = KFACPreconditioner(Block(False), capture=False, **KW)
    assert not pre_off.capture.layers and not pre_off.capture._handles  # capture=False: not even the first step


def test_a_weight_used_by_a_module_call_and_a_function_counts_both_calls_once() -> None:
    """``enc`` is called as a module and its weight used again through F.linear: two calls of one layer, as two module
    calls would be (the F.linear inside the module's own forward is not counted again)."""

    class Shared(nn.Module):
        def __init__(self, functional: bool) -> None:
            super().__init__()
            self.functional = functional
            self.enc = nn.Linear(6, 6)
            self.head = nn.Linear(6, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.enc(x))
            h = F.linear(h, self.enc.weight, self.enc.bias) if self.functional else self.enc(h)
            return self.head(h)

    torch.manual_seed(3)
    fun, mod = Shared(True), Shared(False)
    mod.load_state_dict(fun.state_dict())
    pre_f, pre_m = KFACPreconditioner(fun, capture=True, **KW), KFACPreconditioner(mod, **KW)
    for model, pre in ((fun, pre_f), (mod, pre_m)):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            opt.zero_grad()
            F.cross_entropy(model(torch.randn(5, 6, generator=g)), torch.randint(0, 2, (5,), generator=g)).backward()
            pre.step(opt)
            opt.step()
    for name in ("enc", "head"):
        torch.testing.assert_close(pre_f.layers[name].A, pre_m.layers[name].A)
        torch.testing.assert_close(pre_f.layers[name].G, pre_m.layers[name].G)
    assert pre_f.capture.calls == 2  # one functional call per step; the module call's own F.linear not counted


def test_a_transposed_use_is_refused_by_name_with_its_reason() -> None:
    """``x @ lin.weight`` on a square Linear is the map x W, not the layer's x W^T: not followed, named."""

    class Transposed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 6, bias=False)
            self.head = nn.Linear(6, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(x @ self.lin.weight))

    model = Transposed()
    pre = KFACPreconditioner(model, **KW)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            opt.zero_grad()
            F.cross_entropy(model(torch.randn(5, 6)), torch.randint(0, 2, (5,))).backward()
            pre.step(opt)
            opt.step()
    msgs = [str(w.message) for w in record if "'lin'" in str(w.message)]
    assert len(msgs) == 1 and TRANSPOSED_USE in msgs[0], msgs  # found by the first factor step, named once
    assert pre.layers["lin"].A is None and pre.unfactored["lin"] == TRANSPOSED_USE
    left = {x.name: x.reason for x in pre.summary().left_out}
    assert left["lin.weight"] == TRANSPOSED_USE


def test_an_opaque_function_is_named_as_not_followed() -> None:
    """A weight handed to a custom autograd Function (a fused kernel): capture sees no call it can read."""

    class Fused(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):  # type: ignore[no-untyped-def, override]
            ctx.save_for_backward(x, w)
            return x @ w.T

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def, override]
            x, w = ctx.saved_tensors
            return g @ w, g.T @ x

    class Opaque(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 4, bias=False)
            self.head = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(Fused.apply(x, self.lin.weight)))

    model = Opaque()
    pre = KFACPreconditioner(model, **KW)
    for _ in range(3):
        model.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            F.cross_entropy(model(torch.randn(5, 6)), torch.randint(0, 2, (5,))).backward()
            pre.step()
    assert pre.unfactored["lin"] == CAPTURE_MISSED
    assert "lin (no factors)" in str(pre.summary())


def test_a_functional_convolution_with_the_modules_geometry_is_followed() -> None:
    class Conv(nn.Module):
        def __init__(self, functional: bool, stride: int = 1) -> None:
            super().__init__()
            self.functional, self.stride = functional, stride
            self.conv = nn.Conv2d(2, 3, 3, padding=1)
            self.head = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.functional:
                h = F.conv2d(x, self.conv.weight, self.conv.bias, self.stride, 1)
            else:
                h = self.conv(x)
            return self.head(torch.tanh(h).mean((2, 3)))

    torch.manual_seed(0)
    fun, mod = Conv(True), Conv(False)
    mod.load_state_dict(fun.state_dict())
    pres, x = [], torch.randn(3, 2, 5, 5)
    for model in (fun, mod):
        pre = KFACPreconditioner(model, capture=True, **KW)
        model.zero_grad()
        F.cross_entropy(model(x), torch.tensor([0, 1, 1])).backward()
        pre.step()
        pres.append(pre)
    torch.testing.assert_close(pres[0].layers["conv"].A, pres[1].layers["conv"].A)
    torch.testing.assert_close(pres[0].layers["conv"].G, pres[1].layers["conv"].G)
    strided = Conv(True, stride=2)
    pre = KFACPreconditioner(strided, capture=True, **KW)
    F.cross_entropy(strided(torch.randn(3, 2, 5, 5)), torch.tensor([0, 1, 1])).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pre.step()
    assert "stride=(2, 2)" in pre.unfactored["conv"] and "stride=(1, 1)" in pre.unfactored["conv"]


def test_the_capture_option_is_checked() -> None:
    with pytest.raises(ValueError, match="capture must be 'auto'"):
        KFACPreconditioner(nn.Linear(2, 2), capture="always")


def test_the_dense_factors_of_a_left_matmul() -> None:
    """``W @ X`` (Mamba's dt_proj): A from X's columns, G from the output's columns, against dense sums."""

    class Left(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 3, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: B x 4 x L
            return self.lin.weight @ x

    torch.manual_seed(0)
    model = Left()
    pre = KFACPreconditioner(model, capture=True, factor_update_steps=1, inv_update_steps=1, lr=0.1)
    x = torch.randn(2, 4, 5)
    out = model(x)
    out.retain_grad()
    (out.square().sum() * 0.5).backward()
    pre_grad = model.lin.weight.grad.clone()
    pre.step()
    rows = x.transpose(1, 2).reshape(-1, 4).double()
    d = out.grad.transpose(1, 2).reshape(-1, 3).double()
    A = rows.T @ rows / rows.shape[0]
    G = d.T @ d * rows.shape[0]  # every column is an example (expand): N = B x L
    torch.testing.assert_close(pre.layers["lin"].A.double(), A, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pre.layers["lin"].G.double(), G, rtol=1e-5, atol=1e-6)
    assert not torch.equal(model.lin.weight.grad, pre_grad)  # preconditioned
