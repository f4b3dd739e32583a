"""DeAR-style factor communication in the simulator (issue 19): ``SimSchedule(factor_comm="dear")``.

DeAR (Zhang, Shi, Li et al. 2023) splits an all-reduce into its two halves and moves the second one to where
the channel is idle. For K-FAC factors: each fusion group is *reduce-scattered* when its last factor is ready
(pipelined from the hooks, as spd's all-reduces), and *all-gathered* at the start of the next iteration, on
the channel while forward runs. The inversions of a step therefore use the factors gathered in that step's
forward, i.e. the previous step's reduced factors (one step stale, like ``async_inverses``); the timeline is
the steady-state period, whose channel starts with the previous step's all-gathers (in plan order, launched at
0, before any reduce-scatter). The fusion plan is made with the reduce-scatter model. Everything else is the
base schedule's (placement, inverse broadcasts).

The two halves are ``Cluster.reduce_scatter`` and ``Cluster.allgather`` when the cluster models them, else
half of the all-reduce each (:func:`~.dpkfac.half_allreduce`). Both count as ``FactorComm`` where exposed:
an all-gather that delays a reduce-scatter past backward shows there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..factor_shapes import ShapeLike, as_shape, packed_numel
from ..schedule import AlphaBeta
from .cluster import Cluster
from .dpkfac import half_allreduce

__all__ = ["dear_models", "previous_allgathers"]


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
