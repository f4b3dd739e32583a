"""The cluster simulator: hand-computed timelines of two layers on two ranks, the layer profile read
from real modules, the collective models, and the paper-reproduction band for ResNet-50."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_spdkfac.schedule import AlphaBeta, InverseCost
from lightning_spdkfac.simulate import (
    Cluster,
    LayerSpec,
    LayerTimes,
    SimSchedule,
    Workload,
    profile_layers,
    simulate,
    with_schedule,
)
from lightning_spdkfac.simulate.cluster import chain_collective, ring_allreduce

# Two layers: forward 1 s, backward 2 s, A factor 0.5 s, G factor 0.25 s each. Compute stream:
#   fwd L0 [0,1]  A0 [1,1.5]  fwd L1 [1.5,2.5]  A1 [2.5,3]  bwd L1 [3,5]  G1 [5,5.25]  bwd L0 [5.25,7.25]  G0 [7.25,7.5]
# Factor order (ready order): (0,A)@1.5, (1,A)@3, (1,G)@5.25, (0,G)@7.5.
SPECS = (LayerSpec("l0", 4, 2, 1, 1.0, 10), LayerSpec("l1", 3, 1, 1, 1.0, 4))
TIMES = (LayerTimes(1.0, 2.0, 0.5, 0.25),) * 2
WORK = Workload("two", SPECS, TIMES, batch_size=1, grad_comm=0.5)


def cluster(alpha: float, world: int = 2, inv: float = 0.25, bcast: float = 0.5) -> Cluster:
    """Every message costs ``alpha`` seconds whatever its size; every inversion ``inv``."""
    return Cluster(world, AlphaBeta(alpha, 0.0), AlphaBeta(bcast, 0.0), AlphaBeta(bcast, 0.0), InverseCost(c0=inv))


def comm_events(tl):
    return [(e.label, e.start, e.end) for e in tl.events if e.resource == "comm"]


def test_layerwise_pipelined_replicated_event_by_event():
    s = SimSchedule("t", pipelining=True, fusion="layerwise", placement="replicated")
    tl = simulate(WORK, cluster(1.0), s)
    assert tl.groups == ((0,), (1,), (2,), (3,))
    assert tl.order == [(0, "A"), (1, "A"), (1, "G"), (0, "G")]
    assert comm_events(tl) == [
        ("factor group 0 (1 factors)", 1.5, 2.5),
        ("factor group 1 (1 factors)", 3.0, 4.0),
        ("factor group 2 (1 factors)", 5.25, 6.25),
        ("factor group 3 (1 factors)", 7.5, 8.5),
        ("gradient all-reduce", 8.5, 9.0),
    ]
    # both ranks invert all four factors after the channel is free at 9.0
    inv = [(e.resource, e.start, e.end) for e in tl.events if e.category == "InvComp"]
    assert inv == [(f"rank {r}", 9.0 + 0.25 * k, 9.25 + 0.25 * k) for r in range(2) for k in range(4)]
    assert tl.breakdown == {"FF&BP": 6.0, "GradComm": 0.5, "FactorComp": 1.5, "FactorComm": 1.0,
                            "InvComp": 1.0, "InvComm": 0.0, "Precondition": 0.0}
    assert tl.total == pytest.approx(10.0)


def test_not_pipelined_reduces_after_backward():
    s = SimSchedule("t", pipelining=False, fusion="all", placement="replicated")
    tl = simulate(WORK, cluster(1.0), s)
    assert comm_events(tl) == [("factor group 0 (4 factors)", 7.5, 8.5), ("gradient all-reduce", 8.5, 9.0)]
    assert tl.breakdown["FactorComm"] == pytest.approx(1.0)


def test_dtf_merges_when_waiting_costs_less_than_alpha():
    """alpha = 2: (0,A) would start at 1.5 and (1,A) is ready 1.5 s later (< alpha): merged. The next
    gap, 5.25 - 3 = 2.25, is not shorter than alpha: the group closes and runs 3 -> 5; then (1,G) alone
    (7.5 - 5.25 >= 2) and (0,G) alone."""
    s = SimSchedule("t", pipelining=True, fusion="dtf", placement="replicated")
    tl = simulate(WORK, cluster(2.0), s)
    assert tl.groups == ((0, 1), (2,), (3,))
    assert comm_events(tl) == [
        ("factor group 0 (2 factors)", 3.0, 5.0),
        ("factor group 1 (1 factors)", 5.25, 7.25),
        ("factor group 2 (1 factors)", 7.5, 9.5),
        ("gradient all-reduce", 9.5, 10.0),
    ]
    assert tl.breakdown["FactorComm"] == pytest.approx(10.0 - 7.5 - 0.5)


def test_synchronize_before_launch_stalls_compute():
    """The original code's device synchronize: (1,A) is ready at 3 but group 0 is on the wire until
    3.5, so compute stalls 0.5 s; everything after shifts by 0.5."""
    s = SimSchedule("t", pipelining=True, fusion="layerwise", placement="replicated", sync_before_launch=True)
    tl = simulate(WORK, cluster(2.0), s)
    stalls = [(e.start, e.end) for e in tl.events if e.label == "synchronize (stall)"]
    assert stalls == [(3.0, 3.5)]
    assert comm_events(tl) == [
        ("factor group 0 (1 factors)", 1.5, 3.5),
        ("factor group 1 (1 factors)", 3.5, 5.5),
        ("factor group 2 (1 factors)", 5.75, 7.75),
        ("factor group 3 (1 factors)", 8.0, 10.0),
        ("gradient all-reduce", 10.0, 10.5),
    ]
    # exposed factor communication = the stall (0.5) + what ran after backward (10.0 - 8.0)
    assert tl.breakdown["FactorComm"] == pytest.approx(2.5)
    assert tl.total == pytest.approx(10.5 + 1.0)


def test_round_robin_placement_and_broadcasts():
    """Owners [0, 1, 0, 1] by position; each rank inverts its two (0.25 s each) from 9.0; the four
    broadcasts (0.5 s each) share the channel in ready order: 9.25, 9.75, 10.25, 10.75 -> end 11.25."""
    s = SimSchedule("t", pipelining=True, fusion="layerwise", placement="round_robin")
    tl = simulate(WORK, cluster(1.0), s)
    assert tl.owners == (0, 1, 0, 1)
    bc = [(e.label, e.start, e.end) for e in tl.events if e.category == "InvComm"]
    assert bc == [
        ("broadcast (0, 'A')", 9.25, 9.75),
        ("broadcast (1, 'A')", 9.75, 10.25),
        ("broadcast (1, 'G')", 10.25, 10.75),
        ("broadcast (0, 'G')", 10.75, 11.25),
    ]
    assert tl.breakdown["InvComp"] == pytest.approx(0.5)
    assert tl.breakdown["InvComm"] == pytest.approx(11.25 - 9.5)
    assert tl.total == pytest.approx(11.25)


def test_one_gpu_has_no_communication():
    tl = simulate(WORK, cluster(1.0, world=1), "spd")
    assert comm_events(tl) == [("gradient all-reduce", 7.5, 8.0)]  # the workload's measured grad_comm
    assert tl.breakdown["FactorComm"] == 0.0 and tl.breakdown["InvComm"] == 0.0


def test_bf16_halves_message_bytes():
    work = Workload("two", SPECS, TIMES, batch_size=1, grad_comm=0.0)
    per_byte = Cluster(2, AlphaBeta(0.0, 1.0), AlphaBeta(0.0, 1.0), AlphaBeta(0.0, 1.0), InverseCost(c0=0.25))
    fp32 = simulate(work, per_byte, SimSchedule("a", pipelining=False, fusion="all", placement="replicated"))
    bf16 = simulate(work, per_byte, SimSchedule("b", pipelining=False, fusion="all", placement="replicated",
                                               bytes_per_element=2))
    # triangles: 10 + 3 + 6 + 1 = 20 elements
    assert comm_events(fp32)[0][2] - comm_events(fp32)[0][1] == pytest.approx(80.0)
    assert comm_events(bf16)[0][2] - comm_events(bf16)[0][1] == pytest.approx(40.0)


def test_profile_layers_reads_a_real_module():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 5, 3, stride=2, bias=False),
                          nn.Flatten(), nn.Linear(5 * 3 * 3, 10))
    specs = profile_layers(model, (3, 8, 8))
    assert [s.name for s in specs] == ["0", "2", "4"]
    assert [(s.a_side, s.g_side, s.rows) for s in specs] == [(28, 4, 64), (36, 5, 9), (46, 10, 1)]
    assert specs[0].forward_flops == 2 * 64 * 4 * 27
    assert specs[1].forward_flops == 2 * 9 * 5 * 36
    assert specs[2].params == 45 * 10 + 10
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))
    assert [(s.a_side, s.g_side) for s in profile_layers(meta, (5, 8))] == [(9, 8), (9, 3)]
    assert profile_layers(meta, (5, 8))[0].rows == 5


def test_calibrated_workload_adds_up_to_the_totals():
    w = Workload.calibrated("x", SPECS, 4, ff_bp=3.0, factor_comp=1.2)
    assert w.ff_bp == pytest.approx(3.0) and w.factor_comp == pytest.approx(1.2)
    # factor time in proportion to rows * n^2: A sides 4, 3 and G sides 2, 1 -> 16 : 9 : 4 : 1
    assert [t.a_factor for t in w.times] == pytest.approx([1.2 * 16 / 30, 1.2 * 9 / 30])
    assert w.with_batch(8).ff_bp == pytest.approx(6.0)


def test_ring_collectives_and_fit_round_trip():
    assert ring_allreduce(4, 1.0, 2.0) == AlphaBeta(6.0, 3.0)
    assert chain_collective(4, 1.0, 2.0) == AlphaBeta(3.0, 2.0)
    fit = AlphaBeta(9.29e-4, 1.4335e-9 / 4)
    c = Cluster.from_fit(fit, 64, 64, InverseCost())
    assert c.allreduce.alpha == pytest.approx(fit.alpha) and c.allreduce.beta == pytest.approx(fit.beta)
    big = Cluster.from_fit(fit, 64, 1024, InverseCost())
    assert big.allreduce.alpha == pytest.approx(fit.alpha * 1023 / 63)
    hier = Cluster.ring(8, 1.0, 4.0, InverseCost(), gpus_per_node=4, intra_alpha=0.5, intra_beta=1.0)
    # intra reduce-scatter + all-gather: 2 * 3 * 0.5 latency, 2 * 3/4 * 1.0 per byte; inter ring over 2 nodes
    # of a quarter of the message: 2 * 1 * 1.0 latency, 2 * 1/2 * 4.0/4 per byte
    assert hier.allreduce == AlphaBeta(3.0 + 2.0, 1.5 + 1.0)


def test_bad_input_names_the_argument():
    """The package rule: a wrong value is a ValueError, a wrong type a TypeError, and the message names the
    argument and the value."""
    with pytest.raises(ValueError, match="schedule must be one of .*got 'nope'"):
        simulate(WORK, cluster(1.0), "nope")
    with pytest.raises(TypeError, match="schedule must be a SimSchedule or one of .*got int 3"):
        simulate(WORK, cluster(1.0), 3)
    with pytest.raises(TypeError, match="workload must be a Workload"):
        simulate(SPECS, cluster(1.0), "spd")
    with pytest.raises(TypeError, match="cluster must be a Cluster"):
        simulate(WORK, None, "spd", rank_events=None)
    with pytest.raises(TypeError, match="rank_events must be"):
        simulate(WORK, cluster(1.0), "spd", rank_events=1.5)
    with pytest.raises(ValueError, match="base must be one of"):
        with_schedule("nope")
    with pytest.raises(ValueError, match="batch_size"):
        Workload("x", SPECS, TIMES, batch_size=0)
    with pytest.raises(ValueError, match="layers and times must have the same length, got 2 and 1"):
        Workload("x", SPECS, TIMES[:1], batch_size=1)
    with pytest.raises(TypeError, match=r"times\[0\] must be a LayerTimes"):
        Workload("x", SPECS, (1.0, 2.0), batch_size=1)
    with pytest.raises(ValueError, match="world_size"):
        Cluster.ring(0, 1.0, 1.0, InverseCost())
    with pytest.raises(TypeError, match="world_size must be an integer"):
        Cluster.ring(2.0, 1.0, 1.0, InverseCost())
    with pytest.raises(TypeError, match="inverse must be an InverseCost"):
        Cluster.ring(2, 1.0, 1.0, 0.5)
    with pytest.raises(TypeError, match="fit must be an AlphaBeta"):
        Cluster.from_fit((1.0, 1.0), 64, 8, InverseCost())
    with pytest.raises(ValueError, match="input_shape"):
        profile_layers(nn.Linear(2, 2), ())
    with pytest.raises(TypeError, match=r"input_shape\[1\] must be an integer"):
        profile_layers(nn.Linear(2, 2), (1, "2"))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        profile_layers("net", (2,))


@pytest.mark.parametrize("field, value, error", [
    ("fusion", "dtf2", ValueError), ("fusion", None, TypeError), ("placement", "lpb", ValueError),
    ("pipelining", 1, TypeError), ("bucket_mb", 0.0, ValueError), ("bucket_mb", "64", TypeError),
    ("lbp_metric", "cubic", ValueError), ("small_factor", 1024.0, TypeError), ("bytes_per_element", 0, ValueError),
])
def test_sim_schedule_checks_its_fields(field, value, error):
    """Fusion and placement names are the runtime's (lightning_spdkfac.vocabulary)."""
    with pytest.raises(error, match=f"{field} must be"):
        SimSchedule("t", **{field: value})


