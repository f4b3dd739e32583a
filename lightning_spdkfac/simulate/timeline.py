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

**Lower bound** (:attr:`Timeline.lower_bound`, its terms in ``extra["lower_bound_terms"]``): a critical
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

The plans are made by the runtime's own planners (:func:`~lightning_spdkfac.schedule.plan_fusion`,
:func:`~lightning_spdkfac.schedule.plan_placement`) from the simulated ready times, as the runtime makes
them from measured ones.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from .. import validation as val
from ..factor_shapes import FactorShape, numel, packed_numel
from ..schedule import (
    REPLICATED,
    AlphaBeta,
    InverseCost,
    Placement,
    inverted_by,
    plan_fusion,
    plan_placement,
    simulate_placement,
)
from ..schedule.fusion import FusionPlan
from ..schedule.placement import message_bytes
from ..vocabulary import FUSIONS, PLACEMENTS, FusionName, PlacementName
from .cluster import Cluster
from .workload import Workload

__all__ = ["CATEGORIES", "SIM_SCHEDULES", "Event", "SimSchedule", "Timeline", "as_sim_schedule", "simulate",
           "with_schedule"]

# How a placement weighs a factor: the cluster's inversion and broadcast models, or ``n`` (the original code).
LbpMetric = Literal["model", "linear"]
# The order in which every rank issues the inverse broadcasts: "finish" the runtime's
# (:func:`~lightning_spdkfac.schedule.broadcast_order`); "owner_turns" the runtime's before issue 17.
BroadcastOrder = Literal["finish", "owner_turns"]
# How asynchronous inversions share the GPU with the next forward/backward (module docstring).
AsyncCompute = Literal["before_forward", "idle_time"]
# How factors are communicated: all-reduced, or DeAR's reduce-scatter in backward + all-gather in the next
# forward (:mod:`.dear`).
FactorComm = Literal["allreduce", "dear"]
# DP-KFAC (:mod:`.dpkfac`): off, factors reduced to each layer's owner, or factors from the owner's data only.
DPKFAC = Literal["off", "reduce", "local"]
# How an async schedule's placement is chosen: by its planner (for a synchronous phase), or by the simulated
# async period over lbp_channel's candidates (:mod:`.async_plan`).
AsyncPlacement = Literal["sync", "period"]
CATEGORIES = ("FF&BP", "GradComm", "FactorComp", "FactorComm", "InvComp", "InvComm", "Precondition")


