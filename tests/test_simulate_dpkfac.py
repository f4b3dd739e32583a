"""DP-KFAC in the simulator (lightning_spdkfac.simulate.schedules.dpkfac): exact timelines of a 2-layer, 2-GPU case
computed by hand, the local-factor variant, the lower bound, the memory model, and the option checks."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_spdkfac.schedule import (
    AlphaBeta,
    InverseCost,
    Placement,
    layer_state_bytes,
    plan_layer_placement,
)
from lightning_spdkfac.simulate import (
    CATEGORIES,
    Cluster,
    LayerSpec,
    LayerTimes,
    SimSchedule,
    Workload,
    simulate,
)
from lightning_spdkfac.simulate.cluster import half_allreduce
from lightning_spdkfac.simulate.memory import memory_per_gpu
from lightning_spdkfac.simulate.sim_schedule import SIM_SCHEDULES, with_schedule

# layer 0: A 2x2, G 3x3; layer 1: A 4x4, G 2x2. Forward 1 s, backward 2 s, each factor 0.5 s.
LAYERS = (LayerSpec("l0", 2, 3, 1, 1.0, 6), LayerSpec("l1", 4, 2, 1, 1.0, 8))
TIMES = (LayerTimes(1.0, 2.0, 0.5, 0.5), LayerTimes(1.0, 2.0, 0.5, 0.5))
WORK = Workload("tiny", LAYERS, TIMES, batch_size=1, grad_comm=1.0)
INV = InverseCost(c3=0.01)  # inv(2) = 0.08, inv(3) = 0.27, inv(4) = 0.64


def _cluster(world: int = 2) -> Cluster:
    """All-reduce 1 + 0.1/B, broadcast 0.5 + 0.01/B; a reduce is half the all-reduce, 0.5 + 0.05/B (set
    explicitly where the cluster models reduce-scatter and all-gather itself)."""
    c = Cluster(world, AlphaBeta(1.0, 0.1), AlphaBeta(0.5, 0.01), AlphaBeta(9.0, 9.0), INV)
    names = {f.name for f in dataclasses.fields(c)}
    half = {n: AlphaBeta(0.5, 0.05) for n in ("reduce_scatter", "allgather") if n in names}
    return dataclasses.replace(c, **half) if half else c


LAYERWISE = with_schedule("dpkfac-turns", name="dpkfac-layerwise", fusion="layerwise")


def _comm(tl) -> list[tuple[str, float, float]]:
    return [(e.label, round(e.start, 9), round(e.end, 9)) for e in tl.events if e.resource == "comm"]


def test_owners_are_the_runtime_planners():
    # cost l0: 0.08 + 0.27 + 0.01 * 2*2*3*5 = 0.95; l1: 0.64 + 0.08 + 0.01 * 2*4*2*6 = 1.68 -> l1 on rank 0
    assert half_allreduce(_cluster(), "reduce_scatter") == AlphaBeta(0.5, 0.05)
    tl = simulate(WORK, _cluster(), LAYERWISE)
    lp = tl.extra["layer_placement"]
    assert lp == plan_layer_placement([(2, 3), (4, 2)], 2, INV) and lp.owners == (1, 0)
    assert tl.order == [(0, "A"), (1, "A"), (1, "G"), (0, "G")] and tl.owners == (1, 0, 0, 1)


def test_exact_timeline_reduce():
    """A0 ready 1.5, A1 3.0, G1 5.5, G0 8.0; reduces (0.5 + 0.05/B of 12, 40, 12, 24 bytes: 1.1, 2.5, 1.1,
    1.7); gradient 9.7 -> 10.7; rank 0 inverts l1 (0.72) to 11.42, rank 1 l0 (0.35) to 11.05; broadcasts in
    turns (rank 0's l1, 32 B: 0.82, then rank 1's l0, 24 B: 0.74)."""
    tl = simulate(WORK, _cluster(), LAYERWISE)
    assert _comm(tl) == [
        ("factor group 0 (1 factors)", 1.5, 2.6), ("factor group 1 (1 factors)", 3.0, 5.5),
        ("factor group 2 (1 factors)", 5.5, 6.6), ("factor group 3 (1 factors)", 8.0, 9.7),
        ("gradient all-reduce", 9.7, 10.7),
        ("broadcast preconditioned l1", 11.42, 12.24), ("broadcast preconditioned l0", 12.24, 12.98)]
    assert tl.total == pytest.approx(12.98)
    expect = {"FF&BP": 6.0, "GradComm": 1.0, "FactorComp": 2.0, "FactorComm": 1.7, "InvComp": 0.72,
              "InvComm": 0.0, "Precondition": 1.56}
    assert list(tl.breakdown) == list(CATEGORIES)
    assert tl.breakdown == pytest.approx(expect)
    ranks = [(e.resource, e.label, round(e.start, 9), round(e.end, 9)) for e in tl.events if e.resource != "comm"
             and e.resource != "compute"]
    assert ranks[:2] == [("rank 0", "invert l1:A", 10.7, 11.34), ("rank 0", "invert l1:G", 11.34, 11.42)]
    # bound: 9 (compute + gradient) + max(l1's chain 0.72 + 0.82, l0 done 0.35 then both broadcasts 1.56)
    assert tl.extra["lower_bound_terms"]["Inversion"] == pytest.approx(0.35)
    assert tl.lower_bound == pytest.approx(9.0 + 0.35 + 1.56) and tl.lower_bound <= tl.total


def test_preconditioning_split_by_flops():
    """Workload.precondition 1.56 s split by 2ag(a+g) = 60 and 96 flops: 0.6 s for l0, 0.96 s for l1, each on
    its owner before its broadcast."""
    tl = simulate(dataclasses.replace(WORK, precondition=1.56), _cluster(), LAYERWISE)
    assert _comm(tl)[-2:] == [("broadcast preconditioned l1", 12.38, 13.2),
                              ("broadcast preconditioned l0", 13.2, 13.94)]
    assert tl.breakdown["InvComp"] == pytest.approx(0.72)
    assert tl.breakdown["Precondition"] == pytest.approx(0.96 + 1.56)
    assert tl.total == pytest.approx(13.94)


def test_local_factors():
    """Rank 0 (tie on factor time, lower rank) computes only l1's factors: compute ends at 7; nothing is
    reduced; gradient 7 -> 8; by predicted finish l0 (done 8.35) is broadcast first, to 9.09, then l1 (done 8.72)
    to 9.91."""
    tl = simulate(WORK, _cluster(), "dpkfac-local")
    assert _comm(tl) == [("gradient all-reduce", 7.0, 8.0), ("broadcast preconditioned l0", 8.35, 9.09),
                         ("broadcast preconditioned l1", 9.09, 9.91)]
    assert tl.breakdown == pytest.approx({"FF&BP": 6.0, "GradComm": 1.0, "FactorComp": 1.0, "FactorComm": 0.0,
                                          "InvComp": 0.72, "InvComm": 0.0, "Precondition": 1.19})
    assert tl.groups == ()


def test_one_gpu_inverts_everything_and_sends_nothing():
    tl = simulate(WORK, _cluster(1), "dpkfac")
    assert _comm(tl) == [("gradient all-reduce", 8.0, 9.0)] and tl.groups == ()  # the measured gradient time
    assert tl.total == pytest.approx(8.0 + 1.0 + 0.35 + 0.72)  # the workload's measured gradient time stays


def test_memory_per_gpu():
    s0, s1 = layer_state_bytes(2, 3), layer_state_bytes(4, 2)  # (2*4 + 2*9) * 4 = 104, (2*16 + 2*4) * 4 = 160
    assert (s0, s1) == (104, 160)
    model = 3 * 4 * 14  # parameters, gradients, momentum in fp32
    buffers = (3 + 10 + 3 + 6) * 4  # the fused factor triangles
    dp = memory_per_gpu(WORK, simulate(WORK, _cluster(), LAYERWISE))
    assert dp == {"model": model, "kfac_state": 160, "buffers": buffers, "total": model + 160 + buffers}
    local = memory_per_gpu(WORK, simulate(WORK, _cluster(), "dpkfac-local"))
    assert local["kfac_state"] == 160 and local["buffers"] == 0
    repl = with_schedule("spd", name="spd-replicated", placement="replicated", fusion="layerwise")
    full = memory_per_gpu(WORK, simulate(WORK, _cluster(), repl))
    assert full == {"model": model, "kfac_state": 264, "buffers": buffers, "total": model + 264 + buffers}
    # async inverses hold a second copy of every inverse (n x n fp32: (4 + 16 + 4 + 9) * 4 = 132)
    asyn = memory_per_gpu(WORK, simulate(WORK, _cluster(), dataclasses.replace(repl, async_inverses=True)))
    assert asyn["kfac_state"] == 264 + 132


def test_named_schedules_and_option_checks():
    assert SIM_SCHEDULES["dpkfac"].dpkfac == "reduce" and SIM_SCHEDULES["dpkfac-local"].dpkfac == "local"
    with pytest.raises(ValueError, match="dpkfac='reduce' excludes async_inverses"):
        SimSchedule("x", dpkfac="reduce", async_inverses=True)
    with pytest.raises(ValueError, match="dpkfac='local' excludes factor_comm='dear'"):
        SimSchedule("x", dpkfac="local", factor_comm="dear")
    with pytest.raises(ValueError, match="dpkfac must be one of"):
        SimSchedule("x", dpkfac="yes")
    with pytest.raises(ValueError, match="placement must be None with schedule 'dpkfac'"):
        simulate(WORK, _cluster(), "dpkfac", placement=Placement((0, 0, 0, 0), "round_robin", (0.0, 0.0)))


def test_finish_order():
    """By predicted finish (the runtime's order), l0 (done 11.05) goes first: 11.05 -> 11.79, then l1 (done 11.42)
    11.79 -> 12.61; owners taking turns give 12.98 (test_exact_timeline_reduce)."""
    tl = simulate(WORK, _cluster(), with_schedule("dpkfac", name="f", fusion="layerwise"))
    assert _comm(tl)[-2:] == [("broadcast preconditioned l0", 11.05, 11.79),
                              ("broadcast preconditioned l1", 11.79, 12.61)]
    assert tl.breakdown["InvComp"] == pytest.approx(0.72) and tl.breakdown["Precondition"] == pytest.approx(1.19)
    assert SIM_SCHEDULES["dpkfac"].broadcast_order == "finish"
    assert SIM_SCHEDULES["dpkfac-turns"].broadcast_order == "owner_turns"
