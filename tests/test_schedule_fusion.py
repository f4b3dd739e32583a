"""Fusion planner: the paper's dynamic tensor fusion (DTF) and the ablation policies."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_spdkfac.schedule import AlphaBeta, FusionPlan, plan_fusion, simulate_fusion

POLICIES = ("dtf", "layerwise", "all", "bucket")

# alpha = 1 s and 1 s per element (beta = 0.25 s/byte with 4-byte elements): t_c = 1 + elements.
UNIT = AlphaBeta(alpha=1.0, beta=0.25)


def test_dtf_hand_computed() -> None:
    elements = [2, 1, 3, 1, 2]
    ready = [0.0, 0.5, 5.0, 6.0, 8.0]
    # Open group {0}: bytes 2 el, would start at tau = max(free=0, ready 0) = 0.
    # f1 ready 0.5: wait 0.5 - 0 = 0.5 < alpha = 1           -> merge, {0,1} = 3 el, ready 0.5.
    # f2 ready 5:   tau = max(0, 0.5) = 0.5, wait 4.5 >= 1    -> close {0,1}: 0.5 + 1 + 3 = 4.5.
    # f3 ready 6:   tau = max(4.5, 5) = 5, wait 1, not < 1    -> close {2}: 5 + 1 + 3 = 9 (ties do not merge).
    # f4 ready 8:   tau = max(9, 6) = 9 > 8 (cannot start)    -> merge, {3,4} = 3 el, ready 8.
    # End: {3,4} starts max(9, 8) = 9, ends 9 + 1 + 3 = 13.
    plan = plan_fusion(elements, ready, UNIT)
    assert plan.groups == ((0, 1), (2,), (3, 4))
    assert plan.policy == "dtf"
    tl = simulate_fusion(plan, elements, ready, UNIT)
    assert tl.starts == (0.5, 5.0, 9.0)
    assert tl.ends == (4.5, 9.0, 13.0)
    # Layer-wise: f0 [0,3], f1 [3,5], f2 [5,9], f3 [9,11], f4 [11,14] -> 14.
    layerwise = simulate_fusion(plan_fusion(elements, ready, UNIT, "layerwise"), elements, ready, UNIT)
    assert layerwise.ends == (3.0, 5.0, 9.0, 11.0, 14.0)
    # All at once: starts at 8, 1 + 9 elements -> 18.
    assert simulate_fusion(plan_fusion(elements, ready, UNIT, "all"), elements, ready, UNIT).end == 18.0
    # Backward ends at 10: DTF leaves 3 s exposed, layer-wise 4 s.
    assert tl.exposed(after=10.0) == 3.0 and layerwise.exposed(after=10.0) == 4.0
    assert tl.exposed(after=20.0) == 0.0


def test_dtf_no_merge_with_large_gaps() -> None:
    elements, ready = [3, 5, 1, 2], [0.0, 100.0, 200.0, 300.0]
    assert plan_fusion(elements, ready, UNIT).groups == ((0,), (1,), (2,), (3,))


def test_dtf_merges_everything_ready_at_once() -> None:
    elements, ready = [3, 5, 1, 2, 7], [2.0] * 5
    plan = plan_fusion(elements, ready, UNIT)
    assert plan.groups == ((0, 1, 2, 3, 4),)
    assert simulate_fusion(plan, elements, ready, UNIT).end == 2.0 + 1.0 + 18.0


def test_dtf_uses_the_bytes_it_sends() -> None:
    # f0 has 4 elements: 1 + 0.25*8 = 3 s in bf16, 1 + 0.25*16 = 5 s in fp32. f1 (ready 3) opens a
    # new group either way (wait 3 >= alpha). f2 is ready at 4.9:
    #   bf16: tau(f1) = max(3, 3) = 3, wait 1.9 >= 1 and 3 <= 4.9 -> separate groups;
    #   fp32: tau(f1) = max(5, 3) = 5 > 4.9 (f1 cannot start before f2 is ready) -> merge.
    elements, ready = [4, 1, 1], [0.0, 3.0, 4.9]
    assert plan_fusion(elements, ready, UNIT, bytes_per_element=2).groups == ((0,), (1,), (2,))
    assert plan_fusion(elements, ready, UNIT, bytes_per_element=4).groups == ((0,), (1, 2))


def test_layerwise_all_bucket_basics() -> None:
    elements, ready = [1, 1, 1, 1, 1], [0.0, 1.0, 2.0, 3.0, 4.0]
    assert plan_fusion(elements, ready, UNIT, "layerwise").groups == ((0,), (1,), (2,), (3,), (4,))
    assert plan_fusion(elements, ready, UNIT, "all").groups == ((0, 1, 2, 3, 4),)
    # 4 bytes each, buckets closed at >= 8 bytes.
    assert plan_fusion(elements, ready, UNIT, "bucket", bucket_bytes=8).groups == ((0, 1), (2, 3), (4,))
    assert plan_fusion([10, 1, 1], [0.0] * 3, UNIT, "bucket", bucket_bytes=8).groups == ((0,), (1, 2))
    for policy in POLICIES:
        assert plan_fusion([], [], UNIT, policy).groups == ()
    assert simulate_fusion(plan_fusion([], [], UNIT), [], [], UNIT).end == 0.0


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"elements": [1, 2], "ready": [0.0]}, ValueError, "same length"),
        ({"ready": [0.0, 2.0, 1.0]}, ValueError, r"non-decreasing.*ready\[1\]"),
        ({"elements": [1, -2, 3]}, ValueError, r"elements\[1\]"),
        ({"ready": [0.0, float("nan"), 1.0]}, ValueError, r"ready\[1\]"),
        ({"policy": "greedy"}, ValueError, "'dtf', 'layerwise', 'all', 'bucket'"),
        ({"bucket_bytes": 0}, ValueError, "bucket_bytes"),
        ({"bytes_per_element": 0}, ValueError, "bytes_per_element"),
        ({"comm": (1.0, 2.0)}, TypeError, "comm"),  # a wrong type: TypeError
    ],
)
def test_plan_fusion_rejects_bad_input(kwargs: dict, error: type, match: str) -> None:
    args = {"elements": [1, 2, 3], "ready": [0.0, 1.0, 2.0], "comm": UNIT} | kwargs
    with pytest.raises(error, match=match):
        plan_fusion(**args)


def test_fusion_plan_and_simulation_validate() -> None:
    with pytest.raises(ValueError, match="consecutive"):
        FusionPlan(groups=((0,), (2, 1)), policy="dtf")
    with pytest.raises(ValueError, match=r"groups\[1\] is empty"):
        FusionPlan(groups=((0,), ()), policy="dtf")
    with pytest.raises(TypeError, match=r"groups\[1\]\[0\] must be an integer, got float"):
        FusionPlan(groups=((0,), (1.0,)), policy="dtf")  # a wrong type: TypeError, not "not consecutive"
    with pytest.raises(TypeError, match="groups must be a sequence"):
        FusionPlan(groups="01", policy="dtf")
    with pytest.raises(ValueError, match="policy"):
        FusionPlan(groups=((0,),), policy="nope")
    plan = FusionPlan(groups=((0, 1), (2,)), policy="dtf")
    assert FusionPlan(groups=[[0, 1], [2]], policy="dtf") == plan  # lists are stored as tuples
    assert plan.group_of == (0, 0, 1) and plan.num_factors == 3
    with pytest.raises(ValueError, match="covers 3 factors"):
        simulate_fusion(plan, [1, 2], [0.0, 1.0], UNIT)


@st.composite
def iterations(draw: st.DrawFn) -> tuple[list[int], list[float], AlphaBeta, int]:
    n = draw(st.integers(0, 40))
    elements = draw(st.lists(st.integers(0, 10**7), min_size=n, max_size=n))
    gaps = draw(st.lists(st.one_of(st.just(0.0), st.floats(0.0, 0.05)), min_size=n, max_size=n))
    ready, t = [], 0.0
    for g in gaps:
        t += g
        ready.append(t)
    comm = AlphaBeta(alpha=draw(st.floats(0.0, 0.01)), beta=draw(st.floats(0.0, 1e-9)))
    return elements, ready, comm, draw(st.sampled_from([2, 4]))


@settings(max_examples=150, deadline=None)
@given(iterations(), st.integers(1, 2**26))
def test_every_policy_covers_indices_consecutively(case: tuple, bucket_bytes: int) -> None:
    elements, ready, comm, bpe = case
    for policy in POLICIES:
        plan = plan_fusion(elements, ready, comm, policy, bucket_bytes=bucket_bytes, bytes_per_element=bpe)
        flat = [i for g in plan.groups for i in g]
        assert flat == list(range(len(elements)))
        assert all(g == tuple(range(g[0], g[0] + len(g))) for g in plan.groups)
        assert plan == plan_fusion(elements, ready, comm, policy, bucket_bytes=bucket_bytes, bytes_per_element=bpe)


@settings(max_examples=300, deadline=None)
@given(iterations())
def test_dtf_never_ends_later_than_layerwise_or_all(case: tuple) -> None:
    # A theorem for this greedy rule (proof in the docstring of fusion._dtf_groups): each merge is taken
    # only when it is no worse locally, and prefix end times compare by induction. Up to round-off.
    elements, ready, comm, bpe = case
    end = {
        p: simulate_fusion(plan_fusion(elements, ready, comm, p, bytes_per_element=bpe), elements, ready, comm, bpe).end
        for p in ("dtf", "layerwise", "all")
    }
    tol = 1e-9 * max(end.values(), default=0.0) + 1e-12
    assert end["dtf"] <= end["layerwise"] + tol
    assert end["dtf"] <= end["all"] + tol


def test_alone_factors_split_the_runs_planned_between_them():
    """alone=[2]: factor 2 is reduced by itself and the runs [0, 1] and [3, 4] are planned on their own,
    exactly as plan_fusion plans each run alone (DTF with a large alpha merges a whole run)."""
    comm = AlphaBeta(alpha=1.0, beta=0.0)
    elements, ready = [10, 20, 30, 40, 50], [0.0, 0.1, 0.2, 0.3, 0.4]
    plan = plan_fusion(elements, ready, comm, policy="dtf", alone=[2])
    first = plan_fusion(elements[:2], ready[:2], comm, policy="dtf")
    last = plan_fusion(elements[3:], ready[3:], comm, policy="dtf")
    assert first.groups == ((0, 1),) and last.groups == ((0, 1),)
    assert plan.groups == ((0, 1), (2,), (3, 4))
    assert plan_fusion(elements, ready, comm, policy="all", alone=[0, 4]).groups == ((0,), (1, 2, 3), (4,))
    assert plan_fusion(elements, ready, comm, policy="dtf").groups == ((0, 1, 2, 3, 4),)
    with pytest.raises(ValueError, match="alone"):
        plan_fusion(elements, ready, comm, alone=[5])