@dataclass(frozen=True)
class SimSchedule:
    """How an iteration is scheduled. The named ones are in :data:`SIM_SCHEDULES`.

    Attributes:
        pipelining: factor reductions launched from the hooks as factors become ready.
        fusion: fusion policy of the factor reductions, one of the runtime's
            (:data:`~lightning_spdkfac.vocabulary.FUSIONS`).
        fuse_g: ``False`` reduces every G factor on its own whatever ``fusion`` says (the original
            SPD-KFAC code fused only A factors).
        bucket_mb: bucket size for ``fusion="bucket"`` (64 MiB: Horovod's default fusion buffer).
        placement: inversion placement, one of the runtime's (:data:`~lightning_spdkfac.vocabulary.PLACEMENTS`;
            ``lbp_channel`` is the ``spd`` default).
        lbp_metric: ``"model"`` plans with the cluster's inversion and broadcast models (this project);
            ``"linear"`` with a load linear in ``n`` and no broadcast term (the original code).
        small_factor: factors with ``n`` below it are replicated (the original code: 1024).
        plan_full_sizes: DTF plans with ``n*n`` elements per factor while ``n(n+1)/2`` are sent (the
            original code's inconsistency).
        bytes_per_element: of factor and inverse messages: 4 (fp32) or 2 (bf16) (any positive size can be
            simulated; the runtime sends only these two).
        reduce_to_owner: factors that have an owner are reduced to it (a pipelined-chain reduce, half the
            link traffic of an all-reduce) instead of all-reduced; replicated ones are still all-reduced.
        early_inverse: a rank starts inverting a factor as soon as its reduction is complete, while the
            gradient all-reduce and later factor groups are still on the wire.
        sync_before_launch: a device-wide synchronize precedes every factor reduction (the original
            code): it waits for the reduction still on the wire, so the compute stream stalls until the
            channel is free before each launch.
        broadcast_order: the order in which every rank issues the inverse broadcasts (they run in that
            order on the channel, and each owner inverts in it): ``"finish"`` by predicted finish of the
            inversion, :func:`~lightning_spdkfac.schedule.broadcast_order`, the function the runtime
            calls; ``"owner_turns"`` the runtime's order before it (owners take turns, each with its next
            factor in layer order, whatever its inversion costs), kept for comparison.
        async_inverses: the runtime's ``async_inverses``: the step preconditions with the inverses of the
            previous step while the new ones are computed and broadcast in the background, overlapping
            the next iteration (the module docstring has the model). Excludes ``early_inverse``.
        async_compute: with ``async_inverses``, how the inversions share the GPU with the next
            forward/backward: ``"before_forward"`` (they run first and forward waits for them, as kernels
            queued first on a stream of equal priority) or ``"idle_time"`` (they run only when the compute
            stream is idle, after backward, as a lower-priority stream).
        factor_comm: ``"allreduce"``, or ``"dear"``: each fusion group reduce-scattered in backward and
            all-gathered in the next forward, so inversions use factors one step old (:mod:`.dear`).
        dpkfac: ``"off"``; ``"reduce"`` the runtime's ``schedule="dpkfac"`` (layer owners, factors reduced
            to them, preconditioned gradients broadcast: :mod:`.dpkfac`; ``placement`` is not used);
            ``"local"`` the paper's local-factor variant (no factor communication; an approximation).
        async_placement: with ``async_inverses``: ``"sync"`` the placement planner's owners; ``"period"``
            the candidate of shortest simulated async period (:mod:`.async_plan`).
    """

    name: str
    pipelining: bool = True
    fusion: FusionName = "dtf"
    fuse_g: bool = True
    bucket_mb: float = 64.0
    placement: PlacementName = "lbp_channel"
    lbp_metric: LbpMetric = "model"
    small_factor: int | None = None
    plan_full_sizes: bool = False
    bytes_per_element: int = 4
    reduce_to_owner: bool = False
    early_inverse: bool = False
    sync_before_launch: bool = False
    broadcast_order: BroadcastOrder = "finish"
    async_inverses: bool = False
    async_compute: AsyncCompute = "before_forward"
    factor_comm: FactorComm = "allreduce"
    dpkfac: DPKFAC = "off"
    async_placement: AsyncPlacement = "sync"
    description: str = ""

    def __post_init__(self) -> None:
        val.check_instance("name", self.name, str)
        for flag in ("pipelining", "fuse_g", "plan_full_sizes", "reduce_to_owner", "early_inverse",
                     "sync_before_launch", "async_inverses"):
            val.check_bool(flag, getattr(self, flag))
        if self.async_inverses and self.early_inverse:
            raise ValueError("async_inverses and early_inverse exclude each other: async inversions start when "
                             "backward ends, early ones as each factor is reduced; give one of them")
        val.check_choice("fusion", self.fusion, FUSIONS)
        val.check_real("bucket_mb", self.bucket_mb, val.POSITIVE)
        val.check_choice("placement", self.placement, PLACEMENTS)
        val.check_choice("lbp_metric", self.lbp_metric, typing.get_args(LbpMetric))
        val.check_choice("broadcast_order", self.broadcast_order, typing.get_args(BroadcastOrder))
        val.check_choice("async_compute", self.async_compute, typing.get_args(AsyncCompute))
        val.check_int("small_factor", self.small_factor, low=0, optional=True)
        val.check_int("bytes_per_element", self.bytes_per_element, low=1)
        val.check_instance("description", self.description, str)
        self._check_issue19()

    def _check_issue19(self) -> None:
        """``factor_comm``, ``dpkfac`` and ``async_placement``, alone and with the rest."""
        val.check_choice("factor_comm", self.factor_comm, typing.get_args(FactorComm))
        val.check_choice("dpkfac", self.dpkfac, typing.get_args(DPKFAC))
        val.check_choice("async_placement", self.async_placement, typing.get_args(AsyncPlacement))
        if self.async_placement == "period" and not self.async_inverses:
            raise ValueError("async_placement='period' needs async_inverses=True (it plans for the async period)")
        given = [n for n in ("async_inverses", "early_inverse", "reduce_to_owner") if getattr(self, n)]
        if self.factor_comm == "dear" and given:
            raise ValueError(f"factor_comm='dear' excludes {given[0]} (its inversions use the factors gathered "
                             "in forward, one step old)")
        if self.dpkfac != "off" and (given or self.factor_comm != "allreduce"):
            raise ValueError(f"dpkfac={self.dpkfac!r} excludes {(given or ['factor_comm=' + repr(self.factor_comm)])[0]} "
                             "(factors go to each layer's owner, which inverts and preconditions; nothing else is sent)")


