"""The spd family of schedules in the simulator: every :class:`~..sim_schedule.SimSchedule` with ``dpkfac="off"``
(D-KFAC, MPD-KFAC, the paper's SPD-KFAC, this project's ``spd`` and its variants): factors all-reduced (or reduced
to their owner), inverses computed by their owner under a placement (or by every rank) and broadcast.

On the timeline core (:mod:`..timeline_core`: the compute stream, the channel, the factor reductions, the
gradient all-reduce), :func:`simulate_spd` adds

* the inversion phase: every factor is inverted by its owner under a placement, or by every rank, and
  owned inverses are broadcast on the channel as soon as computed (runtime planner and placement
  timeline of :mod:`lightning_spdkfac.schedule`, the code the runtime plans with);
* preconditioning last.

How the factor groups go over the channel is a :class:`FactorReductions`: :data:`ALLREDUCE` here;
DeAR's reduce-scatter and all-gather in :mod:`.dear`. The placement of ``async_placement="period"`` is
:mod:`.async_plan`'s, chosen before this module is called
(:func:`~lightning_spdkfac.simulate.timeline.simulate`).

**Asynchronous inverses** (``SimSchedule.async_inverses``, the runtime's ``async_inverses``): ``step()``
preconditions with the inverses it already holds and launches the new inversions and their broadcasts in
the background; they are swapped in at the start of the next ``step()``, which waits only for what is
still missing (staleness one step). The simulated interval is then the steady-state *period*, from the
end of one step to the end of the next, and the inversions in it are the previous step's. Compute is one
resource: the inversions run on a side stream of the same GPU and add their seconds to its busy time
(the model has no SM-level concurrency that would let both run at full speed). ``async_compute`` says
who goes first, the two ends of what a GPU can do with two streams:

* ``"before_forward"`` (default; a side stream of equal priority, whose kernels were queued before the
  next forward's): every rank runs its inversions at the start of the period, in the sync schedule's
  order, and forward waits for them. One GPU stands for all, so forward starts when the busiest rank is
  done (collectives keep the ranks together). Inverses are ready earliest: their broadcasts are launched
  before any factor reduction and run on the channel during forward/backward, where it is mostly idle;
  factor reductions that queue behind them count as FactorComm;
* ``"idle_time"`` (a lower-priority side stream): the inversions get only the compute stream's idle time,
  which in steady state begins when backward's last factor is computed (the stalls of
  ``sync_before_launch`` are left unused), so they run beside the gradient
  all-reduce and forward/backward is never slowed; their broadcasts queue behind the gradient all-reduce.

In both, the inversions wait for no factor reduction (they invert the previous iteration's factors), the
broadcasts share the one channel with the factor reductions and the gradient all-reduce in launch order,
and the step waits for the gradient all-reduce and for every inverse on every rank (the last inversion
and the last broadcast), then preconditions; the period ends there. One interval is the steady state: the
channel and the side stream are empty at its start (the step before waited for the previous broadcasts),
so the next interval repeats it (the first iteration, with no inverses to hold yet, is not simulated).

``"idle_time"`` is never slower than the same schedule synchronous, by construction: its inversion phase
is the synchronous one, same per-rank order and same broadcast order, started when backward ends
instead of when the channel is free, with the channel free at the same time, so every event of the
phase is no later (each is a max of sums of earlier ones). ``"before_forward"`` can be slower: forward
waits for the busiest rank's whole inversion time, which a synchronous schedule may partly hide behind
its broadcasts, and broadcasts on the channel can delay factor reductions.

**Lower bound** (:attr:`~..timeline_core.Timeline.lower_bound`, its terms in ``extra["lower_bound_terms"]``): a critical
path that no ordering of this schedule's work can beat, the sum of

* ``FF&BP`` and ``FactorComp``: one compute stream runs them one after another;
* ``GradComm``, the exposed gradient all-reduce as simulated: it is launched when backward ends and the
  step waits for it;
* ``Inversion``: the largest single inversion, over all factors (an inversion runs on one rank and cannot
  be split; replicating or owning the factor both cost at least that on some rank; a broadcast may not
  follow it, so none is counted). A synchronous schedule inverts after the channel is free, so all of it
  adds. ``"idle_time"`` async (and ``early_inverse``) starts inverting when backward ends, beside the
  gradient all-reduce, so only the part longer than the exposed ``GradComm`` adds. ``"before_forward"``
  async runs the busiest rank's inversions (at least the largest one) before forward, so all of it adds;
* ``Precondition``.

What it leaves out is what a better plan could avoid: exposed factor reductions, the rest of the
inversions (placement) and the inverse broadcasts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ... import validation as val
from ...factor_shapes import FactorShape, packed_numel
from ...schedule import REPLICATED, AlphaBeta, Placement, inverted_by, simulate_placement
from ...schedule.fusion import FusionPlan
from ...schedule.placement import message_bytes
from ..cluster import Cluster
from ..sim_schedule import SimSchedule
from ..timeline_core import (
    Channel,
    Event,
    Timeline,
    compute_and_reductions,
    compute_pieces,
    factor_order,
    fusion_plan,
    grad_comm_seconds,
    inverse_placement,
    ready_times,
)
from ..workload import Workload

__all__ = ["ALLREDUCE", "FactorReductions", "simulate_spd"]


def _group_seconds(schedule: SimSchedule, cluster: Cluster, sides: list[FactorShape], owners: Sequence[int],
                   group: Sequence[int]) -> float:
    """Seconds on the channel of one fused factor reduction (each factor packed: a dense one's upper triangle)."""
    bpe = schedule.bytes_per_element
    if schedule.reduce_to_owner:
        owned = sum(packed_numel(sides[i]) for i in group if owners[i] != REPLICATED) * bpe
        repl = sum(packed_numel(sides[i]) for i in group if owners[i] == REPLICATED) * bpe
        alpha = max(cluster.reduce.alpha if owned else 0.0, cluster.allreduce.alpha if repl else 0.0)
        return alpha + cluster.reduce.beta * owned + cluster.allreduce.beta * repl
    return cluster.allreduce.time(sum(packed_numel(sides[i]) for i in group) * bpe)


class FactorReductions:
    """How the fusion groups of factors go over the channel. This one (:data:`ALLREDUCE`): each group
    all-reduced when launched, or with ``reduce_to_owner`` its owned factors reduced to their owners (a
    subclass changes the collectives: :class:`~.dear.DeARReductions`)."""

    def planning_model(self, cluster: Cluster) -> AlphaBeta:
        """The collective model the fusion planner plans the groups with."""
        return cluster.allreduce

    def before_step(self, channel: Channel, groups: Sequence[Sequence[int]], sides: list[FactorShape],
                    schedule: SimSchedule, cluster: Cluster) -> None:
        """Put on ``channel`` what it carries before this step's first factor reduction: nothing here."""

    def seconds(self, schedule: SimSchedule, cluster: Cluster, sides: list[FactorShape], owners: Sequence[int],
                group: Sequence[int]) -> float:
        """Seconds on the channel of one group's reduction."""
        return _group_seconds(schedule, cluster, sides, owners, group)


ALLREDUCE = FactorReductions()


@dataclass
class _Phase:
    """What the inversion phase starts from."""

    schedule: SimSchedule
    cluster: Cluster
    order: list[tuple[int, str]]
    sides: list[FactorShape]  # the factors' shapes, in ``order``
    owners: tuple[int, ...]
    done: dict[int, float]  # factor position -> its reduction is complete
    t_compute: float
    t_comm: float
    inv_start: float  # when the inversions may start: the channel free (sync) or backward's end (async)
    shown: int  # ranks whose inversion events are recorded
    events: list[Event]
    bcast_order: list[int] = field(default_factory=list)  # owned factors (positions), in issue order


def _inversions_in_order(ph: _Phase, tasks_per_rank: list[list[int]]) -> tuple[list[float], float]:
    """Each rank inverts its tasks in planned order (``early_inverse``: in reduction order, each no earlier
    than its factor's reduction; otherwise all after the channel is free); owned inverses are broadcast
    as soon as computed. Returns each rank's end and the end of the broadcasts."""
    early = ph.schedule.early_inverse
    rank_end = []
    bcast_ready: dict[int, float] = {}
    for r, tasks in enumerate(tasks_per_rank):
        tr = ph.t_compute
        for i in sorted(tasks, key=lambda i: (ph.done[i], tasks.index(i))) if early else tasks:
            begin = max(tr, ph.done[i] if early else ph.inv_start)
            tr = begin + ph.cluster.inverse.time_of(ph.sides[i])
            if r < ph.shown:
                ph.events.append(Event(f"rank {r}", "InvComp", f"invert {ph.order[i]}", begin, tr))
            if ph.owners[i] == r:
                bcast_ready[i] = tr
        rank_end.append(tr if tasks else ph.t_comm)
    bfree = bcast_end = ph.t_comm
    for i in sorted(bcast_ready, key=lambda i: (bcast_ready[i], i)):
        b0 = max(bfree, bcast_ready[i])
        bfree = b0 + ph.cluster.broadcast.time(message_bytes(ph.sides[i], ph.schedule.bytes_per_element))
        ph.events.append(Event("comm", "InvComm", f"broadcast {ph.order[i]}", b0, bfree))
        bcast_end = bfree
    return rank_end, bcast_end


def _owner_turns(order: list[tuple[int, str]], owners: Sequence[int]) -> list[int]:
    """The runtime's broadcast order before issue 17, as positions in ``order``: the inversion tasks in
    layer order (A, then G, of each layer), and owners taking turns: every owner's first task (by owner
    rank), then every owner's second, and so on."""
    tasks = sorted((p for p, o in enumerate(owners) if o != REPLICATED),
                   key=lambda p: (order[p][0], order[p][1] != "A"))
    turn: dict[int, int] = {}
    key = {}
    for p in tasks:
        key[p] = (turn.get(owners[p], 0), owners[p], order[p][0], order[p][1] != "A")
        turn[owners[p]] = turn.get(owners[p], 0) + 1
    return sorted(tasks, key=key.__getitem__)


def _inversions_planned(ph: _Phase, placement: Placement) -> tuple[list[float], float]:
    """The runtime's own timeline of the inversion phase (:func:`~lightning_spdkfac.schedule.simulate_placement`,
    broadcasts in the schedule's order), with the inversions started at ``ph.inv_start`` and the
    broadcasts on the channel, free from ``ph.t_comm``. Returns each rank's end and the end of the
    broadcasts."""
    start, inv = ph.inv_start, ph.cluster.inverse
    issue = _owner_turns(ph.order, placement.owners) if ph.schedule.broadcast_order == "owner_turns" else None
    pt = simulate_placement(placement, ph.sides, inv, ph.cluster.broadcast,
                            bytes_per_element=ph.schedule.bytes_per_element, order=issue)
    ph.bcast_order = list(pt.broadcast_order)
    for r in range(min(ph.cluster.world_size, ph.shown)):
        tr = start  # each owner inverts in the issue order (the default's is inverted_by), then the replicated
        for i in [i for i in pt.broadcast_order if placement.owners[i] == r] + list(placement.replicated):
            ph.events.append(Event(f"rank {r}", "InvComp", f"invert {ph.order[i]}", tr, tr + inv.time_of(ph.sides[i])))
            tr += inv.time_of(ph.sides[i])
    clock: dict[int, float] = {}
    ready: dict[int, float] = {}  # owned factor -> its inverse is computed
    for i in pt.broadcast_order:
        o = placement.owners[i]
        clock[o] = ready[i] = clock.get(o, start) + inv.time_of(ph.sides[i])
    free = ph.t_comm
    for i in pt.broadcast_order:
        b0 = max(free, ready[i])
        free = b0 + ph.cluster.broadcast.time(message_bytes(ph.sides[i], ph.schedule.bytes_per_element))
        ph.events.append(Event("comm", "InvComm", f"broadcast {ph.order[i]}", b0, free))
    return [start + e for e in pt.compute_end], free


def _lower_bound_terms(schedule: SimSchedule, workload: Workload, grad_exposed: float,
                       longest_inversion: float) -> dict[str, float]:
    """The terms of :attr:`Timeline.lower_bound` (module docstring): the inversion term is the largest
    single inversion, less the exposed gradient all-reduce it can run beside when inversions start at the
    end of backward (``idle_time`` async, early)."""
    beside = schedule.early_inverse or (schedule.async_inverses and schedule.async_compute == "idle_time")
    return {"FF&BP": workload.ff_bp, "GradComm": grad_exposed, "FactorComp": workload.factor_comp,
            "Inversion": max(0.0, longest_inversion - grad_exposed) if beside else longest_inversion,
            "Precondition": workload.precondition}


def _given_placement(placement: object, world: int, factors: int) -> Placement | None:
    """``simulate``'s ``placement`` argument, checked against the cluster and the workload."""
    p = val.check_instance("placement", placement, Placement)
    if p.world_size != world or len(p.owners) != factors:
        raise ValueError(f"placement must be for {world} ranks and {factors} factors, got {p.world_size} ranks and "
                         f"{len(p.owners)} factors")
    return p if world > 1 else None


def _inversion_phase(ph: _Phase, placement: Placement | None) -> tuple[list[float], float]:
    """Each rank's end of the inversions and the end of the broadcasts, under the schedule's placement
    (None: one GPU, which inverts everything)."""
    if placement is None:
        return _inversions_in_order(ph, [list(range(len(ph.order)))])
    if ph.schedule.early_inverse:
        return _inversions_in_order(ph, [inverted_by(placement, r) for r in range(ph.cluster.world_size)])
    return _inversions_planned(ph, placement)




def simulate_spd(workload: Workload, cluster: Cluster, schedule: SimSchedule, shown: int,
                 placement: Placement | None = None, reductions: FactorReductions = ALLREDUCE) -> Timeline:
    """One iteration of ``schedule`` (``dpkfac="off"``) on ``cluster`` (the module docstring): with
    ``async_inverses`` the steady-state period, whose inversions and broadcasts are the previous iteration's.

    ``shown``: the inversion events of ranks ``0 .. shown - 1`` are recorded. ``placement``: inversion owners
    to use instead of the schedule's planner (checked against the cluster and the workload); None: the
    planner's. ``reductions``: how the factor groups go over the channel. The arguments are checked by
    :func:`~lightning_spdkfac.simulate.timeline.simulate`, which calls this.
    """
    world = cluster.world_size
    events: list[Event] = []

    # -- compute stream, first without communication: the ready times the planner profiles
    pieces = compute_pieces(workload)
    ready, t_busy = ready_times(pieces)
    order, sides = factor_order(workload)

    # -- placement (static: from sizes and models) and fusion (from the profiled ready times)
    placement = _given_placement(placement, world, len(sides)) if placement is not None else (
        inverse_placement(schedule, cluster, sides) if world > 1 else None)
    owners = placement.owners if placement is not None else tuple([REPLICATED] * len(order))
    plan = (fusion_plan(schedule, order, sides, [ready[k] for k in order], reductions.planning_model(cluster))
            if world > 1 else FusionPlan((), "dtf"))

    # -- the run: compute and the channel together, then the gradient all-reduce
    channel = Channel(events, cluster.overlap_slowdown)
    ahead, first = None, None
    if schedule.async_inverses and schedule.async_compute == "before_forward":
        # the previous step's inversions, served before this forward; their broadcasts first on the channel
        first = _Phase(schedule, cluster, order, sides, tuple(owners), {}, 0.0, 0.0, 0.0, shown, events)
        ahead = _inversion_phase(first, placement)
        channel.free = ahead[1]
        pieces = [("InvComp", "inversions of the previous step (side stream)", max(ahead[0], default=0.0), None),
                  *pieces]
    reductions.before_step(channel, plan.groups, sides, schedule, cluster)

    def seconds(g: Sequence[int]) -> float:
        return reductions.seconds(schedule, cluster, sides, owners, g)

    t_compute = compute_and_reductions(schedule, pieces, order, plan.groups, seconds, channel)
    grad = grad_comm_seconds(workload, cluster)
    if grad > 0:
        channel.run("GradComm", "gradient all-reduce", t_compute, grad)
    t_comm = max(channel.free, t_compute)
    done = channel.done if world > 1 else {i: t_compute for i in range(len(order))}

    # -- inversions and broadcasts (after the channel is free; async: after backward, or ahead of forward)
    phase = first or _Phase(schedule, cluster, order, sides, tuple(owners), done, t_compute, t_comm,
                            t_compute if schedule.async_inverses else t_comm, shown, events)
    rank_end, bcast_end = ahead if ahead is not None else _inversion_phase(phase, placement)
    lead = max(rank_end, default=0.0) if ahead is not None else 0.0  # inversion seconds before forward
    t_inv = max(rank_end) if rank_end else t_comm
    t_end = max(t_inv, bcast_end, t_comm)

    grad_exposed = min(grad, t_comm - t_compute)
    breakdown = {
        "FF&BP": workload.ff_bp,
        "GradComm": grad_exposed,
        "FactorComp": workload.factor_comp,
        # stalls in compute + exposed after it (with inversions ahead: reductions queued behind their broadcasts)
        "FactorComm": max(0.0, t_comm - t_busy - lead - grad_exposed),
        "InvComp": lead + max(0.0, t_inv - t_comm),
        "InvComm": t_end - max(t_inv, t_comm),
        "Precondition": workload.precondition,
    }
    if workload.precondition:
        events.append(Event("compute", "Precondition", "precondition", t_end, t_end + workload.precondition))
    return Timeline(
        events=events, breakdown=breakdown, groups=plan.groups, order=order, owners=tuple(owners),
        extra={"t_compute": t_compute, "t_comm": t_comm, "t_inv": t_inv,
               "sides": sides, "schedule": schedule, "broadcast_order": phase.bcast_order,
               "lower_bound_terms": _lower_bound_terms(schedule, workload, grad_exposed,
                                                       max((cluster.inverse.time_of(n) for n in sides), default=0.0))},
    )
