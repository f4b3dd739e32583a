"""Fusion of the factor all-reduces into groups (the paper's dynamic tensor fusion and its ablations).

Factors are given in the order they become ready during one iteration (A factors in forward, then G
factors in backward). Each one is all-reduced as its upper triangle, ``n(n+1)/2`` elements; a fusion
group is a run of consecutive factors sent as one message, launched once its last member is ready.
All groups share one communication channel, so they run one after another.

Sizes are consistent throughout: the bytes that the planner charges to a group are exactly the bytes
that group sends (``elements * bytes_per_element`` summed over members), unlike the original code, which
timed full ``n*n`` factors but merged triangles.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from .. import validation as val
from .cost import AlphaBeta

__all__ = ["FusionPlan", "FusionPolicy", "FusionTimeline", "plan_fusion", "simulate_fusion"]

FusionPolicy = Literal["dtf", "layerwise", "all", "bucket"]
_POLICIES: tuple[str, ...] = get_args(FusionPolicy)


@dataclass(frozen=True)
class FusionPlan:
    """Fusion groups: consecutive runs of factor indices covering ``0..N-1`` exactly once, in order.

    ``groups[k]`` is the tuple of factor indices all-reduced together as the k-th message.
    """

    groups: tuple[tuple[int, ...], ...]
    policy: str

    def __post_init__(self) -> None:
        val.check_choice("policy", self.policy, _POLICIES)
        # Accept lists (e.g. a plan received from rank 0) but store hashable, comparable tuples.
        plan = val.check_sequence("groups", self.groups, "groups of factor indices")
        object.__setattr__(self, "groups", tuple(tuple(val.check_ints(f"groups[{k}]", g)) for k, g in enumerate(plan)))
        expected = 0
        for k, g in enumerate(self.groups):
            if not g:
                raise ValueError(f"groups[{k}] is empty; every fusion group holds at least one factor")
            if tuple(g) != tuple(range(expected, expected + len(g))):
                raise ValueError(
                    f"groups[{k}] = {g!r} is not the consecutive run starting at factor {expected}; "
                    "groups must cover 0..N-1 in order"
                )
            expected += len(g)

    @property
    def num_factors(self) -> int:
        """Number of factors the plan covers (N)."""
        return sum(len(g) for g in self.groups)

    @property
    def group_of(self) -> tuple[int, ...]:
        """``group_of[i]`` is the index of the group that holds factor ``i``."""
        return tuple(k for k, g in enumerate(self.groups) for _ in g)


@dataclass(frozen=True)
class FusionTimeline:
    """Modelled start and end (seconds) of each group's all-reduce on a single channel."""

    starts: tuple[float, ...]
    ends: tuple[float, ...]

    @property
    def end(self) -> float:
        """When the last all-reduce finishes (0.0 when there is none)."""
        return self.ends[-1] if self.ends else 0.0

    def exposed(self, after: float) -> float:
        """Communication still running after time ``after`` (e.g. the end of backward): ``max(0, end - after)``."""
        return max(0.0, self.end - val.check_real("after", after))


def _validated(
    elements: Sequence[int], ready: Sequence[float], bytes_per_element: int
) -> tuple[list[int], list[float]]:
    """Per-factor bytes and ready times, after checking lengths, signs and the ready order."""
    el = val.check_ints("elements", elements, low=0)
    rd = val.check_reals("ready", ready, val.Bound(low=0.0))
    val.check_same_length("elements", el, "ready", rd)
    bpe = val.check_int("bytes_per_element", bytes_per_element, low=1)
    for i in range(1, len(rd)):
        if rd[i] < rd[i - 1]:
            raise ValueError(
                f"ready must be non-decreasing (factors in the order they become ready), "
                f"got ready[{i - 1}]={rd[i - 1]!r} > ready[{i}]={rd[i]!r}"
            )
    return [e * bpe for e in el], rd


def _dtf_groups(nbytes: list[int], ready: list[float], comm: AlphaBeta) -> list[list[int]]:
    """MG-WFBP merge rule over one channel, in ready order.

    An open group (bytes ``B``, ready when its latest member is) would start at
    ``tau = max(previous group's end, its ready time)``. The next factor joins it when it is ready
    before the open group's all-reduce could usefully run alone: ``tau > ready_next`` (the group could
    not even start before the next factor is ready) or ``ready_next - tau < alpha`` (waiting costs less
    than the start-up latency that merging saves). Otherwise the open group is closed and its end becomes
    the channel's next free time.

    Guarantee: the simulated end time is never later than that of ``layerwise`` or of ``all`` (exact
    arithmetic; the tests check it up to round-off). Write ``E(l)`` for the end of the channel if the open
    group were closed after factor ``l``, ``S(l)`` for the bytes of factors ``0..l`` and ``r' = ready[l+1]``.

    * vs layerwise, by induction ``E(l) <= E_layerwise(l)``. Without a merge, ``E(l+1) =
      max(E(l), r') + t_c(l+1)``, monotone in ``E(l)``. With a merge, the open group's start
      ``tau`` satisfies ``r' < tau + alpha`` (or ``r' < tau``), so ``max(tau, r') + alpha + beta*(B + b)
      <= max(tau + alpha + beta*B, r') + alpha + beta*b = max(E(l), r') + t_c(l+1)``.
    * vs all, by induction ``E(l) <= ready[l] + alpha + beta*S(l)`` together with
      ``channel_free <= ready[first member of the open group] + beta*(bytes before the open group)``,
      both kept because a group is closed only when ``r' >= tau + alpha``.
    """
    groups: list[list[int]] = []
    if not nbytes:
        return groups
    channel_free = 0.0
    current, cur_bytes, cur_ready = [0], nbytes[0], ready[0]
    for nxt in range(1, len(nbytes)):
        tau = max(channel_free, cur_ready)
        wait = ready[nxt] - tau
        if tau > ready[nxt] or wait < comm.alpha:
            current.append(nxt)
            cur_bytes += nbytes[nxt]
            cur_ready = ready[nxt]
            continue
        groups.append(current)
        channel_free = tau + comm.time(cur_bytes)
        current, cur_bytes, cur_ready = [nxt], nbytes[nxt], ready[nxt]
    groups.append(current)
    return groups


