"""Asynchronous inverses in the cluster simulator (issue 17) and the critical-path lower bound of every
timeline: a hand-computed two-layer, two-GPU period under both compute rules, async never slower than sync
where the model guarantees it, the bound under every simulated time, and ``spdkfac plan`` showing both."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from lightning_spdkfac.comm.scheduler import SPDOptions
from lightning_spdkfac.schedule import REPLICATED, AlphaBeta, InverseCost, Placement
from lightning_spdkfac.simulate import (
    SIM_SCHEDULES,
    Cluster,
    LayerSpec,
    LayerTimes,
    SimSchedule,
    Workload,
    simulate,
)
from lightning_spdkfac.simulate.paper import paper_case
from lightning_spdkfac.simulate.plan import runtime_config
from lightning_spdkfac.simulate.plan_cli import main

MODELS = ("resnet50", "resnet152", "densenet201", "inception_v4")

# Two layers, forward 1 s, backward 2 s, A factor 0.5 s, G factor 0.25 s each; gradient all-reduce 0.5 s.
# Compute stream without anything before it: fwd L0 [0,1] A0 [1,1.5] fwd L1 [1.5,2.5] A1 [2.5,3]
# bwd L1 [3,5] G1 [5,5.25] bwd L0 [5.25,7.25] G0 [7.25,7.5]; factor positions (0,A) (1,A) (1,G) (0,G).
SPECS = (LayerSpec("l0", 4, 2, 1, 1.0, 10), LayerSpec("l1", 3, 1, 1, 1.0, 4))
WORK = Workload("two", SPECS, (LayerTimes(1.0, 2.0, 0.5, 0.25),) * 2, batch_size=1, grad_comm=0.5)
# every reduction 1 s, every broadcast 0.5 s, every inversion 0.25 s, whatever the size; 2 GPUs
CLUSTER = Cluster(2, AlphaBeta(1.0, 0.0), AlphaBeta(0.5, 0.0), AlphaBeta(0.5, 0.0), InverseCost(c0=0.25))


def _schedule(**kw) -> SimSchedule:
    """Layer-wise reductions, round-robin owners (0, 1, 0, 1): every factor is broadcast by its owner."""
    return SimSchedule("t", pipelining=True, fusion="layerwise", placement="round_robin", **kw)


def _comm(tl) -> list[tuple[str, float, float]]:
    return [(e.label, e.start, e.end) for e in tl.events if e.resource == "comm"]


def test_sync_reference_and_its_bound():
    """The synchronous schedule (tests/test_simulate.py has its events): inversions from 9.0 (channel
    free), broadcasts to 11.25. Bound: FF&BP 6 + FactorComp 1.5 + GradComm 0.5 + the largest
    inversion 0.25, all of it after the channel is free."""
    tl = simulate(WORK, CLUSTER, _schedule())
    assert tl.total == pytest.approx(11.25)
    assert tl.extra["lower_bound_terms"] == {"FF&BP": 6.0, "GradComm": 0.5, "FactorComp": 1.5, "Inversion": 0.25,
                                             "Precondition": 0.0}
    assert tl.lower_bound == pytest.approx(8.25)


def test_async_idle_time_by_hand():
    """Inversions in the GPU's idle time: each rank inverts its two factors from the end of backward,
    7.5 -> 8.0, beside the reductions and the gradient all-reduce (channel: groups [1.5,2.5] [3,4]
    [5.25,6.25] [7.5,8.5], gradient [8.5,9]). The broadcasts, in order of predicted finish (0,A) (1,A)
    (1,G) (0,G), queue behind the gradient all-reduce: [9,9.5] ... [10.5,11]. Period 11.0, a quarter
    second under sync (the inversions no longer wait for the channel). Bound: the largest inversion (0.25)
    fits beside the exposed gradient all-reduce (0.5), so 6 + 1.5 + 0.5 = 8.0."""
    tl = simulate(WORK, CLUSTER, _schedule(async_inverses=True, async_compute="idle_time"), rank_events=None)
    inv = sorted((e.resource, e.start, e.end) for e in tl.events if e.category == "InvComp")
    assert inv == [("rank 0", 7.5, 7.75), ("rank 0", 7.75, 8.0), ("rank 1", 7.5, 7.75), ("rank 1", 7.75, 8.0)]
    assert _comm(tl)[-5:] == [
        ("gradient all-reduce", 8.5, 9.0),
        ("broadcast (0, 'A')", 9.0, 9.5),
        ("broadcast (1, 'A')", 9.5, 10.0),
        ("broadcast (1, 'G')", 10.0, 10.5),
        ("broadcast (0, 'G')", 10.5, 11.0),
    ]
    assert tl.breakdown == {"FF&BP": 6.0, "GradComm": 0.5, "FactorComp": 1.5, "FactorComm": 1.0,
                            "InvComp": 0.0, "InvComm": 2.0, "Precondition": 0.0}
    assert tl.total == pytest.approx(11.0)
    assert tl.lower_bound == pytest.approx(8.0)


def test_async_before_forward_by_hand():
    """The previous step's inversions first: each rank inverts 0 -> 0.5 and forward starts at 0.5. The
    broadcasts go on the idle channel at once: [0.25,0.75] [0.75,1.25] [1.25,1.75] [1.75,2.25]. Compute
    is the sync stream shifted by 0.5: (0,A) ready at 2.0 but its reduction waits for the last broadcast
    (2.25 -> 3.25); then (1,A) 3.5 -> 4.5, (1,G) 5.75 -> 6.75, (0,G) 8.0 -> 9.0, gradient 9.0 -> 9.5.
    Period 9.5. The 0.5 s before forward is InvComp; the reductions' exposure stays 1.0. Bound: the
    largest inversion is before forward, so all of it counts: 8.25."""
    tl = simulate(WORK, CLUSTER, _schedule(async_inverses=True))
    assert _comm(tl) == [
        ("broadcast (0, 'A')", 0.25, 0.75),
        ("broadcast (1, 'A')", 0.75, 1.25),
        ("broadcast (1, 'G')", 1.25, 1.75),
        ("broadcast (0, 'G')", 1.75, 2.25),
        ("factor group 0 (1 factors)", 2.25, 3.25),
        ("factor group 1 (1 factors)", 3.5, 4.5),
        ("factor group 2 (1 factors)", 5.75, 6.75),
        ("factor group 3 (1 factors)", 8.0, 9.0),
        ("gradient all-reduce", 9.0, 9.5),
    ]
    assert tl.extra["broadcast_order"] == [0, 1, 2, 3]
    first = [e for e in tl.events if e.resource == "compute"][0]
    assert (first.category, first.start, first.end) == ("InvComp", 0.0, 0.5)
    assert tl.breakdown == {"FF&BP": 6.0, "GradComm": 0.5, "FactorComp": 1.5, "FactorComm": 1.0,
                            "InvComp": 0.5, "InvComm": 0.0, "Precondition": 0.0}
    assert tl.total == pytest.approx(9.5)
    assert tl.lower_bound == pytest.approx(8.25)


def test_one_gpu_async():
    """One GPU inverts all four factors (1 s): before forward, the period is 1 + 7.5 + 0.5 (gradient);
    in idle time, the inversions run 7.5 -> 8.5 beside the gradient all-reduce (7.5 -> 8.0)."""
    one = Cluster(1, AlphaBeta(1.0, 0.0), AlphaBeta(0.5, 0.0), AlphaBeta(0.5, 0.0), InverseCost(c0=0.25))
    assert simulate(WORK, one, _schedule(async_inverses=True)).total == pytest.approx(9.0)
    idle = simulate(WORK, one, _schedule(async_inverses=True, async_compute="idle_time"))
    assert idle.total == pytest.approx(8.5)
    assert idle.breakdown["InvComp"] == pytest.approx(0.5) and idle.lower_bound == pytest.approx(8.0)


@pytest.mark.parametrize("field, value, error, words", [
    ("async_inverses", 1, TypeError, "async_inverses must be"),
    ("async_inverses", "yes", TypeError, "async_inverses must be"),
    ("async_compute", "eager", ValueError, "async_compute must be one of"),
])
def test_async_fields_are_checked(field, value, error, words):
    with pytest.raises(error, match=words):
        SimSchedule("t", **{field: value})


def test_async_excludes_early_inverse():
    with pytest.raises(ValueError, match="async_inverses and early_inverse exclude each other"):
        SimSchedule("t", async_inverses=True, early_inverse=True)


def test_named_async_schedules():
    for name in ("spd-async", "spd-async-idle", "spd-bf16-async", "mpd-async", "dkfac-async"):
        s = SIM_SCHEDULES[name]
        assert s.async_inverses and s.description
    assert SIM_SCHEDULES["spd-async"].async_compute == "before_forward"
    assert SIM_SCHEDULES["spd-async-idle"].async_compute == "idle_time"


# ResNet-50 in the 10-minute suite, the three larger models in make test-slow (~4-6 s each).
@pytest.mark.parametrize("model", [m if m == "resnet50" else pytest.param(m, marks=pytest.mark.slow) for m in MODELS])
def test_paper_models_at_64_gpus(model):
    """On the calibrated 64-GPU cases: with inversions in idle time, async is never slower than sync (by
    construction: the same inversion phase, started at the end of backward instead of when the channel
    is free, with the channel free at the same time); every schedule's lower bound is under its time."""
    case = paper_case(model)
    runs = {}
    for sync in ("spd", "mpd", "dkfac"):
        idle = replace(SIM_SCHEDULES[sync], name=f"{sync}-idle", async_inverses=True, async_compute="idle_time")
        runs[sync], runs[idle.name] = (simulate(case.workload, case.cluster, s, rank_events=0) for s in (sync, idle))
        assert runs[idle.name].total <= runs[sync].total * (1 + 1e-12), sync
    for name in ("spd-paper", "spd-async", "mpd-async", "spd-early-inverse"):
        runs[name] = simulate(case.workload, case.cluster, name, rank_events=0)
    for name, tl in runs.items():
        assert 0 < tl.lower_bound <= tl.total * (1 + 1e-12), (name, tl.lower_bound, tl.total)


