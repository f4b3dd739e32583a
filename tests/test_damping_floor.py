"""damping_floor (kfac/inverse_steps.py): each block damped by at least rho * mean eigenvalue of A * mean eigenvalue of
G, then pi-balanced; checked against a run whose damping is that number, and refused where it has no meaning."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_spdkfac import KFACPreconditioner
from lightning_spdkfac.kfac.options import KFACOptions


def _one_step(**kw: object) -> KFACPreconditioner:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 5)).double()
    pre = KFACPreconditioner(net, lr=0.1, factor_dtype="float64", inv_dtype="float64", **kw)  # type: ignore[arg-type]
    torch.manual_seed(1)
    net(torch.randn(32, 6, dtype=torch.float64)).square().sum().backward()
    pre.step()
    return pre


@pytest.mark.parametrize("damping", [1e-8, 1e3])
def test_the_floor_damps_each_block_by_its_own_scale(damping: float) -> None:
    rho = 0.05
    floored = _one_step(damping=damping, damping_floor=rho)
    ly = floored.layers["0"]
    assert ly.A is not None and ly.G is not None
    scale = float(ly.A.diagonal().mean() * ly.G.diagonal().mean()) * rho
    want = max(damping, scale)  # the floor where the damping is below it, the damping where it is above
    ref = _one_step(damping=want).layers["0"]
    torch.testing.assert_close(ly.A_inv, ref.A_inv, rtol=1e-10, atol=0)
    torch.testing.assert_close(ly.G_inv, ref.G_inv, rtol=1e-10, atol=0)
    if damping < scale:  # (and it changed something: the floor is far above a damping of 1e-8)
        assert not torch.allclose(ly.A_inv, _one_step(damping=damping).layers["0"].A_inv)


def test_the_floor_is_refused_where_it_has_no_meaning() -> None:
    with pytest.raises(ValueError, match="damping_floor"):
        KFACOptions(damping_floor=0.0)
    with pytest.raises(ValueError, match="damping_floor=0.1 works on the Cholesky"):
        KFACOptions(damping_floor=0.1, inverse_method="eigen")
    with pytest.raises(ValueError, match="damping_floor=0.1 works on the Cholesky"):
        KFACOptions(damping_floor=0.1, update="eigen_adam")
