"""Model setups that K-FAC used to crash on or get silently wrong, each checked from the user's side.

- ``channels_last`` convolutions (and a Linear whose weight is stored column-major): their gradients are
  not contiguous; a channels_last model trains exactly like the same model in the contiguous format.
- ``weight_norm`` / ``spectral_norm`` layers (parametrizations and the old hooks): skipped at setup with one
  warning each, their gradients untouched.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_spdkfac import KFACPreconditioner

DAMPING = 0.05


def kfac(model, **kw):
    """Factors and inverses every step (not the defaults, 5 and 50): runs are compared step by step."""
    kw = {"factor_decay": 0.5, "damping": DAMPING, "factor_update_steps": 1, "inv_update_steps": 1, "lr": 0.1,
          **kw}
    return KFACPreconditioner(model, **kw)


def kfac_warnings(record):
    return [str(w.message) for w in record if "K-FAC" in str(w.message)]


def assert_same(got, ref, atol):
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=atol)


def batches(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


# --------------------------------------------------------------------------- channels_last
class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.c1 = nn.Conv2d(3, 6, 3, padding=1)
        self.c2 = nn.Conv2d(6, 6, 3, stride=2)  # no padding
        self.c3 = nn.Conv2d(6, 5, 3, padding="same", padding_mode="reflect", dilation=2, bias=False)
        self.c4 = nn.Conv2d(5, 4, 1)
        self.fc = nn.Linear(4, 3)
        # stored column-major: the Linear's gradient is not contiguous either
        self.fc.weight = nn.Parameter(self.fc.weight.detach().t().contiguous().t())

    def forward(self, x):
        for conv in (self.c1, self.c2, self.c3, self.c4):
            x = torch.tanh(conv(x))
        # (B, H, W, C): contiguous for a channels_last x, a strided view for a contiguous one
        return self.fc(x.permute(0, 2, 3, 1)).mean((1, 2))


@pytest.mark.parametrize("factor_approx", ["expand", "reduce"])
def test_channels_last_cnn_trains_like_the_contiguous_one(factor_approx):
    runs = []
    for fmt in (torch.contiguous_format, torch.channels_last):
        model = CNN().to(memory_format=fmt)
        pre = kfac(model, factor_approx=factor_approx, kl_clip=1e-2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            x = torch.randn(4, 3, 10, 10, generator=g).contiguous(memory_format=fmt)
            y = torch.randint(0, 3, (4,), generator=g)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            if fmt == torch.channels_last:  # the premise: the gradients that used to crash the step
                assert not model.c1.weight.grad.is_contiguous() and not model.fc.weight.grad.is_contiguous()
            pre.step()
            opt.step()
        assert model.c1.weight.is_contiguous(memory_format=fmt)
        runs.append((model, pre))
    (plain, p_plain), (cl, p_cl) = runs
    assert_same(cl.parameters(), plain.parameters(), atol=1e-5)
    for name, layer in p_plain.layers.items():
        assert_same([p_cl.layers[name].A, p_cl.layers[name].G], [layer.A, layer.G], atol=1e-5)
    assert not torch.allclose(plain.c1.weight, CNN().c1.weight)  # it trained


# --------------------------------------------------------------------------- weight_norm / spectral_norm
def normed_model():
    torch.manual_seed(0)
    P = torch.nn.utils.parametrizations
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.nn.utils.weight_norm is deprecated
        old_wn = torch.nn.utils.weight_norm(nn.Linear(8, 8))
    return nn.Sequential(
        nn.Linear(6, 8), nn.Tanh(),
        P.weight_norm(nn.Linear(8, 8)), nn.Tanh(),
        P.spectral_norm(nn.Linear(8, 8)), nn.Tanh(),
        old_wn, nn.Tanh(),
        torch.nn.utils.spectral_norm(nn.Linear(8, 8)), nn.Tanh(),
        nn.Linear(8, 3),
    )


def test_weight_norm_and_spectral_norm_layers_are_skipped_with_one_warning_each():
    model = normed_model()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        pre = kfac(model)
    msgs = kfac_warnings(record)
    normed = ["2", "4", "6", "8"]
    assert len(msgs) == 4
    for name, msg, how in zip(normed, msgs, ["_WeightNorm", "_SpectralNorm", "WeightNorm", "SpectralNorm"]):
        assert f"'{name}'" in msg and "computed from other parameters" in msg and how in msg, msg
    assert list(pre.layers) == ["0", "10"]  # no factor work is spent on the others
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "The .grad attribute of a Tensor that is not a leaf"
        for x, y in batches(2):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            skipped = [p for n in normed for p in model[int(n)].parameters()]
            raw = [p.grad.clone() for p in skipped]
            pre.step()
            assert all(torch.equal(p.grad, r) for p, r in zip(skipped, raw))
            opt.step()
    assert pre.layers["0"].A is not None and pre.layers["10"].A is not None
