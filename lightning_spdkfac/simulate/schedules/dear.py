"""DeAR-style factor communication in the simulator (issue 19): ``SimSchedule(factor_comm="dear")``.

DeAR (Zhang, Shi, Li et al. 2023) splits an all-reduce into its two halves and moves the second one to where
the channel is idle. For K-FAC factors: each fusion group is *reduce-scattered* when its last factor is ready
(pipelined from the hooks, as spd's all-reduces), and *all-gathered* at the start of the next iteration, on
the channel while forward runs. The inversions of a step therefore use the factors gathered in that step's
forward, i.e. the previous step's reduced factors (one step stale, like ``async_inverses``); the timeline is
the steady-state period, whose channel starts with the previous step's all-gathers (in plan order, launched at
0, before any reduce-scatter). The fusion plan is made with the reduce-scatter model. Everything else is the
base schedule's (:mod:`.spd`: placement, inverse broadcasts): :func:`simulate_dear` is :func:`~.spd.simulate_spd`
with :data:`DEAR` as its factor reductions.

The two halves are ``Cluster.reduce_scatter`` and ``Cluster.allgather`` when the cluster models them, else
half of the all-reduce each (:func:`~..cluster.half_allreduce`). Both count as ``FactorComm`` where exposed:
an all-gather that delays a reduce-scatter past backward shows there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...factor_shapes import FactorShape, ShapeLike, as_shape, packed_numel
from ...schedule import AlphaBeta, Placement
from ..cluster import Cluster, half_allreduce
from ..sim_schedule import SimSchedule
from ..timeline_core import Channel, Timeline
from ..workload import Workload
from .spd import FactorReductions, simulate_spd

__all__ = ["DEAR", "DeARReductions", "dear_models", "group_bytes", "previous_allgathers", "simulate_dear"]


def dear_models(cluster: Cluster) -> tuple[AlphaBeta, AlphaBeta]:
    """The reduce-scatter and all-gather models of ``cluster``."""
    return half_allreduce(cluster, "reduce_scatter"), half_allreduce(cluster, "allgather")


def group_bytes(group: Sequence[int], sides: Sequence[ShapeLike], bytes_per_element: int) -> int:
    """Bytes of one fusion group's factors, packed (``sides``: the factors' shapes; an int n is n x n)."""
    return sum(packed_numel(as_shape(sides[i])) for i in group) * bytes_per_element


def previous_allgathers(channel: Any, groups: Sequence[Sequence[int]], sides: Sequence[ShapeLike],
                        bytes_per_element: int, cluster: Cluster) -> None:
    """Put the previous step's all-gathers on ``channel`` from time 0, one per fusion group in plan order."""
    gather = dear_models(cluster)[1]
    for k, g in enumerate(groups):
        channel.run("FactorComm", f"all-gather factor group {k} (previous step)", 0.0,
                    gather.time(group_bytes(g, sides, bytes_per_element)))


class DeARReductions(FactorReductions):
    """Each group reduce-scattered in backward, after the previous step's all-gathers (the module docstring)."""

    def planning_model(self, cluster: Cluster) -> AlphaBeta:
        return dear_models(cluster)[0]

    def before_step(self, channel: Channel, groups: Sequence[Sequence[int]], sides: list[FactorShape],
                    schedule: SimSchedule, cluster: Cluster) -> None:
        previous_allgathers(channel, groups, sides, schedule.bytes_per_element, cluster)

    def seconds(self, schedule: SimSchedule, cluster: Cluster, sides: list[FactorShape], owners: Sequence[int],
                group: Sequence[int]) -> float:
        return dear_models(cluster)[0].time(group_bytes(group, sides, schedule.bytes_per_element))


DEAR = DeARReductions()


def simulate_dear(workload: Workload, cluster: Cluster, schedule: SimSchedule, shown: int,
                  placement: Placement | None = None) -> Timeline:
    """One iteration (the steady-state period) of ``schedule`` (``factor_comm="dear"``, more than one GPU):
    :func:`~.spd.simulate_spd` with the factor groups reduce-scattered and all-gathered."""
    return simulate_spd(workload, cluster, schedule, shown, placement, reductions=DEAR)
