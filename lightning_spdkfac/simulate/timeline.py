"""``simulate``: the event timeline of one K-FAC iteration on P GPUs under a schedule, and its breakdown in the
paper's categories.

The simulator is layered; each module imports only from the ones listed before it:

* :mod:`.cluster`, :mod:`.workload` -- the GPUs and their network; the model's K-FAC layers and their times;
* :mod:`.sim_schedule` -- what is simulated: :class:`SimSchedule` and the named :data:`SIM_SCHEDULES`;
* :mod:`.timeline_core` -- what every schedule is built of: the compute stream, the one communication channel,
  the factor reductions, the gradient all-reduce, the :class:`Event` and the :class:`Timeline`;
* :mod:`.schedules` -- one schedule per module: :mod:`.schedules.spd` (every schedule with ``dpkfac="off"``,
  synchronous or with asynchronous inverses; the full statement of the inversion phase, of the asynchronous
  model and of the lower bound is its docstring), :mod:`.schedules.dear`, :mod:`.schedules.dpkfac`, and
  :mod:`.schedules.async_plan` (the placement of ``async_placement="period"``);
* this module -- :func:`simulate`, which checks its arguments and hands the schedule to its module.

The public names of the layers below are importable from here too, as they were before the simulator was split
into these layers.
"""

from __future__ import annotations

from .. import validation as val
from ..schedule import Placement
from .cluster import Cluster
from .schedules.async_plan import period_placement
from .schedules.dear import simulate_dear
from .schedules.dpkfac import simulate_dpkfac
from .schedules.spd import simulate_spd
from .sim_schedule import (
    DPKFAC,
    SIM_SCHEDULES,
    AsyncCompute,
    AsyncPlacement,
    BroadcastOrder,
    FactorComm,
    LbpMetric,
    SimSchedule,
    as_sim_schedule,
    with_schedule,
)
from .timeline_core import CATEGORIES, Event, Timeline, grad_comm_seconds
from .workload import Workload

__all__ = ["CATEGORIES", "DPKFAC", "SIM_SCHEDULES", "AsyncCompute", "AsyncPlacement", "BroadcastOrder", "Event",
           "FactorComm", "LbpMetric", "SimSchedule", "Timeline", "as_sim_schedule", "simulate", "with_schedule"]
# The gradient all-reduce's seconds under the private name it had here (benchmarks/paper_table.py imports it).
_grad_comm = grad_comm_seconds


def simulate(workload: Workload, cluster: Cluster, schedule: SimSchedule | str, *,
             rank_events: int | None = 8, placement: Placement | None = None) -> Timeline:
    """Simulate one iteration of ``workload`` on ``cluster`` under ``schedule`` (an object or a name of
    :data:`SIM_SCHEDULES`). With ``async_inverses`` the timeline is the steady-state period, whose
    inversions and broadcasts are the previous iteration's (:mod:`.schedules.spd`).

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
        return simulate_dpkfac(workload, cluster, schedule, shown)
    if placement is None and schedule.async_placement == "period" and world > 1:
        placement = period_placement(workload, cluster, schedule)
    if schedule.factor_comm == "dear" and world > 1:
        return simulate_dear(workload, cluster, schedule, shown, placement)
    return simulate_spd(workload, cluster, schedule, shown, placement)
