"""Inverse broadcasts in the order the inversions are predicted to finish (issue 17, item 2).

One function, :func:`~lightning_spdkfac.schedule.broadcast_order`, orders the broadcasts; the runtime
(``SPDDistributor``) issues them in it and the simulator runs them on its channel in it. Checked here: the
order itself (hand-computed), that the simulator's timeline uses it, that a 2-rank run issues exactly the
order the simulator derives for the same plan and models, and that training with it still equals D-KFAC
and one process, replicas bitwise equal.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from helpers.training import sgd_kfac_steps
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_spdkfac import KFACPreconditioner
from lightning_spdkfac.comm.consistency import plan_fingerprint
from lightning_spdkfac.comm.scheduler import Models, SPDDistributor, SPDOptions
from lightning_spdkfac.multiprocess import run_distributed
from lightning_spdkfac.schedule import AlphaBeta, InverseCost, Placement, broadcast_order, simulate_placement
from lightning_spdkfac.simulate import Cluster, Workload, profile_layers, simulate, with_schedule

CUBE = InverseCost(c3=1.0)  # inverting an n x n factor takes n^3 seconds


# ------------------------------------------------------------------------------ the order function
def test_order_is_by_predicted_finish_then_index():
    # Rank 0 owns factors 0 (27 s) and 2 (+1 s): finishes 27, 28. Rank 1 owns 1 (1 s) and 3 (+8 s):
    # finishes 1, 9. Factor 4 is replicated and never broadcast.
    assert broadcast_order([0, 1, 0, 1, -1], [3, 1, 1, 2, 5], CUBE) == (1, 3, 0, 2)
    # Equal finishes (a zero model): ascending index.
    assert broadcast_order([1, 0, 1, 0], [3, 1, 1, 2], InverseCost()) == (0, 1, 2, 3)
    assert broadcast_order([1, 0], [2, 2], CUBE) == (0, 1)  # 8 s each: tie, lower index first
    assert broadcast_order([-1, -1], [3, 4], CUBE) == ()


def test_each_owner_keeps_ascending_index_within_the_order():
    owners = [2, 0, 1, 2, 0, 0, 1, 2, 1, 0]
    ns = [9, 1, 4, 2, 7, 3, 3, 8, 1, 2]
    order = broadcast_order(owners, ns, InverseCost(c0=0.5, c3=1e-2))
    assert sorted(order) == list(range(len(owners)))
    for rank in range(3):
        mine = [i for i in order if owners[i] == rank]
        assert mine == sorted(mine)


def test_order_arguments_are_checked():
    with pytest.raises(ValueError, match="same length"):
        broadcast_order([0, 1], [3], CUBE)
    with pytest.raises(ValueError, match="owners"):
        broadcast_order([-2], [3], CUBE)
    with pytest.raises(TypeError, match="inv"):
        broadcast_order([0], [3], 1.0)


# ------------------------------------------------------------------------------ the simulator
def test_placement_timeline_runs_broadcasts_in_the_order_and_beats_owner_turns():
    placement = Placement(owners=(0, 1, 0, 1), policy="round_robin", load=(0.0, 0.0))
    ns, bcast = [3, 1, 1, 2], AlphaBeta(2.0, 0.0)  # every broadcast takes 2 s
    pt = simulate_placement(placement, ns, CUBE, bcast)
    # ready: 1 at 1, 3 at 9, 0 at 27, 2 at 28 -> broadcasts [1, 3], [9, 11], [27, 29], [29, 31]
    assert pt.broadcast_order == broadcast_order(placement.owners, ns, CUBE) == (1, 3, 0, 2)
    assert pt.broadcast_start == (1.0, 9.0, 27.0, 29.0) and pt.broadcast_end == (3.0, 11.0, 29.0, 31.0)
    assert pt.compute_end == (28.0, 9.0) and pt.end == 31.0
    # The runtime's order before: owners take turns (0, 1, 2, 3), so factor 1's broadcast waits behind
    # factor 0's 27 s inversion: [27, 29], [29, 31], [31, 33], [33, 35].
    turns = simulate_placement(placement, ns, CUBE, bcast, order=(0, 1, 2, 3))
    assert turns.broadcast_start == (27.0, 29.0, 31.0, 33.0) and turns.end == 35.0
    with pytest.raises(ValueError, match="every owned factor"):
        simulate_placement(placement, ns, CUBE, bcast, order=(0, 1, 2))


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 8, 3, stride=2, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(8 * 4 * 4, 24), nn.Tanh(), nn.Linear(24, 5),
    )


# Round-robin owners and a fixed inversion model (1e-5 s + n^3 ns): every rank, the runtime and the
# simulator plan from exactly these.
INVERSE = InverseCost(c0=1e-5, c3=1e-9)
BROADCAST = AlphaBeta(1e-4, 1e-9)
ROUND_ROBIN = dict(schedule="spd", placement="round_robin", fusion="layerwise")


def simulated_order(broadcast="finish"):
    """The simulator's broadcast order for ``make_model`` at 2 ranks under ``ROUND_ROBIN`` and the fixed models."""
    work = Workload.from_rates("tiny", profile_layers(make_model(), (2, 8, 8)), 8, flops_per_s=1e9)
    cluster = Cluster(2, AlphaBeta(1e-4, 1e-9), BROADCAST, BROADCAST, INVERSE)
    tl = simulate(work, cluster, with_schedule("spd", placement="round_robin", fusion="layerwise",
                                               broadcast_order=broadcast))
    events = [e.label for e in tl.events if e.category == "InvComm"]
    order = [tl.order[i] for i in tl.extra["broadcast_order"]]
    assert events == [f"broadcast {k}" for k in order]  # the channel runs them in that order
    return order, tl.owners, tl.extra["sides"], tl.total


