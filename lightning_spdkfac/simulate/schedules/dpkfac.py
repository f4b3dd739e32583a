"""DP-KFAC in the simulator (issue 19): layer owners, factors reduced to them, preconditioned gradients broadcast.

``schedule="dpkfac"`` of the runtime (DP-KFAC, Zhang, Shi, Wang, Li 2022), as :func:`simulate_dpkfac` models it:

* every layer has one owner, from :func:`~lightning_spdkfac.schedule.plan_layer_placement` (the planner the
  runtime calls; LPT over layers by modelled inversion + preconditioning time);
* the compute stream is spd's (forward with A factors, backward with G factors); the factor reductions use
  spd's DTF fusion groups (planned with the all-reduce model, as spd's), each group split by owner into one
  *reduce* per ``(group, owner)`` part, all launched when the group's last factor is ready (pipelined),
  back to back on the one channel in plan order (parts in order of first member). A reduce is costed as
  half an all-reduce (``Cluster.reduce_scatter`` when the cluster has it, else ``alpha/2, beta/2`` of the
  all-reduce: a ring reduce moves each byte once per link, an all-reduce twice);
* the gradient all-reduce is launched when backward ends, as in every schedule;
* when the channel is free (the step has waited for the factor reductions and the gradients), each owner,
  for each of its layers in layer order, inverts A, inverts G and preconditions the gradient
  (``G^-1 dW A^-1``; ``Workload.precondition`` is split over the layers by ``2ag(a+g)`` flops, or
  :func:`~lightning_spdkfac.schedule.precondition_flops` where a factor is diagonal or grouped), and the
  preconditioned gradient (``g x a`` fp32 elements, ``b x g x a`` for a grouped layer) is broadcast from the owner
  to every rank;
* the broadcasts are issued by every rank in one order, each starting when the channel is free and its layer
  is preconditioned: ``"finish"`` (the runtime's, :func:`~lightning_spdkfac.schedule.preconditioned_order`,
  and ``dpkfac``'s): by predicted end of the layer's preconditioning (ties: layer order);
  ``broadcast_order="owner_turns"`` (``dpkfac-turns``): owners take turns (each owner's first layer, by owner
  rank, then each one's second, ...), which makes the first broadcast wait for the first owner's first layer.
  Non-owners hold no factor or inverse of the layer and do no inversion.

``"local"`` (the paper's local-factor variant, an approximation: factors from the owner's data only) computes
on each rank only the factors of the layers it owns and reduces none: the rank with the most factor computation
stands for all (the gradient all-reduce waits for it).

Categories: ``FactorComm`` the exposed reduces; ``InvComp`` the inversions of the rank whose own work ends last;
``InvComm`` 0 (no inverse is sent); ``Precondition`` that rank's preconditioning plus the exposed
preconditioned-gradient broadcasts (no new category: the broadcasts are the communication of preconditioning).

Lower bound (``extra["lower_bound_terms"]``): FF&BP + FactorComp (of the stream as simulated) + the exposed
GradComm + the larger of two tails after the channel is free: the largest per-layer chain ``inv(A) + inv(G) +
precondition + broadcast`` (a layer's work runs on one rank, and its broadcast follows it), and the shortest
layer's ``inv(A) + inv(G) + precondition`` then every broadcast (no broadcast starts before some layer is
done, and they share one channel); split into ``Inversion`` and ``Precondition``.

The memory of a simulated schedule, this one's included, is :mod:`..memory`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...factor_shapes import numel, packed_numel, preconditioned_shape
from ...schedule import LayerPlacement, plan_layer_placement, precondition_flops
from ...schedule.fusion import FusionPlan
from ..cluster import Cluster, half_allreduce
from ..sim_schedule import SimSchedule
from ..timeline_core import (
    Channel,
    Event,
    Piece,
    Timeline,
    compute_and_reductions,
    compute_pieces,
    factor_order,
    fusion_plan,
    grad_comm_seconds,
    ready_times,
)
from ..workload import Workload

__all__ = ["GRAD_BYTES", "STATE_BYTES", "gradient_bytes", "layer_placement", "simulate_dpkfac"]

GRAD_BYTES = 4  # preconditioned gradients are broadcast in fp32
STATE_BYTES = 4  # running factors and inverses are held in fp32


def layer_placement(workload: Workload, cluster: Cluster) -> LayerPlacement:
    """The runtime's layer owners for ``workload`` on ``cluster`` (:func:`plan_layer_placement`)."""
    return plan_layer_placement([(s.a_shape, s.g_shape) for s in workload.layers], cluster.world_size,
                                cluster.inverse, bytes_per_element=STATE_BYTES)


