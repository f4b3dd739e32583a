"""update="eigen_adam" (kfac/eigenbasis.py) against a dense float64 reference written with Kronecker products: the
gradient rotated by (Q_A (x) Q_G)^T, a running second moment per entry, damping relative to the block's root mean
square, the moment carried into a refreshed basis with the squared entries of (Q_new)^T Q_old, the direction rotated
back; and the state it keeps (checkpoints, the summary)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_spdkfac import KFACPreconditioner
from lightning_spdkfac.kfac.options import KFACOptions

BETA2, EPS, LR, DAMPING = 0.9, 1e-8, 0.05, 0.05


def _eigh(M: torch.Tensor) -> torch.Tensor | None:
    """Eigenvectors (columns) of a dense factor; None for a diagonal one (its basis is the identity)."""
    return None if M.dim() == 1 else torch.linalg.eigh(M.double())[1].contiguous()


def _kron_basis(QA: torch.Tensor | None, QG: torch.Tensor | None, a: int, g: int) -> torch.Tensor:
    """Q_A (x) Q_G: vec(Q_G^T M Q_A) = (Q_A (x) Q_G)^T vec(M) with column-major vec."""
    eye = torch.eye
    return torch.kron(eye(a, dtype=torch.float64) if QA is None else QA,
                      eye(g, dtype=torch.float64) if QG is None else QG)


def _vec(M: torch.Tensor) -> torch.Tensor:
    return M.T.reshape(-1)


def _unvec(v: torch.Tensor, g: int, a: int) -> torch.Tensor:
    return v.reshape(a, g).T


class Reference:
    """The eigenbasis mode of one layer, in vec form."""

    def __init__(self) -> None:
        self.K: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.t = 0

    def step(self, M: torch.Tensor, K: torch.Tensor) -> torch.Tensor:
        g, a = M.shape
        if self.v is None:
            self.v = torch.zeros(g * a, dtype=torch.float64)
        elif self.K is not None and not torch.equal(K, self.K):
            W = K.T @ self.K
            self.v = (W * W) @ self.v
        self.K = K
        r = K.T @ _vec(M)
        self.t += 1
        self.v = BETA2 * self.v + (1 - BETA2) * r * r
        v_hat = self.v / (1 - BETA2 ** self.t)
        u = r / (v_hat.sqrt() + DAMPING * v_hat.mean().sqrt() + EPS)  # damping relative to the block's rms
        return _unvec(K @ u, g, a)


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3, bias=False)).double()


def _grad_matrix(layer: nn.Linear) -> torch.Tensor:
    W = layer.weight.grad
    return W if layer.bias is None else torch.cat([W, layer.bias.grad[:, None]], 1)


@pytest.mark.parametrize("max_side", [4608, 5], ids=["dense", "diagonal_side"])
def test_eigen_adam_matches_the_dense_reference(max_side: int) -> None:
    net = _net()
    pre = KFACPreconditioner(net, update="eigen_adam", eigen_beta2=BETA2, eigen_eps=EPS, damping=DAMPING,
                             factor_update_steps=1,
                             inv_update_steps=2, kl_clip=None, lr=LR, factor_dtype="float64", inv_dtype="float64",
                             max_factor_side=max_side)
    assert pre.options.inverse_method == "eigen"  # its basis is the factors' eigendecompositions
    refs = {name: Reference() for name in pre.layers}
    bases: dict[str, torch.Tensor] = {}
    for k in range(7):
        net.zero_grad()
        x = torch.randn(16, 5, dtype=torch.float64)
        net(x).square().sum().backward()
        raw = {name: _grad_matrix(net[int(name)]).clone() for name in pre.layers}
        pre.step()
        for name, ly in pre.layers.items():
            if k % 2 == 0:  # an inverse step: the basis of the factors as they are now
                g, a = raw[name].shape
                bases[name] = _kron_basis(_eigh(ly.A), _eigh(ly.G), a, g)
            want = refs[name].step(raw[name].double(), bases[name])
            torch.testing.assert_close(_grad_matrix(net[int(name)]), want, rtol=1e-7, atol=1e-9)


def _train(pre: KFACPreconditioner, net: nn.Module, steps: range, seed: int = 1) -> None:
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    opt.load_state_dict(getattr(net, "_opt_state", opt.state_dict()))
    for k in steps:
        gen = torch.Generator().manual_seed(seed * 1000 + k)
        x = torch.randn(16, 5, generator=gen, dtype=torch.float64)
        opt.zero_grad()
        net(x).square().mean().backward()
        pre.step(opt)
        opt.step()
    net._opt_state = copy.deepcopy(opt.state_dict())  # type: ignore[assignment]


@pytest.mark.parametrize("async_inverses", [False, True])
def test_a_resumed_run_continues_bitwise(async_inverses: bool) -> None:
    kw = dict(update="eigen_adam", factor_update_steps=1, inv_update_steps=3, async_inverses=async_inverses,
              factor_dtype="float64", inv_dtype="float64")
    net = _net()
    pre = KFACPreconditioner(net, **kw)
    _train(pre, net, range(8))

    net2 = _net()
    pre2 = KFACPreconditioner(net2, **kw)
    _train(pre2, net2, range(4))
    state = copy.deepcopy(pre2.state_dict())
    assert set(state["eigen_moments"]) == set(pre2.layers) and all(m["t"] == 4 for m in state["eigen_moments"].values())
    net3 = copy.deepcopy(net2)
    pre3 = KFACPreconditioner(net3, **kw)
    pre3.load_state_dict(state)
    _train(pre3, net3, range(4, 8))
    for p, q in zip(net.parameters(), net3.parameters()):
        assert torch.equal(p, q)


def test_corrupt_moments_are_refused_by_name() -> None:
    net = _net()
    pre = KFACPreconditioner(net, update="eigen_adam", lr=0.1)
    _train(pre, net, range(2))
    state = pre.state_dict()
    state["eigen_moments"]["0"]["v"] = -state["eigen_moments"]["0"]["v"] - 1
    with pytest.raises(ValueError, match="'0': its eigen moments must be"):
        KFACPreconditioner(_net(), update="eigen_adam", lr=0.1).load_state_dict(state)


def test_the_summary_counts_the_moments_it_holds() -> None:
    net = _net()
    pre = KFACPreconditioner(net, update="eigen_adam", lr=0.1, inv_dtype="float64")
    base = KFACPreconditioner(_net(), inverse_method="eigen", lr=0.1, inv_dtype="float64")
    _train(pre, net, range(2))
    held = pre.preconditioning.eigen_moments.nbytes()
    assert held > 0 and pre.summary().total_bytes - base.summary().total_bytes == held


def test_bad_eigen_options_name_themselves() -> None:
    with pytest.raises(ValueError, match="update"):
        KFACOptions(update="soap")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="eigen_beta2"):
        KFACOptions(eigen_beta2=1.0)
    with pytest.raises(ValueError, match="eigen_eps"):
        KFACOptions(eigen_eps=0.0)