def test_simulator_timeline_issues_broadcast_order():
    order, owners, sides, total = simulated_order()
    keys = [(i, "A") for i in range(4)] + [(i, "G") for i in reversed(range(4))]
    assert order == [keys[i] for i in broadcast_order(owners, sides, INVERSE)]
    assert order == [(0, "A"), (1, "A"), (3, "A"), (2, "G"), (0, "G"), (2, "A"), (3, "G"), (1, "G")]
    # The runtime's order before, kept for comparison: owners take turns over the tasks in layer order
    # (A0 r0, G0 r1, A1 r1, G1 r0, A2 r0, G2 r1, A3 r1, G3 r0).
    turns, _, _, turns_total = simulated_order("owner_turns")
    assert turns == [(0, "A"), (0, "G"), (1, "G"), (1, "A"), (2, "A"), (2, "G"), (3, "G"), (3, "A")]
    assert turns_total >= total


# ------------------------------------------------------------------------------ the runtime, 2 ranks
STEPS, BATCH = 7, 8
KFAC_KW = dict(damping=0.05, kl_clip=1e-2, lr=0.1, factor_update_steps=1, inv_update_steps=2)


class FixedModels(SPDDistributor):
    """The schedule with the test's cost models instead of measured ones (identical on every rank)."""

    def _measure_models(self) -> None:
        self.models = Models(allreduce=AlphaBeta(1e-4, 1e-9), broadcast=BROADCAST, inverse=INVERSE)


def data(step, world):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH * world, 2, 8, 8, generator=g), torch.randint(0, 5, (BATCH * world,), generator=g)


def train(rank, world, cls, options):
    model = make_model()
    distributor = cls(options, process_group=dist.new_group())
    pre = KFACPreconditioner(model, distributor=distributor, **KFAC_KW)
    sgd_kfac_steps(DDP(model), pre, data, STEPS, world, rank, BATCH)
    plan = distributor.describe()
    return [p.detach().clone() for p in model.parameters()], plan["broadcast_order"], plan["owners"]


def both(rank, world):
    torch.set_num_threads(1)
    return {"dkfac": train(rank, world, SPDDistributor, SPDOptions.from_schedule("dkfac")),
            "ordered": train(rank, world, FixedModels, SPDOptions.from_schedule(**ROUND_ROBIN))}


@pytest.fixture(scope="module")
def job():
    results = run_distributed(both, 2, timeout=120)
    model = make_model()
    sgd_kfac_steps(model, KFACPreconditioner(model, **KFAC_KW), data, STEPS, 2)
    return SimpleNamespace(results=results, reference=[p.detach() for p in model.parameters()])


def test_runtime_issues_the_simulators_order(job):
    order, owners, _, _ = simulated_order()
    for rank, result in enumerate(job.results):
        _, issued, used = result["ordered"]
        assert used == list(owners), f"rank {rank} placed differently from the simulator"
        assert issued == order, f"rank {rank} issued {issued}, the simulator {order}"
    # By predicted finish; before, owners took turns over the layers: A0 G0 G1 A1 A2 G2 G3 A3.
    assert order == [(0, "A"), (1, "A"), (3, "A"), (2, "G"), (0, "G"), (2, "A"), (3, "G"), (1, "G")]


def test_training_in_that_order_equals_dkfac_and_one_process(job):
    params = [r["ordered"][0] for r in job.results]
    for a, b in zip(*params):
        assert torch.equal(a, b), "the replicas differ"
    for a, b, d in zip(params[0], job.reference, job.results[0]["dkfac"][0]):
        torch.testing.assert_close(a, d, rtol=1e-5, atol=1e-7, msg="vs dkfac")
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg="vs one process")


def test_plan_check_fingerprints_the_broadcast_order():
    base = dict(order=[(0, "A"), (0, "G")], groups=[[0, 1]], owners=[0, 1], sides=[3, 4],
                broadcast=[(0, "A"), (0, "G")])
    fp = plan_fingerprint(**base)
    changed = plan_fingerprint(**{**base, "broadcast": [(0, "G"), (0, "A")]})
    assert [k for k in fp if fp[k] != changed[k]] == ["broadcast"]