def test_paper_names_are_checked():
    from lightning_spdkfac.simulate.paper import model_specs, paper_case

    with pytest.raises(ValueError, match="name must be one of .*got 'resnet9'"):
        model_specs("resnet9")
    with pytest.raises(TypeError, match="name must be one of"):
        model_specs(50)
    with pytest.raises(ValueError, match="grad_comm must be one of 'paper', 'model', got 'measured'"):
        paper_case("resnet50", grad_comm="measured")


@pytest.mark.parametrize("sim_name, paper_name", [
    ("dkfac", "dkfac"),
    ("mpd", "mpd"),
    pytest.param("spd-paper", "spd", marks=pytest.mark.xfail(strict=True, reason=(
        "measured miss, not a widened band: 0.607 s simulated vs the paper's 0.6755 s, 0.898 (10.2% under). "
        "Per phase (benchmarks/paper_table.py, per-phase table): FactorComm 0.62 (the paper's all-reduces ran "
        "at 2.15 ns/element against the fit's 1.43, the same 1.5x gap its D-KFAC FactorComm and measured "
        "GradComm show), InvComp 0.70 (factors n < 1024 are 69% of the count but 13% of the modelled inversion "
        "time, while the paper's SPD InvComp is 38% of its D-KFAC one)"))),
])
def test_resnet50_paper_row_within_ten_percent(sim_name, paper_name):
    """The fast guard on the paper reproduction (benchmarks/paper_table.py prints all four models): the
    issue's 10% band on the total, for every algorithm. SPD-KFAC misses it and is marked so (strict: it
    fails loudly the day it passes)."""
    from lightning_spdkfac.simulate.paper import PAPER_BREAKDOWN, paper_case

    case = paper_case("resnet50")
    total = simulate(case.workload, case.cluster, sim_name).total
    paper = PAPER_BREAKDOWN["resnet50"][paper_name][-1]
    assert abs(total / paper - 1) <= 0.10, (sim_name, total, paper)


def test_rank_events_and_chrome_trace():
    s = SimSchedule("t", pipelining=True, fusion="layerwise", placement="replicated")
    full = simulate(WORK, cluster(1.0), s, rank_events=None)
    one = simulate(WORK, cluster(1.0), s, rank_events=1)
    assert {e.resource for e in full.events} == {"compute", "comm", "rank 0", "rank 1"}
    assert {e.resource for e in one.events} == {"compute", "comm", "rank 0"}
    assert one.breakdown == full.breakdown
    trace = full.chrome_trace()["traceEvents"]
    spans = [t for t in trace if t["ph"] == "X"]
    assert len(spans) == len(full.events)
    g0 = next(t for t in spans if t["name"] == "factor group 0 (1 factors)")
    assert (g0["ts"], g0["dur"]) == (1.5e6, 1.0e6)
