"""Grouped and depthwise convolutions: one exact Kronecker block per group, held as one batched factor, against
K-FAC of the same convolution written as ``groups`` separate convolutions (each checked by its own dense float64
reference); convolutions whose forward pads by itself; empty batches on every layer type."""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_spdkfac.kfac.preconditioner import KFACPreconditioner
from tests.helpers.dense_reference import F64, assert_close, damped_invs


def _rows(x: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    """Patch rows (B*P, C*k*k) by F.unfold of the input padded as the conv pads (zeros), plus the bias column."""
    cols = F.unfold(x, conv.kernel_size, dilation=conv.dilation, padding=conv.padding, stride=conv.stride)
    rows = cols.transpose(1, 2).reshape(-1, cols.shape[1])
    return torch.cat([rows, torch.ones(rows.shape[0], 1, dtype=F64)], 1) if conv.bias is not None else rows


def _reference(conv: nn.Conv2d, x: torch.Tensor, gout: torch.Tensor, reduce: bool, damping: float) -> torch.Tensor:
    """The preconditioned weight gradient (out, in/groups, k, k) of a grouped conv, group by group."""
    b = conv.groups
    cin, cout = conv.in_channels // b, conv.out_channels // b
    B = x.shape[0]
    out = []
    for j in range(b):
        sub = nn.Conv2d(cin, cout, conv.kernel_size, conv.stride, conv.padding, conv.dilation,
                        bias=conv.bias is not None).double()
        a = _rows(x[:, j * cin:(j + 1) * cin], sub)
        d = gout[:, j * cout:(j + 1) * cout].permute(0, 2, 3, 1).reshape(-1, cout)
        grad = d.T @ a  # (cout, cin*k*k [+1]): the gradient of this group's block
        if reduce:
            P = a.shape[0] // B
            a = a.reshape(B, P, -1).mean(1)
            d = d.reshape(B, P, -1).sum(1)
        A = a.T @ a / a.shape[0]
        G = B * (d.T @ d)
        Ai, Gi = damped_invs(A, G, damping)
        out.append(Gi @ grad @ Ai)
    return torch.cat(out, 0)


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("groups,cin,cout,bias", [(4, 4, 4, True), (4, 4, 8, False), (2, 6, 4, True), (3, 3, 3, False)])
def test_grouped_conv_equals_per_group_reference(approx: str, groups: int, cin: int, cout: int, bias: bool) -> None:
    torch.manual_seed(groups + cin + cout)
    conv = nn.Conv2d(cin, cout, 3, stride=2 if cin == 6 else 1, padding=1, groups=groups, bias=bias).double()
    damping = 1e-2
    pre = KFACPreconditioner(conv, factor_update_steps=1, inv_update_steps=1, kl_clip=None, damping=damping,
                             factor_approx=approx, factor_dtype="float64", inv_dtype="float64")
    ly = pre.layers[""]
    n_a = cin // groups * 9 + int(bias)
    assert ly.a_shape == (groups, n_a, n_a) and ly.g_shape == (groups, cout // groups, cout // groups)
    x = torch.randn(3, cin, 7, 7, dtype=F64)
    y = conv(x)
    gouts: list[torch.Tensor] = []
    y.register_hook(lambda g: gouts.append(g.detach().clone()))
    (y.square().sum() + y.sum()).backward()
    want = _reference(conv, x, gouts[0], approx == "reduce", damping)
    pre.step()
    got = conv.weight.grad.reshape(cout, -1)
    if bias:
        got = torch.cat([got, conv.bias.grad.reshape(-1, 1)], 1)
    assert_close(got, want, 1e-8)


def test_depthwise_convnext_block_is_one_batched_factor() -> None:
    """A 7x7 depthwise convolution of 64 channels: one (64, 50, 50) A and one (64, 1, 1) G, not 64 objects."""
    conv = nn.Conv2d(64, 64, 7, padding=3, groups=64)
    pre = KFACPreconditioner(conv, factor_update_steps=1, inv_update_steps=1, kl_clip=None)
    conv(torch.randn(2, 64, 8, 8)).square().mean().backward()
    pre.step()
    ly = pre.layers[""]
    assert ly.A is not None and ly.A.shape == (64, 50, 50) and ly.G is not None and ly.G.shape == (64, 1, 1)
    assert ly.A_inv is not None and ly.A_inv.shape == (64, 50, 50)
    assert torch.isfinite(conv.weight.grad).all()


def test_depthwise_eigen_against_dense_block_solve() -> None:
    """The eigen path on grouped factors, depthwise: with one output per group (G is 1x1 per block) each block is
    G_j A_j, damped by exactly ``damping``, solved densely per channel."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 3, 3, groups=3, bias=False).double()
    damping = 1e-2
    pre = KFACPreconditioner(conv, factor_update_steps=1, inv_update_steps=1, kl_clip=None, damping=damping,
                             inverse_method="eigen", factor_approx="reduce", factor_dtype="float64",
                             inv_dtype="float64")
    x = torch.randn(4, 3, 6, 6, dtype=F64)
    y = conv(x)
    gouts: list[torch.Tensor] = []
    y.register_hook(lambda g: gouts.append(g.detach().clone()))
    y.pow(3).sum().backward()
    want = []
    B = x.shape[0]
    for j in range(3):
        sub = nn.Conv2d(1, 1, 3, bias=False).double()
        a = _rows(x[:, j:j + 1], sub)
        d = gouts[0][:, j:j + 1].permute(0, 2, 3, 1).reshape(-1, 1)
        grad = (d.T @ a).reshape(-1)
        P = a.shape[0] // B
        a, d = a.reshape(B, P, -1).mean(1), d.reshape(B, P, -1).sum(1)
        A, G = a.T @ a / B, B * (d.T @ d)
        M = float(G) * A + damping * torch.eye(9, dtype=F64)  # A (x) G with a 1x1 G
        want.append(torch.linalg.solve(M, grad))
    pre.step()
    assert_close(conv.weight.grad.reshape(3, -1), torch.stack(want), 1e-8)


class SamePadConv2d(nn.Conv2d):
    """TensorFlow-style dynamic 'same' padding inside forward (as popular vision libraries write it): the module's
    ``padding`` attribute is 0, the input is padded (more on the right) before the convolution."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ih, iw = x.shape[-2:]
        kh, kw = self.kernel_size
        sh, sw = self.stride
        ph = max((math.ceil(ih / sh) - 1) * sh + (kh - 1) * self.dilation[0] + 1 - ih, 0)
        pw = max((math.ceil(iw / sw) - 1) * sw + (kw - 1) * self.dilation[1] + 1 - iw, 0)
        x = F.pad(x, [pw // 2, pw - pw // 2, ph // 2, ph - ph // 2])
        return F.conv2d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


class Shifted(nn.Conv2d):
    """A forward no padding rule explains (the input rolled first): K-FAC must refuse it by name."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(torch.roll(x, 1, dims=-1))


def test_dynamic_same_padding_is_detected_and_exact() -> None:
    torch.manual_seed(0)
    conv = SamePadConv2d(2, 3, 4, stride=2).double()
    ref = nn.Conv2d(2, 3, 4, stride=2).double()
    ref.load_state_dict(conv.state_dict())
    x = torch.randn(2, 2, 9, 9, dtype=F64)
    grads = []
    for m, inp in ((conv, x), (ref, F.pad(x, [1, 2, 1, 2]))):  # ceil(9/2)=5: (5-1)*2+4-9 = 3 -> 1 left, 2 right
        pre = KFACPreconditioner(m, factor_update_steps=1, inv_update_steps=1, kl_clip=None,
                                 factor_dtype="float64", inv_dtype="float64", factor_approx="expand")
        m(inp).square().sum().backward()
        pre.step()
        grads.append(m.weight.grad.clone())
        pre.remove_hooks()
    assert_close(grads[0], grads[1], 1e-10)


def test_convolution_whose_forward_does_not_match_is_refused_by_name() -> None:
    model = nn.Sequential(nn.Conv2d(2, 2, 3), Shifted(2, 2, 3, padding=1))
    pre = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1, kl_clip=None)
    _assert_refused(model, pre, r"K-FAC layer '1' \(Shifted\).*skip_layers")


def test_mismatched_forward_is_refused_in_eval_mode_too() -> None:
    """A layer collected from an eval-mode forward (a frozen-BatchNorm backbone trains its convolutions in eval
    mode) is checked like one in train mode: no factors from the wrong patches there either."""
    model = nn.Sequential(nn.Conv2d(2, 2, 3), Shifted(2, 2, 3, padding=1)).eval()
    pre = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1, kl_clip=None)
    _assert_refused(model, pre, r"K-FAC layer '1' \(Shifted\)")


def _assert_refused(model: nn.Module, pre: KFACPreconditioner, pattern: str) -> None:
    """One step: the layer is refused once by name (no factors, named in the summary), the run goes on."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model(torch.randn(1, 2, 8, 8)).square().sum().backward()
        pre.step()
    assert sum(bool(re.search(pattern, str(w.message), re.S)) for w in record) == 1
    assert pre.layers["1"].A is None and "1" in pre.unfactored and pre.layers["0"].A is not None
    assert "1.weight" in {x.name for x in pre.summary().left_out}
    pre.remove_hooks()


def test_padding_same_and_padding_modes_are_exact() -> None:
    """padding='same' (asymmetric for an even kernel) and reflect/circular modes: the rows are the patches the
    module convolves (checked against the module's own output by the expand/reduce identity dW = D^T A)."""
    torch.manual_seed(0)
    for kw in (dict(padding="same", kernel_size=4), dict(padding=1, padding_mode="reflect", kernel_size=3),
               dict(padding=2, padding_mode="circular", kernel_size=3)):
        conv = nn.Conv2d(2, 3, **kw).double()
        helper = KFACPreconditioner(conv).layers[""].helper
        x = torch.randn(2, 2, 6, 6, dtype=F64)
        y = conv(x)
        rows = helper.a_rows(x)
        want = y.permute(0, 2, 3, 1).reshape(-1, 3) - conv.bias.detach()
        assert_close(rows @ conv.weight.detach().reshape(3, -1).T, want, 1e-10)


def _conv1d_transformers():
    transformers = pytest.importorskip("transformers")
    return transformers.pytorch_utils.Conv1D(5, 4)


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("make,shape", [
    (lambda: nn.Linear(4, 5), (0, 4)),
    (lambda: nn.Linear(4, 5), (0, 3, 4)),
    (lambda: nn.Conv1d(4, 4, 3, padding=1), (0, 4, 6)),
    (lambda: nn.Conv2d(4, 4, 3, padding=1), (0, 4, 6, 6)),
    (lambda: nn.Conv2d(4, 4, 3, padding=1, groups=4), (0, 4, 6, 6)),
    (lambda: nn.Conv3d(2, 2, 3, padding=1), (0, 2, 4, 4, 4)),
    (lambda: nn.Embedding(10, 4), (0, 3)),
    (_conv1d_transformers, (0, 3, 4)),
])
def test_empty_batch_every_layer_type(make, shape, approx: str) -> None:
    """A 0-row batch collects nothing and breaks nothing, on every layer type and both approximations; the
    next non-empty step preconditions as usual."""
    torch.manual_seed(0)
    layer = make()
    pre = KFACPreconditioner(layer, factor_update_steps=1, inv_update_steps=1, kl_clip=None, factor_approx=approx)
    x = torch.randint(0, 10, shape) if isinstance(layer, nn.Embedding) else torch.randn(shape)
    layer(x).sum().backward()
    pre.step()
    full = (2, *shape[1:])
    layer.zero_grad()
    x = torch.randint(0, 10, full) if isinstance(layer, nn.Embedding) else torch.randn(full)
    layer(x).square().sum().backward()
    pre.step()
    assert next(iter(pre.layers.values())).A is not None
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters())