_PAPER_BASE: dict[str, Any] = dict(fusion="bucket", bucket_mb=64.0, pipelining=False)
_PAPER_SPD: dict[str, Any] = dict(fuse_g=False, placement="lbp", lbp_metric="linear", small_factor=1024, sync_before_launch=True)
# The simulator's named schedules (not the runtime's SCHEDULES of lightning_spdkfac.vocabulary): D-KFAC and
# MPD-KFAC as the paper ran them, the paper's SPD-KFAC as its code ran, this project's spd and its variants.
SIM_SCHEDULES: dict[str, SimSchedule] = {
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
        SimSchedule("spd-owner-turns", broadcast_order="owner_turns",
                    description="spd with the runtime's broadcast order before issue 17 (owners take turns)"),
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
        SimSchedule("spd-async", async_inverses=True, async_placement="period",
                    description="spd with asynchronous inverses: inversions and broadcasts of one step "
                    "overlap the next iteration (one step stale); placement by the async period"),
        SimSchedule("spd-async-idle", async_inverses=True, async_compute="idle_time",
                    description="spd-async with inversions only in the GPU's idle time after backward "
                    "(a low-priority side stream)"),
        SimSchedule("spd-dear", factor_comm="dear",
                    description="spd with DeAR-style factor communication: reduce-scatter in backward, "
                    "all-gather in the next forward (inversions use factors one step old)"),
        SimSchedule("spd-async-sync-placement", async_inverses=True,
                    description="spd-async with lbp_channel's placement, planned for a synchronous phase"),
        SimSchedule("dpkfac", dpkfac="reduce",
                    description="DP-KFAC: factors reduced to each layer's owner, which inverts and preconditions "
                    "it and broadcasts the preconditioned gradient (by predicted finish, as the runtime)"),
        SimSchedule("dpkfac-local", dpkfac="local",
                    description="DP-KFAC with local factors (the owner's data only: an approximation), "
                    "no factor communication"),
        SimSchedule("dpkfac-turns", dpkfac="reduce", broadcast_order="owner_turns",
                    description="dpkfac with the preconditioned gradients broadcast with owners taking turns "
                    "(the runtime's first order)"),
        SimSchedule("spd-bf16-async", bytes_per_element=2, async_inverses=True,
                    description="spd-async with factors and inverses sent in bf16"),
        SimSchedule("mpd-async", placement="round_robin", async_inverses=True, **_PAPER_BASE,
                    description="MPD-KFAC with asynchronous inverses"),
        SimSchedule("dkfac-async", placement="replicated", async_inverses=True, **_PAPER_BASE,
                    description="D-KFAC with asynchronous inverses (every GPU inverts all, in the background)"),
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

    @property
    def lower_bound(self) -> float:
        """Seconds no ordering of this schedule's work can beat: the critical path of the module docstring,
        the sum of ``extra["lower_bound_terms"]``. Never above :attr:`total`."""
        return sum(self.extra["lower_bound_terms"].values())

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


def _fusion(schedule: SimSchedule, order: list[tuple[int, str]], sides: list[FactorShape], ready: list[float],
            comm: AlphaBeta) -> FusionPlan:
    elems = [numel(s) if schedule.plan_full_sizes else packed_numel(s) for s in sides]
    alone = () if schedule.fuse_g else [pos for pos, key in enumerate(order) if key[1] == "G"]
    return plan_fusion(elems, ready, comm, policy=schedule.fusion, bucket_bytes=int(schedule.bucket_mb * 2**20),
                       bytes_per_element=schedule.bytes_per_element, alone=alone)


def _placement(schedule: SimSchedule, cluster: Cluster, ns: list[FactorShape]) -> Placement:
    bpe = schedule.bytes_per_element
    if schedule.lbp_metric == "linear":  # the original code: load n, small factors by threshold only
        return plan_placement(ns, cluster.world_size, InverseCost(c1=1.0), AlphaBeta(0.0, 0.0),
                              policy=schedule.placement, bytes_per_element=bpe, small_threshold=schedule.small_factor)
    return plan_placement(ns, cluster.world_size, cluster.inverse, cluster.broadcast, policy=schedule.placement,
                          bytes_per_element=bpe, small_threshold=schedule.small_factor)


def as_sim_schedule(name: str, value: object) -> SimSchedule:
    """The argument ``name``: a :class:`SimSchedule`, or a name of :data:`SIM_SCHEDULES` (TypeError for
    anything else, ValueError for an unknown name)."""
    if isinstance(value, SimSchedule):
        return value
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a SimSchedule or one of {', '.join(map(repr, SIM_SCHEDULES))}, "
                        f"got {val.show(value)}")
    val.check_choice(name, value, SIM_SCHEDULES)
    return SIM_SCHEDULES[value]


