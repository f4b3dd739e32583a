"""The event timeline of one K-FAC iteration on P GPUs, and its breakdown in the paper's categories.

Model (one GPU stands for all: data parallelism makes every rank's forward/backward identical):

* one compute stream per GPU runs, in order, each layer's forward then its A-factor computation, and in
  backward each layer's backward then its G-factor computation; a factor is *ready* when computed;
* one communication channel, shared by all collectives (they run one at a time, in launch order):
  the factor reductions in the groups of a fusion plan, launched when their last member is ready
  (pipelined) or when backward ends (not pipelined), and the gradient all-reduce, launched when backward
  ends (as in the paper's measurements, where it was not overlapped);
* the inversion phase: every factor is inverted by its owner under a placement, or by every rank, and
  owned inverses are broadcast on the channel as soon as computed (runtime planner and placement
  timeline of :mod:`lightning_spdkfac.schedule`, the code the runtime plans with);
* preconditioning last.

The plans are made by the runtime's own planners (:func:`~lightning_spdkfac.schedule.plan_fusion`,
:func:`~lightning_spdkfac.schedule.plan_placement`) from the simulated ready times, as the runtime makes
them from measured ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from .. import validation as val
from ..comm.triangle import triu_size
from ..schedule import (
    REPLICATED,
    AlphaBeta,
    InverseCost,
    inverted_by,
    plan_fusion,
    plan_placement,
    simulate_placement,
)
from ..schedule.fusion import FusionPlan
from .cluster import Cluster
from .workload import Workload

__all__ = ["CATEGORIES", "SCHEDULES", "Event", "SimSchedule", "Timeline", "simulate"]

CATEGORIES = ("FF&BP", "GradComm", "FactorComp", "FactorComm", "InvComp", "InvComm", "Precondition")


@dataclass(frozen=True)
class SimSchedule:
    """How an iteration is scheduled. The named ones are in :data:`SCHEDULES`.

    Attributes:
        pipelining: factor reductions launched from the hooks as factors become ready.
        fusion: fusion policy of the factor reductions (``dtf``, ``layerwise``, ``all``, ``bucket``).
        fuse_g: ``False`` reduces every G factor on its own whatever ``fusion`` says (the original
            SPD-KFAC code fused only A factors).
        bucket_mb: bucket size for ``fusion="bucket"`` (64 MiB: Horovod's default fusion buffer).
        placement: ``lbp_channel`` (the runtime's ``spd`` default), ``lbp``, ``round_robin`` or ``replicated``.
        lbp_metric: ``"model"`` plans with the cluster's inversion and broadcast models (this project);
            ``"linear"`` with a load linear in ``n`` and no broadcast term (the original code).
        small_factor: factors with ``n`` below it are replicated (the original code: 1024).
        plan_full_sizes: DTF plans with ``n*n`` elements per factor while ``n(n+1)/2`` are sent (the
            original code's inconsistency).
        bytes_per_element: of factor and inverse messages: 4 (fp32) or 2 (bf16).
        reduce_to_owner: factors that have an owner are reduced to it (a pipelined-chain reduce, half the
            link traffic of an all-reduce) instead of all-reduced; replicated ones are still all-reduced.
        early_inverse: a rank starts inverting a factor as soon as its reduction is complete, while the
            gradient all-reduce and later factor groups are still on the wire.
        sync_before_launch: a device-wide synchronize precedes every factor reduction (the original
            code): it waits for the reduction still on the wire, so the compute stream stalls until the
            channel is free before each launch.
    """

    name: str
    pipelining: bool = True
    fusion: str = "dtf"
    fuse_g: bool = True
    bucket_mb: float = 64.0
    placement: str = "lbp_channel"
    lbp_metric: Literal["model", "linear"] = "model"
    small_factor: int | None = None
    plan_full_sizes: bool = False
    bytes_per_element: int = 4
    reduce_to_owner: bool = False
    early_inverse: bool = False
    sync_before_launch: bool = False
    description: str = ""


_PAPER_BASE = dict(fusion="bucket", bucket_mb=64.0, pipelining=False)
_PAPER_SPD = dict(fuse_g=False, placement="lbp", lbp_metric="linear", small_factor=1024, sync_before_launch=True)
SCHEDULES: dict[str, SimSchedule] = {
    s.name: s
    for s in (
        SimSchedule("dkfac", placement="replicated", **_PAPER_BASE,
                    description="D-KFAC: factors all-reduced after backward (64 MiB fusion), every GPU inverts all"),
        SimSchedule("mpd", placement="round_robin", **_PAPER_BASE,
                    description="MPD-KFAC: as D-KFAC, inversions round-robin, inverses broadcast"),
        SimSchedule("spd-paper", plan_full_sizes=True, **_PAPER_SPD,
                    description="SPD-KFAC as the paper's code ran: DTF on A only, LBP with a load linear in n, "
                    "a device synchronize before each reduction"),
        SimSchedule("spd-paper-no-pipelining", **{**_PAPER_SPD, **_PAPER_BASE},
                    description="paper's SPD without pipelining (factors after backward)"),
        SimSchedule("spd-paper-layerwise", fusion="layerwise", **_PAPER_SPD,
                    description="paper's SPD, pipelined without fusion"),
        SimSchedule("spd", description="this project's SPD: DTF on A and G, channel-aware LBP on the n^3 model"),
        SimSchedule("spd-lbp", placement="lbp", description="spd with the paper's LBP rule (on the n^3 model)"),
        SimSchedule("spd-no-pipelining", **_PAPER_BASE, description="spd with factors reduced after backward"),
        SimSchedule("spd-no-dtf", fusion="layerwise", description="spd with one reduction per factor"),
        SimSchedule("spd-no-lbp", placement="round_robin", description="spd with round-robin inversions"),
        SimSchedule("spd-bf16", bytes_per_element=2,
                    description="spd, factors and inverses sent in bf16 (the best schedule in the model)"),
        SimSchedule("spd-early-inverse", early_inverse=True,
                    description="spd, inversions start as soon as a factor is reduced"),
        SimSchedule("spd-reduce", reduce_to_owner=True, description="spd, owned factors reduced to their owner"),
        SimSchedule("spd-bf16-early", bytes_per_element=2, early_inverse=True,
                    description="spd-bf16 with early inversions"),
    )
}


@dataclass(frozen=True)
class Event:
    """One interval on one resource: ``"compute"`` (every rank alike), ``"comm"`` (the shared channel),
    or ``"rank R"`` (that rank's compute stream in the inversion phase)."""

    resource: str
    category: str
    label: str
    start: float
    end: float


@dataclass
class Timeline:
    """The events of one iteration, its breakdown (seconds per category) and the plans used."""

    events: list[Event]
    breakdown: dict[str, float]
    groups: tuple[tuple[int, ...], ...]
    order: list[tuple[int, str]]
    owners: tuple[int, ...]
    extra: dict = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.breakdown.values())

    def chrome_trace(self) -> dict:
        """The events as a Chrome trace (open in https://ui.perfetto.dev or chrome://tracing): one row
        per resource, microseconds."""
        rows = sorted({e.resource for e in self.events}, key=lambda r: (r != "compute", r != "comm", r))
        tid = {r: k for k, r in enumerate(rows)}
        trace = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid[r], "args": {"name": r}} for r in rows]
        trace += [{"name": e.label, "cat": e.category, "ph": "X", "pid": 0, "tid": tid[e.resource],
                   "ts": e.start * 1e6, "dur": (e.end - e.start) * 1e6} for e in self.events]
        return {"traceEvents": trace, "displayTimeUnit": "ms"}


def _grad_comm(workload: Workload, cluster: Cluster) -> float:
    if workload.grad_comm is not None:
        return workload.grad_comm
    if cluster.world_size == 1:
        return 0.0
    bucket = 25 * 2**20  # DDP's default bucket
    total = 4 * workload.params
    full, rest = divmod(total, bucket)
    return full * cluster.allreduce.time(bucket) + (cluster.allreduce.time(rest) if rest else 0.0)


def _fusion(schedule: SimSchedule, order, sides, ready, comm: AlphaBeta) -> FusionPlan:
    elems = [s * s if schedule.plan_full_sizes else triu_size(s) for s in sides]
    alone = () if schedule.fuse_g else [pos for pos, key in enumerate(order) if key[1] == "G"]
    return plan_fusion(elems, ready, comm, policy=schedule.fusion, bucket_bytes=int(schedule.bucket_mb * 2**20),
                       bytes_per_element=schedule.bytes_per_element, alone=alone)


def _placement(schedule: SimSchedule, cluster: Cluster, ns: list[int]):
    bpe = schedule.bytes_per_element
    if schedule.lbp_metric == "linear":  # the original code: load n, small factors by threshold only
        return plan_placement(ns, cluster.world_size, InverseCost(c1=1.0), AlphaBeta(0.0, 0.0),
                              policy=schedule.placement, bytes_per_element=bpe, small_threshold=schedule.small_factor)
    return plan_placement(ns, cluster.world_size, cluster.inverse, cluster.broadcast, policy=schedule.placement,
                          bytes_per_element=bpe, small_threshold=schedule.small_factor)


def simulate(workload: Workload, cluster: Cluster, schedule: SimSchedule | str, *,
             rank_events: int | None = 8) -> Timeline:
    """Simulate one iteration of ``workload`` on ``cluster`` under ``schedule`` (an object or a name).

    ``rank_events``: the inversion events of ranks ``0 .. rank_events - 1`` are recorded (None: every
    rank); the breakdown always accounts for every rank.
    """
    shown = cluster.world_size if rank_events is None else val.check_int("rank_events", rank_events, low=0)
    if isinstance(schedule, str):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {sorted(SCHEDULES)} or a SimSchedule, got {schedule!r}")
        schedule = SCHEDULES[schedule]
    if not isinstance(workload, Workload):
        raise TypeError(f"workload must be a Workload, got {type(workload).__name__}")
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster must be a Cluster, got {type(cluster).__name__}")
    world = cluster.world_size
    bpe = schedule.bytes_per_element
    events: list[Event] = []
    layers, times = workload.layers, workload.times

    # -- compute stream, first without communication: the ready times the planner profiles
    pieces = []  # (category, label, seconds, factor key or None), in stream order
    for i, (spec, lt) in enumerate(zip(layers, times)):
        pieces += [("FF&BP", f"forward {spec.name}", lt.forward, None), ("FactorComp", f"A {spec.name}", lt.a_factor, (i, "A"))]
    for i in reversed(range(len(layers))):
        spec, lt = layers[i], times[i]
        pieces += [("FF&BP", f"backward {spec.name}", lt.backward, None), ("FactorComp", f"G {spec.name}", lt.g_factor, (i, "G"))]
    ready: dict[tuple[int, str], float] = {}
    t = 0.0
    for _, _, sec, key in pieces:
        t += sec
        if key is not None:
            ready[key] = t
    t_busy = t  # FF&BP + FactorComp

    order = [(i, "A") for i in range(len(layers))] + [(i, "G") for i in reversed(range(len(layers)))]
    sides = [layers[i].a_side if w == "A" else layers[i].g_side for i, w in order]
    ready_list = [ready[k] for k in order]

    # -- placement (static: from sizes and models) and fusion (from the profiled ready times)
    placement = _placement(schedule, cluster, sides) if world > 1 else None
    owners = placement.owners if placement is not None else tuple([REPLICATED] * len(order))
    plan = _fusion(schedule, order, sides, ready_list, cluster.allreduce) if world > 1 else FusionPlan((), "dtf")

    def group_seconds(g) -> float:
        if schedule.reduce_to_owner:
            owned = sum(triu_size(sides[i]) for i in g if owners[i] != REPLICATED) * bpe
            repl = sum(triu_size(sides[i]) for i in g if owners[i] == REPLICATED) * bpe
            alpha = max(cluster.reduce.alpha if owned else 0.0, cluster.allreduce.alpha if repl else 0.0)
            return alpha + cluster.reduce.beta * owned + cluster.allreduce.beta * repl
        return cluster.allreduce.time(sum(triu_size(sides[i]) for i in g) * bpe)

    # -- the run: compute and the channel together. Pipelined groups launch when their last member is
    # ready; a synchronize before a launch stalls compute until the channel is free.
    position = {k: p for p, k in enumerate(order)}
    closing = {g[-1]: k for k, g in enumerate(plan.groups)}
    free = 0.0
    done: dict[int, float] = {}  # factor position -> its reduction is complete

    def run_group(k: int, launch: float) -> None:
        nonlocal free
        g = plan.groups[k]
        start = max(free, launch)
        free = start + group_seconds(g)
        events.append(Event("comm", "FactorComm", f"factor group {k} ({len(g)} factors)", start, free))
        for i in g:
            done[i] = free

    t = 0.0
    for cat, label, sec, key in pieces:
        events.append(Event("compute", cat, label, t, t + sec))
        t += sec
        if key is None or not schedule.pipelining or position[key] not in closing:
            continue
        if schedule.sync_before_launch and free > t:
            events.append(Event("compute", "FactorComm", "synchronize (stall)", t, free))
            t = free
        run_group(closing[position[key]], t)
    t_compute = t
    grad = _grad_comm(workload, cluster)
    if not schedule.pipelining:
        for k in range(len(plan.groups)):
            run_group(k, t_compute)
    if grad > 0:
        start = max(free, t_compute)
        free = start + grad
        events.append(Event("comm", "GradComm", "gradient all-reduce", start, free))
    t_comm = max(free, t_compute)
    if world == 1:
        done = {i: t_compute for i in range(len(order))}

    # -- inversions and broadcasts
    inv = cluster.inverse
    rank_end = []
    bcast_ready: dict[int, float] = {}
    start_all = t_comm
    if placement is None:
        owners_for = [list(range(len(order)))]
    else:
        owners_for = [inverted_by(placement, r) for r in range(world)]
    if schedule.early_inverse or placement is None:
        # each rank: its tasks in planned order, each no earlier than its factor's reduction
        for r, tasks in enumerate(owners_for):
            tr = t_compute
            for i in sorted(tasks, key=lambda i: (done[i], tasks.index(i))) if schedule.early_inverse else tasks:
                begin = max(tr, done[i] if schedule.early_inverse else start_all)
                tr = begin + inv.time(sides[i])
                if r < shown:
                    events.append(Event(f"rank {r}", "InvComp", f"invert {order[i]}", begin, tr))
                if owners[i] == r:
                    bcast_ready[i] = tr
            rank_end.append(tr if tasks else t_comm)
        bfree = t_comm
        bcast_end = t_comm
        for i in sorted(bcast_ready, key=lambda i: (bcast_ready[i], i)):
            b0 = max(bfree, bcast_ready[i])
            bfree = b0 + cluster.broadcast.time(triu_size(sides[i]) * bpe)
            events.append(Event("comm", "InvComm", f"broadcast {order[i]}", b0, bfree))
            bcast_end = bfree
    else:
        pt = simulate_placement(placement, sides, inv, cluster.broadcast, bytes_per_element=bpe)
        rank_end = [start_all + e for e in pt.compute_end]
        bcast_end = start_all
        for i, s, e in zip(pt.broadcast_order, pt.broadcast_start, pt.broadcast_end):
            events.append(Event("comm", "InvComm", f"broadcast {order[i]}", start_all + s, start_all + e))
            bcast_end = start_all + e
        for r in range(min(world, shown)):
            tr = start_all
            for i in inverted_by(placement, r):
                events.append(Event(f"rank {r}", "InvComp", f"invert {order[i]}", tr, tr + inv.time(sides[i])))
                tr += inv.time(sides[i])
    t_inv = max(rank_end) if rank_end else t_comm
    t_end = max(t_inv, bcast_end, t_comm)

    grad_exposed = min(grad, t_comm - t_compute)
    breakdown = {
        "FF&BP": workload.ff_bp,
        "GradComm": grad_exposed,
        "FactorComp": workload.factor_comp,
        "FactorComm": max(0.0, t_comm - t_busy - grad_exposed),  # stalls in compute + exposed after it
        "InvComp": max(0.0, t_inv - t_comm),
        "InvComm": t_end - max(t_inv, t_comm),
        "Precondition": workload.precondition,
    }
    if workload.precondition:
        events.append(Event("compute", "Precondition", "precondition", t_end, t_end + workload.precondition))
    return Timeline(
        events=events, breakdown=breakdown, groups=plan.groups, order=order, owners=tuple(owners),
        extra={"t_compute": t_compute, "t_comm": t_comm, "t_inv": t_inv,
               "sides": sides, "schedule": schedule},
    )


def with_schedule(base: str, **changes) -> SimSchedule:
    """A named schedule with some attributes changed (e.g. ``with_schedule("spd", bytes_per_element=2)``)."""
    return replace(SCHEDULES[base], **changes)
