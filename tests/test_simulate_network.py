"""The simulator's network models (issue 19): collectives by algorithm, the two-level topology and its
fit, the compute slowdown under communication, the lower bound of every schedule, the per-phase
comparison with the paper. Every expected number is computed by hand in the comments."""

from __future__ import annotations

import pytest

from lightning_spdkfac.schedule import AlphaBeta, InverseCost
from lightning_spdkfac.simulate import (
    SIM_SCHEDULES,
    Cluster,
    LayerSpec,
    LayerTimes,
    SimSchedule,
    Workload,
    simulate,
    with_schedule,
)
from lightning_spdkfac.simulate.cluster import (
    binomial_broadcast,
    chain_collective,
    ring_allreduce,
    ring_reduce_scatter,
    tree_allreduce,
)
from lightning_spdkfac.simulate.paper import (
    PAPER_ALLREDUCE,
    PAPER_BREAKDOWN,
    PAPER_INTRA_ALPHA,
    PAPER_INTRA_BETA,
    compare_phases,
    paper_case,
    paper_cluster,
)

INV = InverseCost(c0=0.25)


def approx_ab(ab: AlphaBeta, alpha: float, beta: float) -> None:
    assert ab.alpha == pytest.approx(alpha, rel=1e-12) and ab.beta == pytest.approx(beta, rel=1e-12)


def test_textbook_collectives_by_hand():
    # ring: 2(P-1) latencies, 2(P-1)/P of the message; tree: 2 ceil(log2 P) latencies, the message twice
    assert ring_allreduce(8, 1.0, 2.0) == AlphaBeta(14.0, 3.5)
    assert tree_allreduce(8, 1.0, 2.0) == AlphaBeta(6.0, 4.0)
    assert tree_allreduce(5, 1.0, 2.0) == AlphaBeta(6.0, 4.0)  # ceil(log2 5) = 3
    # reduce-scatter / all-gather: (P-1) latencies, (P-1)/P of the message: half a ring all-reduce
    assert ring_reduce_scatter(4, 1.0, 2.0) == AlphaBeta(3.0, 1.5)
    assert ring_reduce_scatter(4, 1.0, 2.0).alpha * 2 == ring_allreduce(4, 1.0, 2.0).alpha
    # broadcast: pipelined chain (P-1) latencies and the message once; binomial tree ceil(log2 P) rounds
    assert chain_collective(5, 1.0, 2.0) == AlphaBeta(4.0, 2.0)
    assert binomial_broadcast(5, 1.0, 2.0) == AlphaBeta(3.0, 6.0)
    for f in (ring_allreduce, tree_allreduce, ring_reduce_scatter, chain_collective, binomial_broadcast):
        assert f(1, 1.0, 1.0) == AlphaBeta(0.0, 0.0)
    # at 1024 GPUs the tree's latency is 20 steps against the ring's 2046; for large messages the ring wins
    assert tree_allreduce(1024, 1.0, 1.0).alpha == 20.0 and ring_allreduce(1024, 1.0, 1.0).alpha == 2046.0


def test_cluster_ring_algorithms_and_broadcasts():
    c = Cluster.ring(8, 1.0, 2.0, INV, algorithm="tree", broadcast="tree")
    assert c.allreduce == AlphaBeta(6.0, 4.0)
    assert c.broadcast == c.reduce == AlphaBeta(3.0, 6.0)
    assert c.reduce_scatter == c.allgather == AlphaBeta(7.0, 1.75)
    d = Cluster.ring(8, 1.0, 2.0, INV)  # defaults: ring all-reduce, chain broadcast
    assert d.allreduce == AlphaBeta(14.0, 3.5) and d.broadcast == AlphaBeta(7.0, 2.0)
    with pytest.raises(ValueError, match="algorithm must be one of"):
        Cluster.ring(8, 1.0, 2.0, INV, algorithm="butterfly")
    with pytest.raises(ValueError, match="broadcast must be one of"):
        Cluster.ring(8, 1.0, 2.0, INV, broadcast="ring")


