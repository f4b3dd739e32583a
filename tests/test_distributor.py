"""The distributor seam on one process: the explicit-factor path (what the distributed
schedules use) and pipelined submission give exactly the fast local path's results."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_spdkfac import KFACPreconditioner
from lightning_spdkfac.kfac.distributor import Distributor, DistributorContext


class Echo(Distributor):
    """A one-rank 'distributed' schedule: records what it is given and when."""

    def __init__(self, pipelined: bool):
        self.pipelined = pipelined
        self.events: list[tuple] = []
        self.held: dict = {}

    def setup(self, sides, context):
        super().setup(sides, context)
        self.sides = list(sides)

    def begin_step(self, step):
        self.events.append(("begin",))
        self.held = {}

    def factor_final(self, index, which, matrix):
        self.events.append(("final", index, which))
        self.held[(index, which)] = matrix

    def reduce_factors(self, local):
        self.events.append(("reduce", tuple(sorted(local))))
        assert not set(local) & set(self.held), "a submitted factor was sent again"
        return {**self.held, **local}


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(48, 10),
                         nn.ReLU(), nn.Linear(10, 3))


def train(distributor, steps=4, accumulate=1):
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    # factors every step: every step from step 1 on submits (pipelined) or reduces them
    pre = KFACPreconditioner(m, damping=0.01, factor_update_steps=1, inv_update_steps=2, distributor=distributor, lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        for j in range(accumulate):
            pre.final_micro_batch = j == accumulate - 1
            x, y = torch.randn(8, 1, 4, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
            (F.cross_entropy(m(x), y) / accumulate).backward()
        pre.step()
        opt.step()
    return m, pre


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_explicit_factor_path_equals_local_fast_path(pipelined, accumulate):
    ref, ref_pre = train(None, accumulate=accumulate)
    echo = Echo(pipelined)
    got, pre = train(echo, accumulate=accumulate)
    for a, b in zip(ref.parameters(), got.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    for name, layer in ref_pre.layers.items():
        torch.testing.assert_close(pre.layers[name].A, layer.A, rtol=1e-5, atol=1e-7)
    # setup gets each layer's (A shape, G shape) (the Distributor contract, item 0): dense factors here
    assert echo.sides == [((10, 10), (3, 3)), ((49, 49), (10, 10)), ((11, 11), (3, 3))]
    finals = [e for e in echo.events if e[0] == "final"]
    if not pipelined:
        assert finals == []
    else:
        # Step 0 learns the calls per micro-batch; from step 1 on every factor is submitted from
        # the hooks (A in forward order, G in backward order) and nothing is left for reduce.
        assert len(finals) == 3 * 6
        first_step = [e for e in finals][:6]
        assert first_step == [("final", 0, "A"), ("final", 1, "A"), ("final", 2, "A"),
                              ("final", 2, "G"), ("final", 1, "G"), ("final", 0, "G")]
        reduces = [e for e in echo.events if e[0] == "reduce"]
        assert len(reduces[0][1]) == 6 and all(r[1] == () for r in reduces[1:])


def test_changed_call_count_under_pipelining_fails_loudly():
    lin = nn.Linear(4, 4)
    pre = KFACPreconditioner(lin, distributor=Echo(pipelined=True), factor_update_steps=1, inv_update_steps=10, lr=0.1)
    x = torch.randn(5, 4)
    lin(x).sum().backward()
    pre.step()  # learns: one call per micro-batch
    lin.zero_grad()
    lin(lin(x)).sum().backward()  # now two calls: the first already sent its A
    with pytest.raises(RuntimeError, match=r"layer '': its A factor was sent after 1 call\(s\).*ended after 2"):
        pre.step()


def test_fuse_g_false_reduces_every_g_factor_alone():
    """SPDOptions.fuse_g=False (the original SPD-KFAC code): runs of A factors are fused by the policy,
    each G factor is reduced by itself; the default fuses across A and G."""
    from lightning_spdkfac.comm.scheduler import SPDDistributor, SPDOptions

    def groups(fuse_g: bool):
        d = SPDDistributor(SPDOptions.from_schedule("spd", fusion="all", fuse_g=fuse_g))
        d.setup([(4, 3), (5, 2)], DistributorContext())  # canonical order: A0, A1, G1, G0
        return d._plan_groups(d.keys, [0.0] * len(d.keys))

    assert groups(False) == [(0, 1), (2,), (3,)]
    assert groups(True) == [(0, 1, 2, 3)]


def test_spd_distributor_takes_spd_options_by_the_package_rule():
    """A wrong type of options is a TypeError naming it (it was an AttributeError at setup)."""
    from lightning_spdkfac.comm.scheduler import SPDDistributor

    with pytest.raises(TypeError, match="options must be a SPDOptions, got dict"):
        SPDDistributor({"schedule": "spd"})