def gradient_bytes(spec: Any) -> int:
    """Bytes of one layer's preconditioned gradient as dpkfac broadcasts it (fp32): ``g x a`` elements, ``b x g x
    a`` for a grouped layer (:func:`~lightning_spdkfac.factor_shapes.preconditioned_shape`)."""
    return numel(preconditioned_shape(spec.a_shape, spec.g_shape)) * GRAD_BYTES


def _owner_parts(group: Sequence[int], owners: Sequence[int]) -> list[list[int]]:
    """A fusion group split by owner, parts in order of their first member."""
    parts: dict[int, list[int]] = {}
    for i in group:
        parts.setdefault(owners[i], []).append(i)
    return list(parts.values())


def _layer_flops(spec: Any) -> float:
    """Preconditioning flops of one layer: ``2ag(a + g)`` for dense factors (the formula as it always was),
    :func:`~lightning_spdkfac.schedule.precondition_flops` of the shapes otherwise."""
    if len(spec.a_shape) == 2 and len(spec.g_shape) == 2:
        return 2.0 * spec.a_side * spec.g_side * (spec.a_side + spec.g_side)
    return precondition_flops(spec.a_shape, spec.g_shape)


def _precondition_seconds(workload: Workload) -> list[float]:
    flops = [_layer_flops(s) for s in workload.layers]
    total = sum(flops)
    return [workload.precondition * f / total if total else 0.0 for f in flops]


def _turns(lp: LayerPlacement) -> list[int]:
    """Layers in broadcast order: owners take turns, each with its next layer in layer order."""
    owned = [lp.owned_by(r) for r in range(lp.world_size)]
    return [ls[j] for j in range(max(map(len, owned), default=0)) for ls in owned if j < len(ls)]


def _stream(workload: Workload, schedule: SimSchedule, lp: LayerPlacement) -> list[Piece]:
    """The compute stream; ``"local"``: the factors of the busiest rank's owned layers only."""
    pieces = compute_pieces(workload)
    if schedule.dpkfac != "local":
        return pieces
    per_rank = [sum(workload.times[i].a_factor + workload.times[i].g_factor for i in lp.owned_by(r))
                for r in range(lp.world_size)]
    rank = max(range(lp.world_size), key=lambda r: (per_rank[r], -r))
    return [p if p[3] is None or lp.owners[p[3][0]] == rank else (p[0], p[1], 0.0, p[3]) for p in pieces]


def _tail_bound(work: list[float], prec: list[float], sends: list[float]) -> dict[str, float]:
    """What follows the free channel at least: the longest layer chain (its inversions, preconditioning and
    broadcast on one rank), or the first layer done and then every broadcast on the one channel."""
    if not work:
        return {"Inversion": 0.0, "Precondition": 0.0}
    chain = max(range(len(work)), key=lambda i: work[i] + prec[i] + sends[i])
    first = min(range(len(work)), key=lambda i: work[i] + prec[i])
    if work[chain] + prec[chain] + sends[chain] >= work[first] + prec[first] + sum(sends):
        return {"Inversion": work[chain], "Precondition": prec[chain] + sends[chain]}
    return {"Inversion": work[first], "Precondition": prec[first] + sum(sends)}