def test_two_level_by_hand():
    """8 GPUs = 2 nodes x 4; intra 0.5 s/step, 1 s/byte; inter 1 s/step, 4 s/byte.
    Intra reduce-scatter (and all-gather): 3 x 0.5 = 1.5 latency, 3/4 x 1 = 0.75 per byte.
    Shared NIC: the 4 inter-node rings of 1/4 of the message each cross one link: 2 x 1 x 1 = 2 latency,
    2 x 1/2 x 4 = 4 per byte of the whole message. Own paths: 4/4 = 1 per byte."""
    shared = Cluster.ring(8, 1.0, 4.0, INV, gpus_per_node=4, intra_alpha=0.5, intra_beta=1.0, shared_nic=True)
    assert shared.allreduce == AlphaBeta(1.5 + 2.0 + 1.5, 0.75 + 4.0 + 0.75)
    # broadcast: chain across the 2 nodes (1 latency) then in the node (3 x 0.5); the slower link's bytes
    assert shared.broadcast == AlphaBeta(1.0 + 1.5, 4.0)
    # reduce-scatter: in the node (1.5, 0.75) then across nodes on 1/4 each: (1, 1/2 x 4)
    assert shared.reduce_scatter == AlphaBeta(2.5, 2.75)
    own = Cluster.ring(8, 1.0, 4.0, INV, gpus_per_node=4, intra_alpha=0.5, intra_beta=1.0)
    assert own.allreduce == AlphaBeta(5.0, 2.5)
    tree = Cluster.ring(16, 1.0, 4.0, INV, gpus_per_node=4, intra_alpha=0.5, intra_beta=1.0, algorithm="tree",
                        shared_nic=True)
    # inter tree over 4 nodes: 2 x 2 latencies, 2 x 4 per byte
    assert tree.allreduce == AlphaBeta(1.5 + 4.0 + 1.5, 0.75 + 8.0 + 0.75)
    bin_tree = Cluster.ring(8, 1.0, 4.0, INV, gpus_per_node=4, intra_alpha=0.5, intra_beta=1.0, broadcast="tree")
    # binomial across 2 nodes (1 round: 1, 4) then in the node (2 rounds: 1.0, 2.0): rounds add up
    assert bin_tree.broadcast == AlphaBeta(2.0, 6.0)


@pytest.mark.parametrize("algorithm", ["ring", "tree"])
def test_two_level_fit_round_trip(algorithm):
    """Inverting the two-level formula at 64 GPUs (16 x 4) gives back the fit itself at 64."""
    c = Cluster.from_fit(PAPER_ALLREDUCE, 64, 64, INV, gpus_per_node=4, intra_alpha=PAPER_INTRA_ALPHA,
                         intra_beta=PAPER_INTRA_BETA, shared_nic=True, algorithm=algorithm)
    approx_ab(c.allreduce, PAPER_ALLREDUCE.alpha, PAPER_ALLREDUCE.beta)
    # inter-node numbers by hand (ring): alpha (9.29e-4 - 2 x 3 x 5e-6) / (2 x 15); at 1024 GPUs (256 nodes)
    # the all-reduce is 2 x 3 x 5e-6 + 2 x 255 x that
    if algorithm == "ring":
        a = (PAPER_ALLREDUCE.alpha - 6 * PAPER_INTRA_ALPHA) / 30
        big = paper_cluster(1024, two_level=True)
        assert big.allreduce.alpha == pytest.approx(6 * PAPER_INTRA_ALPHA + 510 * a)
        assert big.gpus_per_node == 4
    with pytest.raises(ValueError, match="intra-node numbers alone exceed"):
        Cluster.from_fit(AlphaBeta(1e-6, 1e-12), 64, 8, INV, gpus_per_node=4, intra_alpha=1e-3, intra_beta=1e-9)


def test_paper_cluster_options_keep_the_old_default():
    old = paper_cluster(64)
    assert old.allreduce == old.broadcast == old.reduce == PAPER_ALLREDUCE
    half = paper_cluster(64, broadcast="half")
    assert half.allreduce == PAPER_ALLREDUCE
    approx_ab(half.broadcast, PAPER_ALLREDUCE.alpha / 2, PAPER_ALLREDUCE.beta / 2)
    chain = paper_cluster(64, broadcast="chain", two_level=True)
    # chain over 16 nodes then 4 GPUs: 15 inter + 3 intra latencies; bytes once over the slower link
    a = (PAPER_ALLREDUCE.alpha - 6 * PAPER_INTRA_ALPHA) / 30
    b = (PAPER_ALLREDUCE.beta - 1.5 * PAPER_INTRA_BETA) / (2 * 15 / 16)
    approx_ab(chain.broadcast, 15 * a + 3 * PAPER_INTRA_ALPHA, max(b, PAPER_INTRA_BETA))
    assert chain.broadcast.time(1e8) < 0.5 * PAPER_ALLREDUCE.time(1e8)  # at least 2x cheaper for large messages
    one_node = paper_cluster(4, two_level=True)
    assert one_node.allreduce == ring_allreduce(4, PAPER_INTRA_ALPHA, PAPER_INTRA_BETA)
    with pytest.raises(ValueError, match="broadcast must be one of"):
        paper_cluster(64, broadcast="ring")


