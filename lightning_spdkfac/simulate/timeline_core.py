"""The timeline core of the simulator: the resources and events every schedule of :mod:`.schedules` is built of.

Model (one GPU stands for all: data parallelism makes every rank's forward/backward identical):

* one compute stream per GPU runs, in order, each layer's forward then its A-factor computation, and in
  backward each layer's backward then its G-factor computation; a factor is *ready* when computed
  (:func:`compute_pieces`, :func:`ready_times`; the factors in :func:`factor_order`);
* one communication channel (:class:`Channel`), shared by all collectives (they run one at a time, in launch
  order): the factor reductions in the groups of a fusion plan, launched when their last member is ready
  (pipelined) or when backward ends (not pipelined) (:func:`compute_and_reductions`), and the gradient
  all-reduce, launched when backward ends (as in the paper's measurements, where it was not overlapped;
  :func:`grad_comm_seconds`);
* what follows backward (the inversions, their broadcasts, preconditioning) is each schedule's own: the
  modules of :mod:`.schedules` put it on these resources and account for it in :data:`CATEGORIES`, the
  paper's categories, in a :class:`Timeline`.

The plans are made by the runtime's own planners (:func:`~lightning_spdkfac.schedule.plan_fusion`,
:func:`~lightning_spdkfac.schedule.plan_placement`, through :func:`fusion_plan` and :func:`inverse_placement`)
from the simulated ready times, as the runtime makes them from measured ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..factor_shapes import FactorShape, numel, packed_numel
from ..schedule import AlphaBeta, InverseCost, Placement, plan_fusion, plan_placement
from ..schedule.fusion import FusionPlan
from .cluster import Cluster
from .sim_schedule import SimSchedule
from .workload import Workload

__all__ = ["CATEGORIES", "Channel", "Event", "Piece", "Timeline", "compute_and_reductions", "compute_pieces",
           "factor_order", "fusion_plan", "grad_comm_seconds", "inverse_placement", "ready_times"]

CATEGORIES = ("FF&BP", "GradComm", "FactorComp", "FactorComm", "InvComp", "InvComm", "Precondition")


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
        """Seconds no ordering of this schedule's work can beat: the critical path its schedule module states,
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


def factor_order(workload: Workload) -> tuple[list[tuple[int, str]], list[FactorShape]]:
    """The factors in the order they are computed: every layer's A in forward, every G in backward (last layer
    first), as ``(layer, "A" | "G")`` keys, and their shapes in that order."""
    layers = workload.layers
    order = [(i, "A") for i in range(len(layers))] + [(i, "G") for i in reversed(range(len(layers)))]
    sides = [layers[i].a_shape if w == "A" else layers[i].g_shape for i, w in order]  # factor shapes
    return order, sides


def grad_comm_seconds(workload: Workload, cluster: Cluster) -> float:
    """Seconds of the gradient all-reduce: the workload's measured ones, else DDP's buckets of 25 MiB (fp32
    gradients) under the cluster's all-reduce model (0 on one GPU)."""
    if workload.grad_comm is not None:
        return workload.grad_comm
    if cluster.world_size == 1:
        return 0.0
    bucket = 25 * 2**20  # DDP's default bucket
    total = 4 * workload.params
    full, rest = divmod(total, bucket)
    return full * cluster.allreduce.time(bucket) + (cluster.allreduce.time(rest) if rest else 0.0)


def fusion_plan(schedule: SimSchedule, order: list[tuple[int, str]], sides: list[FactorShape], ready: list[float],
                comm: AlphaBeta) -> FusionPlan:
    """The factor reductions' fusion groups under ``schedule``, from the factors' ready times (in ``order``),
    planned with the collective model ``comm`` by the runtime's planner."""
    elems = [numel(s) if schedule.plan_full_sizes else packed_numel(s) for s in sides]
    alone = () if schedule.fuse_g else [pos for pos, key in enumerate(order) if key[1] == "G"]
    return plan_fusion(elems, ready, comm, policy=schedule.fusion, bucket_bytes=int(schedule.bucket_mb * 2**20),
                       bytes_per_element=schedule.bytes_per_element, alone=alone)


def inverse_placement(schedule: SimSchedule, cluster: Cluster, ns: list[FactorShape]) -> Placement:
    """The inversion owners of the factors of shapes ``ns`` under ``schedule``, by the runtime's planner."""
    bpe = schedule.bytes_per_element
    if schedule.lbp_metric == "linear":  # the original code: load n, small factors by threshold only
        return plan_placement(ns, cluster.world_size, InverseCost(c1=1.0), AlphaBeta(0.0, 0.0),
                              policy=schedule.placement, bytes_per_element=bpe, small_threshold=schedule.small_factor)
    return plan_placement(ns, cluster.world_size, cluster.inverse, cluster.broadcast, policy=schedule.placement,
                          bytes_per_element=bpe, small_threshold=schedule.small_factor)


# (category, label, seconds, factor key or None): one piece of work on the compute stream
Piece = tuple[str, str, float, tuple[int, str] | None]


def compute_pieces(workload: Workload) -> list[Piece]:
    """The compute stream in order: each layer's forward then its A factor; in backward, each layer's
    backward then its G factor."""
    layers, times = workload.layers, workload.times
    pieces: list[Piece] = []
    for i, (spec, lt) in enumerate(zip(layers, times)):
        pieces += [("FF&BP", f"forward {spec.name}", lt.forward, None),
                   ("FactorComp", f"A {spec.name}", lt.a_factor, (i, "A"))]
    for i in reversed(range(len(layers))):
        spec, lt = layers[i], times[i]
        pieces += [("FF&BP", f"backward {spec.name}", lt.backward, None),
                   ("FactorComp", f"G {spec.name}", lt.g_factor, (i, "G"))]
    return pieces


def ready_times(pieces: list[Piece]) -> tuple[dict[tuple[int, str], float], float]:
    """When each factor is computed on a stream without communication (what the planner profiles), and
    when that stream ends (FF&BP + FactorComp)."""
    ready: dict[tuple[int, str], float] = {}
    t = 0.0
    for _, _, sec, key in pieces:
        t += sec
        if key is not None:
            ready[key] = t
    return ready, t


class Channel:
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



def compute_and_reductions(schedule: SimSchedule, pieces: list[Piece], order: list[tuple[int, str]],
                            groups: Sequence[Sequence[int]], group_seconds: Callable[[Sequence[int]], float],
                            channel: Channel) -> float:
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