# (category, label, seconds, factor key or None): one piece of work on the compute stream
_Piece = tuple[str, str, float, tuple[int, str] | None]


def _compute_pieces(workload: Workload) -> list[_Piece]:
    """The compute stream in order: each layer's forward then its A factor; in backward, each layer's
    backward then its G factor."""
    layers, times = workload.layers, workload.times
    pieces: list[_Piece] = []
    for i, (spec, lt) in enumerate(zip(layers, times)):
        pieces += [("FF&BP", f"forward {spec.name}", lt.forward, None),
                   ("FactorComp", f"A {spec.name}", lt.a_factor, (i, "A"))]
    for i in reversed(range(len(layers))):
        spec, lt = layers[i], times[i]
        pieces += [("FF&BP", f"backward {spec.name}", lt.backward, None),
                   ("FactorComp", f"G {spec.name}", lt.g_factor, (i, "G"))]
    return pieces


def _ready_times(pieces: list[_Piece]) -> tuple[dict[tuple[int, str], float], float]:
    """When each factor is computed on a stream without communication (what the planner profiles), and
    when that stream ends (FF&BP + FactorComp)."""
    ready: dict[tuple[int, str], float] = {}
    t = 0.0
    for _, _, sec, key in pieces:
        t += sec
        if key is not None:
            ready[key] = t
    return ready, t


class _Channel:
    """The one communication channel: collectives run one at a time, in launch order.

    ``slowdown`` (the cluster's ``overlap_slowdown``, s): compute that runs while a collective is on the
    channel takes ``1 + s`` times as long (:meth:`compute_end`); 0 leaves compute untouched."""

    def __init__(self, events: list[Event], slowdown: float = 0.0) -> None:
        self.events = events
        self.free = 0.0
        self.slowdown = slowdown
        self.done: dict[int, float] = {}  # factor position -> its reduction is complete

    def compute_end(self, start: float, seconds: float) -> float:
        """When compute of ``seconds`` (at full speed) started at ``start`` ends. Every collective launched
        so far was launched no later than ``start`` and they run back to back, so the channel is busy
        from ``start`` to :attr:`free`: compute runs at ``1/(1+s)`` speed until then, at full speed after."""
        busy = max(0.0, self.free - start)
        if self.slowdown <= 0.0 or busy <= 0.0:
            return start + seconds
        slow = seconds * (1.0 + self.slowdown)
        return start + slow if slow <= busy else start + busy + seconds - busy / (1.0 + self.slowdown)

    def run(self, category: str, label: str, launch: float, seconds: float) -> float:
        start = max(self.free, launch)
        self.free = start + seconds
        self.events.append(Event("comm", category, label, start, self.free))
        return self.free


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


def _compute_and_reductions(schedule: SimSchedule, pieces: list[_Piece], order: list[tuple[int, str]],
                            groups: Sequence[Sequence[int]], group_seconds: Callable[[Sequence[int]], float],
                            channel: _Channel) -> float:
    """The compute stream and the factor reductions together; returns when compute ends. Pipelined groups
    launch when their last member is ready; a synchronize before a launch stalls compute until the channel
    is free. Unpipelined groups launch when compute ends."""
    position = {k: p for p, k in enumerate(order)}
    closing = {g[-1]: k for k, g in enumerate(groups)}

    def run_group(k: int, launch: float) -> None:
        g = groups[k]
        end = channel.run("FactorComm", f"factor group {k} ({len(g)} factors)", launch, group_seconds(g))
        for i in g:
            channel.done[i] = end

    t = 0.0
    for cat, label, sec, key in pieces:
        end = channel.compute_end(t, sec)
        channel.events.append(Event("compute", cat, label, t, end))
        t = end
        if key is None or not schedule.pipelining or position[key] not in closing:
            continue
        if schedule.sync_before_launch and channel.free > t:
            channel.events.append(Event("compute", "FactorComm", "synchronize (stall)", t, channel.free))
            t = channel.free
        run_group(closing[position[key]], t)
    if not schedule.pipelining:
        for k in range(len(groups)):
            run_group(k, t)
    return t


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