def test_old_constructors_get_reduce_scatter_and_allgather_defaults():
    c = Cluster(2, AlphaBeta(1.0, 2.0), AlphaBeta(0.5, 1.0), AlphaBeta(0.5, 1.0), INV)
    assert c.reduce_scatter == c.allgather == AlphaBeta(0.5, 1.0)  # half the all-reduce each
    assert c.overlap_slowdown == 0.0
    assert c.with_inverse(InverseCost(c0=1.0)).reduce_scatter == c.reduce_scatter
    with pytest.raises(ValueError, match="overlap_slowdown"):
        Cluster(2, AlphaBeta(1.0, 2.0), AlphaBeta(0.5, 1.0), AlphaBeta(0.5, 1.0), INV, overlap_slowdown=-0.1)


# the two-layer workload of tests/test_simulate.py: compute fwd L0 [0,1] A0 [1,1.5] fwd L1 [1.5,2.5] A1 [2.5,3]
# bwd L1 [3,5] G1 [5,5.25] bwd L0 [5.25,7.25] G0 [7.25,7.5] without communication
SPECS = (LayerSpec("l0", 4, 2, 1, 1.0, 10), LayerSpec("l1", 3, 1, 1, 1.0, 4))
WORK = Workload("two", SPECS, (LayerTimes(1.0, 2.0, 0.5, 0.25),) * 2, batch_size=1, grad_comm=0.5)


def test_compute_slowdown_under_communication_by_hand():
    """Layer-wise reductions of 1 s each, compute at half speed (s = 1) while one is on the wire:
    group 0 runs [1.5, 2.5]; fwd L1 (1 s) from 1.5: 1 s of wall time at half speed does 0.5 s of work,
    the rest at full speed: ends 3.0; A1 [3.0, 3.5] (channel idle); group 1 [3.5, 4.5]; bwd L1 (2 s) from
    3.5 ends 3.5 + 1 + 1.5 = 6.0; G1 [6.0, 6.25]; group 2 [6.25, 7.25]; bwd L0 ends 6.25 + 1 + 1.5 = 8.75;
    G0 [8.75, 9.0]; group 3 [9, 10]; gradient [10, 10.5]; four inversions of 0.25 s: 11.5."""
    s = SimSchedule("t", pipelining=True, fusion="layerwise", placement="replicated")
    cl = Cluster(2, AlphaBeta(1.0, 0.0), AlphaBeta(0.5, 0.0), AlphaBeta(0.5, 0.0), INV, overlap_slowdown=1.0)
    tl = simulate(WORK, cl, s)
    comm = [(e.start, e.end) for e in tl.events if e.resource == "comm"]
    assert comm == [(1.5, 2.5), (3.5, 4.5), (6.25, 7.25), (9.0, 10.0), (10.0, 10.5)]
    assert tl.total == pytest.approx(11.5)
    # the 1.5 s that compute lost to the slowdown counts as exposed factor communication (1.0 without it)
    assert tl.breakdown["FactorComm"] == pytest.approx(2.5)
    assert tl.breakdown["FF&BP"] == 6.0 and tl.breakdown["FactorComp"] == 1.5
    free = simulate(WORK, Cluster(2, AlphaBeta(1.0, 0.0), AlphaBeta(0.5, 0.0), AlphaBeta(0.5, 0.0), INV), s)
    assert free.total == pytest.approx(10.0)
    # not pipelined: nothing overlaps compute, the slowdown changes nothing
    flat = SimSchedule("u", pipelining=False, fusion="all", placement="replicated")
    assert simulate(WORK, cl, flat).total == pytest.approx(simulate(WORK, free_cluster(), flat).total)


def free_cluster() -> Cluster:
    return Cluster(2, AlphaBeta(1.0, 0.0), AlphaBeta(0.5, 0.0), AlphaBeta(0.5, 0.0), INV)


# ResNet-50 in the fast suite; the three larger models (about 40 s together) with the slow tests.
@pytest.mark.parametrize("model", ["resnet50", *(pytest.param(m, marks=pytest.mark.slow)
                                               for m in ("resnet152", "densenet201", "inception_v4"))])
def test_lower_bound_is_below_every_schedule(model):
    """Timeline.lower_bound is a true lower bound for every named schedule on the paper's four models,
    under the default network and under the other network models (compute slowdown, textbook broadcast,
    tree all-reduce at 256 GPUs)."""
    case = paper_case(model)
    nets = [(case.workload, case.cluster),
            (case.workload, paper_case(model, overlap_slowdown=0.5, broadcast="chain", two_level=True).cluster),
            case.at_world(256, two_level=True, algorithm="tree")]
    for work, cl in nets:
        for name in SIM_SCHEDULES:
            tl = simulate(work, cl, name, rank_events=0)
            assert tl.lower_bound <= tl.total + 1e-12, (model, cl.name, name, tl.lower_bound, tl.total)
            if SIM_SCHEDULES[name].dpkfac != "local":  # (local factors: a rank computes its own layers' only)
                assert tl.lower_bound >= work.ff_bp + work.factor_comp  # never below the compute stream alone