def simulate_dpkfac(workload: Workload, cluster: Cluster, schedule: SimSchedule, shown: int) -> Timeline:
    """One iteration of ``schedule`` (``dpkfac`` ``"reduce"`` or ``"local"``): the module docstring. ``shown``:
    the events of ranks ``0 .. shown - 1`` are recorded."""
    world, layers = cluster.world_size, workload.layers
    lp = layer_placement(workload, cluster)
    order, sides = factor_order(workload)
    owners = tuple(lp.owners[i] for i, _ in order)
    pieces = _stream(workload, schedule, lp)
    ready, t_busy = ready_times(pieces)
    reduced = world > 1 and schedule.dpkfac == "reduce"
    plan = (fusion_plan(schedule, order, sides, [ready[k] for k in order], cluster.allreduce) if reduced
            else FusionPlan((), "dtf"))
    reduce = half_allreduce(cluster, "reduce_scatter")
    bpe = schedule.bytes_per_element

    def group_seconds(g: Sequence[int]) -> float:
        return sum(reduce.time(sum(packed_numel(sides[i]) for i in part) * bpe) for part in _owner_parts(g, owners))

    events: list[Event] = []
    channel = Channel(events)
    t_compute = compute_and_reductions(schedule, pieces, order, plan.groups, group_seconds, channel)
    grad = grad_comm_seconds(workload, cluster)
    if grad > 0:
        channel.run("GradComm", "gradient all-reduce", t_compute, grad)
    t_comm = max(channel.free, t_compute)

    inv, prec = cluster.inverse, _precondition_seconds(workload)
    work = [inv.time_of(s.a_shape) + inv.time_of(s.g_shape) for s in layers]
    done: dict[int, float] = {}
    rank_end = [t_comm] * world
    for r in range(world):
        t = t_comm
        for i in lp.owned_by(r):
            for label, sec in ((f"invert {layers[i].name}:A", inv.time_of(layers[i].a_shape)),
                               (f"invert {layers[i].name}:G", inv.time_of(layers[i].g_shape)),
                               (f"precondition {layers[i].name}", prec[i])):
                if r < shown:
                    events.append(Event(f"rank {r}", "InvComp" if label.startswith("invert") else "Precondition",
                                        label, t, t + sec))
                t += sec
            done[i] = t
        rank_end[r] = t
    sends = [cluster.broadcast.time(gradient_bytes(s)) if world > 1 else 0.0 for s in layers]
    by_finish = sorted(range(len(layers)), key=lambda i: (done[i], i))
    bcast_order = [] if world == 1 else _turns(lp) if schedule.broadcast_order == "owner_turns" else by_finish
    for i in bcast_order:
        channel.run("Precondition", f"broadcast preconditioned {layers[i].name}", done[i], sends[i])
    t_own = max(rank_end, default=t_comm)
    t_end = max(t_own, channel.free)
    critical = max(range(world), key=lambda r: (rank_end[r], -r))
    owned = lp.owned_by(critical)
    grad_exposed = min(grad, t_comm - t_compute)
    factor_comp = t_busy - workload.ff_bp
    breakdown = {
        "FF&BP": workload.ff_bp, "GradComm": grad_exposed, "FactorComp": factor_comp,
        "FactorComm": max(0.0, t_comm - t_busy - grad_exposed),
        "InvComp": sum(work[i] for i in owned), "InvComm": 0.0,
        "Precondition": sum(prec[i] for i in owned) + (t_end - t_own),
    }
    terms = {"FF&BP": workload.ff_bp, "GradComm": grad_exposed, "FactorComp": factor_comp,
             **_tail_bound(work, prec, sends)}
    return Timeline(events=events, breakdown=breakdown, groups=plan.groups, order=order, owners=owners,
                    extra={"t_compute": t_compute, "t_comm": t_comm, "t_inv": t_own, "sides": sides,
                           "schedule": schedule, "broadcast_order": bcast_order, "lower_bound_terms": terms,
                           "layer_placement": lp})

