"""DeAR-style factor communication (simulate.schedules.dear) and the async-period placement
(simulate.schedules.async_plan, schedule.placement.owned_prefix_candidates): exact timelines of a 2-layer, 2-GPU case computed by hand."""

from __future__ import annotations

import dataclasses

import pytest
from test_simulate_dpkfac import WORK, _cluster

from lightning_spdkfac.schedule import REPLICATED, AlphaBeta, InverseCost
from lightning_spdkfac.schedule.placement import owned_prefix_candidates
from lightning_spdkfac.simulate import SimSchedule, simulate
from lightning_spdkfac.simulate.paper import paper_case
from lightning_spdkfac.simulate.schedules.dear import dear_models
from lightning_spdkfac.simulate.sim_schedule import with_schedule

R = REPLICATED


def _comm(tl) -> list[tuple[str, float, float]]:
    return [(e.label, round(e.start, 9), round(e.end, 9)) for e in tl.events if e.resource == "comm"]


def test_dear_exact_timeline():
    """Every factor alone (layerwise), every rank inverts all (replicated): the previous step's all-gathers
    (0.5 + 0.05/B of 12, 40, 12, 24 bytes) fill the channel from 0 to 6.4, so the reduce-scatters (same cost)
    queue behind them; the gradient all-reduce ends at 13.8 and the four inversions (1.07 s) at 14.87."""
    cluster = _cluster()
    assert dear_models(cluster) == (AlphaBeta(0.5, 0.05), AlphaBeta(0.5, 0.05))
    s = with_schedule("spd-dear", name="dear-small", fusion="layerwise", placement="replicated")
    tl = simulate(WORK, cluster, s)
    assert _comm(tl) == [
        ("all-gather factor group 0 (previous step)", 0.0, 1.1), ("all-gather factor group 1 (previous step)", 1.1, 3.6),
        ("all-gather factor group 2 (previous step)", 3.6, 4.7), ("all-gather factor group 3 (previous step)", 4.7, 6.4),
        ("factor group 0 (1 factors)", 6.4, 7.5), ("factor group 1 (1 factors)", 7.5, 10.0),
        ("factor group 2 (1 factors)", 10.0, 11.1), ("factor group 3 (1 factors)", 11.1, 12.8),
        ("gradient all-reduce", 12.8, 13.8)]
    assert tl.breakdown == pytest.approx({"FF&BP": 6.0, "GradComm": 1.0, "FactorComp": 2.0, "FactorComm": 4.8,
                                          "InvComp": 1.07, "InvComm": 0.0, "Precondition": 0.0})
    # the same with all-reduces (1 + 0.1/B: 2.2, 5, 2.2, 3.4 from 1.5, 3.7, 8.7, 10.9): 16.37 s
    spd = simulate(WORK, cluster, dataclasses.replace(s, name="ar-small", factor_comm="allreduce"))
    assert spd.total == pytest.approx(16.37) and tl.total == pytest.approx(14.87)
    assert tl.lower_bound == spd.lower_bound == pytest.approx(9.0 + 0.64)


def test_dear_option_checks():
    with pytest.raises(ValueError, match="factor_comm must be one of"):
        SimSchedule("x", factor_comm="ring")
    with pytest.raises(ValueError, match="factor_comm='dear' excludes async_inverses"):
        SimSchedule("x", factor_comm="dear", async_inverses=True)
    with pytest.raises(ValueError, match="async_placement='period' needs async_inverses=True"):
        SimSchedule("x", async_placement="period")


def test_owned_prefix_candidates():
    """Sides 4, 2, 3 (inversions 0.64, 0.08, 0.27), broadcasts 0.1 s: owner costs 0.74, 0.18, 0.37, so LPT
    puts factor 0 on rank 0, then 2 and 1 on rank 1; candidate k owns the k largest."""
    c = owned_prefix_candidates([4, 2, 3], 2, InverseCost(c3=0.01), AlphaBeta(0.1, 0.0))
    assert [p.owners for p in c] == [(R, R, R), (0, R, R), (0, R, 1), (0, 1, 1)]
    assert [x for p in c for x in p.load] == pytest.approx([0.99, 0.99, 1.09, 0.35, 0.82, 0.45, 0.74, 0.55])
    assert [p.owners for p in owned_prefix_candidates([4, 2, 3], 1, InverseCost(c3=0.01), AlphaBeta(0.1, 0.0))] \
        == [(R, R, R)]
    small = owned_prefix_candidates([4, 2, 3], 2, InverseCost(c3=0.01), AlphaBeta(0.1, 0.0), small_threshold=3)
    assert [p.owners for p in small] == [(R, R, R), (0, R, R), (0, R, 1)]


def test_async_period_placement_on_resnet50():
    """benchmarks/async_placement.py's figure, now spd-async's own: 0.448 s at 64 GPUs, never slower than
    the runtime's lbp_channel placement (a candidate), within 1% of the bound."""
    case = paper_case("resnet50")
    period = simulate(case.workload, case.cluster, "spd-async", rank_events=0)
    sync = simulate(case.workload, case.cluster, "spd-async-sync-placement", rank_events=0)
    assert period.total == pytest.approx(0.448, abs=0.001) and period.total <= sync.total
    assert period.total <= 1.01 * period.lower_bound