def test_plan_shows_the_bound_and_recommends_async(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert main(["--paper", "resnet50", "--schedules", "spd,spd-async", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "schedule" in line and "total" in line)
    assert header.split()[-3:] == ["total", "bound", "speedup"]
    data = json.loads(path.read_text())
    assert data["recommended"] == "spd-async"
    rows = {r["name"]: r for r in data["schedules"]}
    case = paper_case("resnet50")
    for name, row in rows.items():
        tl = simulate(case.workload, case.cluster, name)
        assert row["lower_bound_s"] == tl.lower_bound and f"{tl.lower_bound * 1e3:.1f}" in out
    marked = next(line for line in out.splitlines() if line.startswith("*"))
    assert "spd-async" in marked
    assert "async_inverses: true" in out and "inverses one step old" in out
    args = dict(data["runtime"]["strategy"]["init_args"])
    assert args["async_inverses"] is True
    assert SPDOptions.from_schedule(args.pop("schedule"), **args).async_inverses is True


def test_runtime_config_of_async_schedules():
    args, notes = runtime_config(SIM_SCHEDULES["spd-async-sync-placement"])
    assert args["async_inverses"] is True and args["schedule"] == "spd" and not notes
    args, notes = runtime_config(SIM_SCHEDULES["spd-async"])  # placement by the async period (issue 19)
    assert args["async_inverses"] is True and args["schedule"] == "spd"
    assert notes == [n for n in notes if "async period" in n] and len(notes) == 1
    assert "async_inverses" not in runtime_config(SIM_SCHEDULES["spd"])[0]
    args, notes = runtime_config(SIM_SCHEDULES["spd-async-idle"])
    assert args["async_inverses"] is True and any("idle time" in n for n in notes)


def test_given_placement():
    """``simulate(..., placement=...)`` runs the owners it is given (benchmarks/async_placement.py): every
    factor replicated puts all four inversions (1 s) on every rank before forward and sends nothing."""
    own = simulate(WORK, CLUSTER, _schedule(async_inverses=True))
    same = simulate(WORK, CLUSTER, _schedule(async_inverses=True),
                    placement=Placement(own.owners, "round_robin", (0.0, 0.0)))
    assert same.total == own.total and same.owners == own.owners
    repl = simulate(WORK, CLUSTER, _schedule(async_inverses=True),
                    placement=Placement((REPLICATED,) * 4, "replicated", (1.0, 1.0)))
    assert repl.total == pytest.approx(1.0 + 7.5 + 1.0 + 0.5)  # last group 8.5 -> 9.5, gradient 9.5 -> 10
    assert not [e for e in repl.events if e.category == "InvComm"]
    with pytest.raises(ValueError, match="placement must be for 2 ranks and 4 factors, got 3 ranks"):
        simulate(WORK, CLUSTER, "spd", placement=Placement((0, 1, 2, 0), "round_robin", (0.0,) * 3))
    with pytest.raises(TypeError, match="placement must be a Placement"):
        simulate(WORK, CLUSTER, "spd", placement=(0, 1, 0, 1))