def simulate(workload: Workload, cluster: Cluster, schedule: SimSchedule | str, *,
             rank_events: int | None = 8, placement: Placement | None = None) -> Timeline:
    """Simulate one iteration of ``workload`` on ``cluster`` under ``schedule`` (an object or a name of
    :data:`SIM_SCHEDULES`). With ``async_inverses`` the timeline is the steady-state period, whose
    inversions and broadcasts are the previous iteration's (module docstring).

    ``rank_events``: the inversion events of ranks ``0 .. rank_events - 1`` are recorded (None: every
    rank); the breakdown always accounts for every rank.

    ``placement``: inversion owners to use instead of the schedule's planner (to evaluate a placement no
    planner makes); one owner per factor, in :attr:`Timeline.order`, for ``cluster.world_size`` ranks.
    """
    val.check_int("rank_events", rank_events, low=0, optional=True)
    schedule = as_sim_schedule("schedule", schedule)
    val.check_instance("workload", workload, Workload)
    val.check_instance("cluster", cluster, Cluster)
    shown = cluster.world_size if rank_events is None else rank_events
    world = cluster.world_size
    if schedule.dpkfac != "off":
        if placement is not None:
            raise ValueError(f"placement must be None with schedule {schedule.name!r} (dpkfac plans layer owners)")
        from .dpkfac import simulate_dpkfac

        return simulate_dpkfac(workload, cluster, schedule, shown)
    if placement is None and schedule.async_placement == "period" and world > 1:
        from .async_plan import period_placement

        placement = period_placement(workload, cluster, schedule)
    events: list[Event] = []
    layers = workload.layers

    # -- compute stream, first without communication: the ready times the planner profiles
    pieces = _compute_pieces(workload)
    ready, t_busy = _ready_times(pieces)
    order = [(i, "A") for i in range(len(layers))] + [(i, "G") for i in reversed(range(len(layers)))]
    sides = [layers[i].a_shape if w == "A" else layers[i].g_shape for i, w in order]  # factor shapes

    # -- placement (static: from sizes and models) and fusion (from the profiled ready times)
    placement = _given_placement(placement, world, len(sides)) if placement is not None else (
        _placement(schedule, cluster, sides) if world > 1 else None)
    owners = placement.owners if placement is not None else tuple([REPLICATED] * len(order))
    dear = schedule.factor_comm == "dear" and world > 1
    if dear:
        from .dear import dear_models, group_bytes, previous_allgathers
    plan = (_fusion(schedule, order, sides, [ready[k] for k in order],
                    dear_models(cluster)[0] if dear else cluster.allreduce) if world > 1
            else FusionPlan((), "dtf"))

    # -- the run: compute and the channel together, then the gradient all-reduce
    channel = _Channel(events, cluster.overlap_slowdown)
    ahead, first = None, None
    if schedule.async_inverses and schedule.async_compute == "before_forward":
        # the previous step's inversions, served before this forward; their broadcasts first on the channel
        first = _Phase(schedule, cluster, order, sides, tuple(owners), {}, 0.0, 0.0, 0.0, shown, events)
        ahead = _inversion_phase(first, placement)
        channel.free = ahead[1]
        pieces = [("InvComp", "inversions of the previous step (side stream)", max(ahead[0], default=0.0), None),
                  *pieces]
    if dear:  # the previous step's all-gathers first on the channel; this step's groups reduce-scattered
        previous_allgathers(channel, plan.groups, sides, schedule.bytes_per_element, cluster)

        def seconds(g: Sequence[int]) -> float:
            return dear_models(cluster)[0].time(group_bytes(g, sides, schedule.bytes_per_element))
    else:
        def seconds(g: Sequence[int]) -> float:
            return _group_seconds(schedule, cluster, sides, owners, g)
    t_compute = _compute_and_reductions(schedule, pieces, order, plan.groups, seconds, channel)
    grad = _grad_comm(workload, cluster)
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


def with_schedule(base: str, **changes: Any) -> SimSchedule:
    """A named schedule with some attributes changed (e.g. ``with_schedule("spd", bytes_per_element=2)``)."""
    val.check_choice("base", base, SIM_SCHEDULES)
    return replace(SIM_SCHEDULES[base], **changes)