def test_compare_phases_flags_misses():
    paper = PAPER_BREAKDOWN["resnet50"]["mpd"]
    same = dict(zip(("FF&BP", "GradComm", "FactorComp", "FactorComm", "InvComp", "InvComm"), paper[:6]),
                Precondition=0.0)
    cmp = compare_phases("resnet50", "mpd", same)
    assert not any(c["miss"] for c in cmp.values()) and cmp["total"]["ratio"] == pytest.approx(1.0, abs=1e-3)
    low = {**same, "FactorComm": paper[3] * 0.74}  # 26% under: a phase miss; total 0.044 s under (5.8%): not
    cmp = compare_phases("resnet50", "mpd", low)
    assert cmp["FactorComm"]["miss"] and not cmp["total"]["miss"]
    dk = dict(zip(same, PAPER_BREAKDOWN["resnet50"]["dkfac"][:6]), Precondition=0.0)
    assert compare_phases("resnet50", "dkfac", dk)["InvComm"] == {"sim": 0.0, "paper": 0.0, "ratio": None,
                                                                   "miss": False}


@pytest.mark.parametrize("model", [
    pytest.param("resnet50", marks=pytest.mark.xfail(strict=True, reason=(
        "reversed on ResNet-50: layer-wise 0.090 s vs none 0.115 s exposed (paper 0.206 vs 0.170). Its 108 factors "
        "add only 0.100 s of start-up at the fitted alpha; layer-wise is slower from alpha = 1.75 ms (1.89x the "
        "fit), or with compute at half speed under communication (0.142 vs 0.115 s). benchmarks/paper_table.py, "
        "section 3b"))),
    "resnet152", "densenet201", "inception_v4",
])
def test_layerwise_pipelining_slower_than_none(model):
    """The paper's ablation: one all-reduce per factor as soon as it is ready is slower than no pipelining
    (every factor, G included, in 64 MiB buckets after backward: the paper's "no pipelining" figures equal
    its D-KFAC/MPD FactorComm)."""
    case = paper_case(model)
    none = with_schedule("spd-paper-no-pipelining", fuse_g=True)
    n, lw = (simulate(case.workload, case.cluster, s, rank_events=0).breakdown["FactorComm"]
             for s in (none, "spd-paper-layerwise"))
    assert lw > n, (n, lw)


_FIT_GAP = ("the paper's all-reduces ran at 2.15 ns/element against its fit's 1.43 (D-KFAC: 77.0 M elements in "
            "5 x 64 MiB, 0.115 s modelled vs 0.170 s measured; its measured GradComm shows the same gap, x0.62)")
_SMALL = ("factors n < 1024 are 69% of ResNet-50's factors but 13% of the modelled inversion time (the model is "
          "fitted to the D-KFAC sums, where large factors dominate); the paper's small inversions cost more")


@pytest.mark.parametrize("sim_name, phase", [
    pytest.param("dkfac", "FactorComm", marks=pytest.mark.xfail(strict=True, reason="0.68: " + _FIT_GAP)),
    pytest.param("mpd", "FactorComm", marks=pytest.mark.xfail(strict=True, reason="0.68: " + _FIT_GAP)),
    pytest.param("mpd", "InvComp", marks=pytest.mark.xfail(strict=True, reason="0.75 (0.038 vs 0.051 s): " + _SMALL)),
    pytest.param("mpd", "InvComm", marks=pytest.mark.xfail(strict=True, reason=(
        "1.29 (0.173 vs 0.134 s): broadcasts costed as the fitted all-reduce (the default); with the textbook "
        "chain broadcast it is 0.35, so the paper's broadcasts cost between the two"))),
    pytest.param("spd-paper", "FactorComm", marks=pytest.mark.xfail(strict=True, reason="0.62: " + _FIT_GAP)),
    pytest.param("spd-paper", "InvComp", marks=pytest.mark.xfail(strict=True, reason="0.70: " + _SMALL)),
    ("spd-paper", "InvComm"),
])
def test_resnet50_predicted_phases_within_25_percent(sim_name, phase):
    """The phases the simulation predicts (not the calibration inputs FF&BP, GradComm, FactorComp and the
    D-KFAC InvComp), each against the issue's 25% band; misses are marked with their measured cause."""
    case = paper_case("resnet50")
    cmp = compare_phases("resnet50", sim_name, simulate(case.workload, case.cluster, sim_name).breakdown)
    assert not cmp[phase]["miss"], cmp[phase]