def _bucket_groups(nbytes: list[int], bucket_bytes: int) -> list[list[int]]:
    groups: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, b in enumerate(nbytes):
        current.append(i)
        size += b
        if size >= bucket_bytes:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return groups


def _run_groups(nbytes: list[int], ready: list[float], comm: AlphaBeta, policy: str, bucket: int) -> list[list[int]]:
    n = len(nbytes)
    if policy == "layerwise":
        return [[i] for i in range(n)]
    if policy == "all":
        return [list(range(n))] if n else []
    if policy == "bucket":
        return _bucket_groups(nbytes, bucket)
    return _dtf_groups(nbytes, ready, comm)


def plan_fusion(
    elements: Sequence[int],
    ready: Sequence[float],
    comm: AlphaBeta,
    policy: FusionPolicy = "dtf",
    bucket_bytes: int = 4 * 2**20,
    bytes_per_element: int = 4,
    alone: Collection[int] = (),
) -> FusionPlan:
    """Group the factor all-reduces of one iteration.

    Args:
        elements: elements each factor sends (its upper triangle, ``n(n+1)/2``), in ready order.
        ready: seconds from the start of the iteration at which each factor is ready; non-decreasing.
        comm: alpha-beta model of one all-reduce, per byte.
        policy: ``"dtf"`` dynamic tensor fusion (the paper), ``"layerwise"`` one all-reduce per factor,
            ``"all"`` a single all-reduce after the last factor, ``"bucket"`` consecutive groups closed
            once they hold at least ``bucket_bytes`` (like DDP's gradient buckets).
        bucket_bytes: bucket size for ``"bucket"`` (ignored otherwise, but still validated).
        bytes_per_element: 4 for fp32 factors, 2 for bf16/fp16.
        alone: positions of factors that are always reduced on their own (the original SPD-KFAC code
            did so with every G factor); the runs between them are grouped by ``policy``, each planned
            as if the channel were free when the run starts.
    """
    nbytes, rd = _validated(elements, ready, bytes_per_element)
    val.check_instance("comm", comm, AlphaBeta)
    val.check_choice("policy", policy, _POLICIES)
    bucket = val.check_int("bucket_bytes", bucket_bytes, low=1)
    single = set(val.check_ints("alone", list(alone), low=0))
    if any(i >= len(nbytes) for i in single):
        raise ValueError(f"alone must hold factor positions < {len(nbytes)}, got {sorted(single)!r}")
    groups: list[list[int]] = []
    lo = 0
    for pos in sorted(single) + [len(nbytes)]:
        groups += [[lo + i for i in g] for g in _run_groups(nbytes[lo:pos], rd[lo:pos], comm, policy, bucket)]
        if pos < len(nbytes):
            groups.append([pos])
        lo = pos + 1
    return FusionPlan(groups=tuple(tuple(g) for g in groups), policy=policy)


def simulate_fusion(
    plan: FusionPlan,
    elements: Sequence[int],
    ready: Sequence[float],
    comm: AlphaBeta,
    bytes_per_element: int = 4,
) -> FusionTimeline:
    """Modelled timeline of ``plan``: each group starts at ``max(previous group's end, last member's ready)``
    and takes ``comm.time(group bytes)``. Pure; the planner's objective and the tests' yardstick."""
    val.check_instance("plan", plan, FusionPlan)
    nbytes, rd = _validated(elements, ready, bytes_per_element)
    val.check_instance("comm", comm, AlphaBeta)
    if plan.num_factors != len(nbytes):
        raise ValueError(f"plan covers {plan.num_factors} factors but elements has {len(nbytes)}")
    starts: list[float] = []
    ends: list[float] = []
    free = 0.0
    for g in plan.groups:
        start = max(free, rd[g[-1]])
        free = start + comm.time(sum(nbytes[i] for i in g))
        starts.append(start)
        ends.append(free)
    return FusionTimeline(starts=tuple(starts), ends=tuple(ends))
