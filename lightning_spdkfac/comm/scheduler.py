"""The D-KFAC / MPD-KFAC / SPD-KFAC schedules as a :class:`~lightning_spdkfac.kfac.distributor.Distributor`.

This is where the planners (:mod:`lightning_spdkfac.schedule`) meet the executors
(:class:`FusedAllReduce`, :class:`InverseBroadcaster`). Per optimizer step:

* factor reduction: the step's A and G factors of every layer are averaged over ranks in the
  groups of a fusion plan. Pipelined, each factor is handed over from the hooks the moment it
  is final and its group's all-reduce starts as soon as the group is complete, so communication
  runs under the rest of forward/backward; otherwise everything is submitted in ``step()``.
* inversion: every factor is inverted by its owner under a placement, which broadcasts the
  inverse (or, with ``inverse_method="eigen"``, the eigen payload) asynchronously, or by every rank
  (replicated). The preconditioner's ``inverse_method`` comes with ``setup()``'s context; the cost models and
  the broadcaster follow it.

Planning (SPD): at start-up the all-reduce and broadcast alpha-beta models are measured on the
factor process group (identical numbers on every rank) and rank 0's inversion-time model is
broadcast. The first ``profile_steps[1]`` factor steps run a measuring mode (factors held until
``step()``, then one all-reduce); the ready times of steps in ``[profile_steps[0],
profile_steps[1])`` are taken on rank 0 and broadcast, and the fusion plan is made from them on
every rank. So every rank derives the identical plan.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

from .. import validation as val
from ..factor_shapes import FactorShape, ShapeLike, check_shapes, is_diagonal, packed_numel, side
from ..kfac.distributor import (
    Distributor,
    DistributorContext,
    FactorKey,
    Inverse,
    PendingInverses,
    ReducedFactors,
    Task,
)
from ..schedule import (
    AlphaBeta,
    InverseCost,
    broadcast_order,
    fit_alpha_beta,
    measure_inverse_cost,
    plan_fusion,
    plan_placement,
)
from ..schedule.placement import message_bytes
from ..vocabulary import LOAD_BALANCED_PLACEMENTS
from ._common import default_device, distributed_ready
from .broadcast import InverseBroadcaster
from .clock import clock_for
from .consistency import check_plan_consistency
from .faults import INVERSE_BROADCAST, stream_ordered, wait_work
from .fused import FusedAllReduce, StepTimings
from .profile import broadcast_object, measure_allreduce, measure_broadcast, probe_sizes

# (SPDOptions and its bounds live in spd_options.py; imported from here by older code, so re-exported)
from .spd_options import MAX_COMM_TIMEOUT_S, MIN_COMM_TIMEOUT_S, SPDOptions  # noqa: F401


def _layer_shapes(sides: object) -> list[tuple[FactorShape, FactorShape]]:
    """``setup``'s argument checked: per layer, ``(A shape, G shape)``, each an int n (n x n) or a FactorShape."""
    if isinstance(sides, (str, bytes)) or not isinstance(sides, Sequence):
        raise TypeError(f"sides must be a sequence of (A shape, G shape) pairs, one per layer, got a "
                        f"{type(sides).__name__}")
    out = []
    for i, pair in enumerate(sides):
        if not isinstance(pair, Sequence) or isinstance(pair, str) or len(pair) != 2:
            raise ValueError(f"sides[{i}] must be the pair (A shape, G shape) of layer {i}, got {pair!r}")
        a, g = check_shapes(f"sides[{i}]", pair)
        out.append((a, g))
    return out


@dataclass(frozen=True)
class Models:
    """The measured cost models every rank plans from (identical on every rank)."""

    allreduce: AlphaBeta
    broadcast: AlphaBeta
    inverse: InverseCost


@dataclass
class SharedPlanning:
    """What distributors that run one job in turn share (``schedule="auto"``'s candidates, comm/auto.py): the cost
    models, measured by the first to set up and planned from by every one, and the process group of asynchronous
    inverse broadcasts, created once (by the first that needs it) and destroyed once (by the first to close)."""

    models: Models | None = None
    async_group: dist.ProcessGroup | None = None


class SPDDistributor(Distributor):
    """K-FAC's cross-rank work under one of the schedules of :class:`SPDOptions`."""

    def __init__(self, options: SPDOptions, process_group: dist.ProcessGroup | None = None,
                 device: torch.device | str | None = None, *, shared: SharedPlanning | None = None) -> None:
        val.check_instance("options", options, SPDOptions)
        self.options = options
        self.process_group = process_group
        self._dist = distributed_ready(process_group)
        self.world_size = dist.get_world_size(process_group) if self._dist else 1
        self.rank = dist.get_rank(process_group) if self._dist else 0
        # Where receive buffers live: the current GPU under NCCL (whose buffers must be there), else the CPU; the
        # strategies pass their root device.
        self.device = torch.device(device) if device is not None else default_device(process_group)
        self.pipelined = False
        # The cost models and the asynchronous group (own, or shared with the other candidates of schedule="auto").
        self.shared = SharedPlanning() if shared is None else shared
        self.factor_steps = 0  # steps in which factors were reduced
        self._measuring = False
        self._profile_window = options.profile_steps
        self._timings: list[dict[FactorKey, float]] = []
        # Ready times of the measured steps (DTF): stamps of one clock, CUDA events on a GPU (comm/clock.py), turned
        # into seconds once at the end of each measured step.
        self._clock = clock_for(self.device)
        self._t_begin: object = None
        self._step_ready: dict[FactorKey, object] = {}
        self._held: dict[FactorKey, torch.Tensor | None] = {}
        self.plan_groups: tuple[tuple[int, ...], ...] = ()
        self.placement_owners: tuple[int, ...] = ()
        self.last_broadcast_order: list[FactorKey] = []  # the owned factors, as the last inversion issued them

    @property
    def models(self) -> Models | None:
        """The measured cost models (None before setup)."""
        return self.shared.models

    @models.setter
    def models(self, value: Models | None) -> None:
        self.shared.models = value

    @property
    def _async_group(self) -> dist.ProcessGroup | None:
        """The process group of asynchronous inverse broadcasts (async_inverses): a group of its own, so that the
        worker's broadcasts never interleave with what the caller's thread issues on process_group meanwhile
        (pipelined factor all-reduces, plan checks), whose order would then differ from rank to rank."""
        return self.shared.async_group

    @_async_group.setter
    def _async_group(self, group: dist.ProcessGroup | None) -> None:
        self.shared.async_group = group

    @property
    def measuring(self) -> bool:
        """Whether the factors' ready times are being measured (the profile steps, before a pipelined plan)."""
        return self._measuring

    # ------------------------------------------------------------------ setup and planning
    def setup(self, sides: Sequence[tuple[ShapeLike, ShapeLike]], context: DistributorContext) -> None:
        super().setup(sides, context)
        self.sides = _layer_shapes(sides)
        if self.use_async_inverses():
            self._new_async_group()
        n_layers = len(self.sides)
        # Canonical factor order: A in forward order, then G in backward order (the order in
        # which they are ready); the pipelined plan replaces it with the measured order.
        self.keys: list[FactorKey] = [(i, "A") for i in range(n_layers)] + [(i, "G") for i in reversed(range(n_layers))]
        self._canonical = {k: i for i, k in enumerate(self.keys)}
        self._measure_models()
        self.placement_owners = self._plan_placement()
        if self.options.needs_profile:
            self._start_measuring(self.options.profile_steps)
        else:
            groups = self._plan_groups(self.keys, [0.0] * len(self.keys))
            self._set_plan(self.keys, groups, pipelined=self.options.pipelining)

    def _new_async_group(self) -> None:
        """The asynchronous broadcasts' process group (every rank of the default group creates it, in step)."""
        if not self._dist or self.world_size == 1 or self._async_group is not None or self.options.placement == "replicated":
            return  # (replicated: every rank inverts everything, nothing is broadcast)
        ranks = dist.get_process_group_ranks(self.process_group) if self.process_group is not None else None
        self._async_group = dist.new_group(ranks=ranks, backend=dist.get_backend(self.process_group),
                                           timeout=timedelta(seconds=self.options.comm_timeout_s))
        # Initialised now, from this (the training) thread, by one tiny collective: NCCL creates a communicator at
        # its first collective, which must not be an inverse broadcast in the middle of a step.
        probe = torch.zeros(1, device=self.device)
        wait_work(dist.all_reduce(probe, group=self._async_group, async_op=True), self.options.comm_timeout_s,
                  collective="all_reduce", phase=INVERSE_BROADCAST, what="the asynchronous group's first collective",
                  rank=self.rank, world_size=self.world_size, stream_only=stream_ordered(self._async_group))

    def use_async_inverses(self) -> bool:
        own = self.options.async_inverses
        return self.context.async_inverses if own is None or own == "auto" else own

    def average_scalars(self, values: torch.Tensor) -> torch.Tensor:
        """One all-reduce on the factor process group, from the caller's thread between steps (its factor
        reductions are done by then; asynchronous inverse broadcasts use a group of their own)."""
        if not self._dist or self.world_size == 1:
            return values
        buf = values.to(device=self.device, dtype=torch.float64)
        dist.all_reduce(buf, group=self.process_group)
        return (buf / self.world_size).to(values.device)

    def close(self) -> None:
        if self._async_group is not None and dist.is_initialized():
            dist.destroy_process_group(self._async_group)
        self._async_group = None

    def _start_measuring(self, window: tuple[int, int]) -> None:
        """Time the factors' ready times over factor steps ``[window[0], window[1])``: meanwhile they
        are held until ``step()`` and reduced in one all-reduce, free of communication interference."""
        self._measuring = True
        self._profile_window = window
        self._set_plan(self.keys, [tuple(range(len(self.keys)))], pipelined=False)

    def _shape(self, key: FactorKey) -> FactorShape:
        """The shape of factor ``key`` (as given to :meth:`setup`; an int n there is ``(n, n)`` here)."""
        a, g = self.sides[key[0]]
        return a if key[1] == "A" else g

    def _measure_models(self) -> None:
        if self.models is not None:  # given (schedule="auto" measures once for every candidate)
            return
        opts = self.options
        need_allreduce = opts.fusion == "dtf"
        need_placement = opts.placement in LOAD_BALANCED_PLACEMENTS and opts.schedule != "dpkfac"
        need_inverse = need_placement or opts.schedule == "dpkfac"  # (dpkfac: the layer placement's model)
        zero = AlphaBeta(0.0, 0.0)
        # Probe up to the largest message: a packed factor (all-reduce) or its inverse (broadcast).
        tri_bytes = [packed_numel(self._shape(k)) * opts.bytes_per_element for k in self.keys]
        inv_bytes = [message_bytes(self._shape(k), opts.bytes_per_element, self.context.inverse_method) for k in self.keys]
        allreduce = broadcast = zero
        inverse = InverseCost()
        if self._dist and tri_bytes and (need_allreduce or need_placement):
            sizes = probe_sizes(max(tri_bytes + (inv_bytes if need_placement else [])))
            if need_allreduce:
                allreduce = fit_alpha_beta(sizes, measure_allreduce(sizes, self.process_group, repeats=5))
            if need_placement:
                broadcast = fit_alpha_beta(sizes, measure_broadcast(sizes, self.process_group, repeats=5))
        # The inversion model is fitted on dense blocks (a grouped factor's blocks have its side); a diagonal
        # factor's elementwise inversion is charged c0 + c1 n by it (InverseCost.time_of), nothing to probe.
        ns = sorted({side(s) for s in map(self._shape, self.keys) if not is_diagonal(s)})
        if need_inverse and ns:
            probe = sorted({ns[0], ns[len(ns) // 2], ns[-1], max(8, ns[-1] // 2)})
            inverse = broadcast_object(
                measure_inverse_cost(probe, device=self.device, method=self.context.inverse_method) if self.rank == 0 else None,
                src=0, group=self.process_group,
            )
        self.models = Models(allreduce=allreduce, broadcast=broadcast, inverse=inverse)

    def _plan_groups(self, order: list[FactorKey], ready: list[float]) -> list[tuple[int, ...]]:
        opts = self.options
        elements = [packed_numel(self._shape(k)) for k in order]
        # fuse_g=False: the original SPD-KFAC code, G factors each on their own, runs of A factors fused.
        alone = () if opts.fuse_g else [pos for pos, key in enumerate(order) if key[1] == "G"]
        assert self.models is not None  # measured in setup()
        plan = plan_fusion(elements, ready, self.models.allreduce, policy=opts.fusion,
                           bucket_bytes=int(opts.bucket_mb * 2**20), bytes_per_element=opts.bytes_per_element,
                           alone=alone)
        return [tuple(g) for g in plan.groups]

    def _plan_placement(self) -> tuple[int, ...]:
        opts = self.options
        ns = [self._shape(k) for k in self.keys]
        if not ns:
            return ()
        assert self.models is not None  # measured in setup()
        placement = plan_placement(ns, self.world_size, self.models.inverse, self.models.broadcast,
                                   policy=opts.placement, bytes_per_element=opts.bytes_per_element,
                                   small_threshold=opts.small_factor, inverse_method=self.context.inverse_method)
        return tuple(placement.owners)

    def _set_plan(self, order: list[FactorKey], groups: Sequence[Sequence[int]], pipelined: bool) -> None:
        self.order = list(order)
        self.position = {k: i for i, k in enumerate(self.order)}
        self.plan_groups = tuple(tuple(g) for g in groups)
        self.pipelined = pipelined
        self._fused = FusedAllReduce(
            self.plan_groups, [self._shape(k) for k in self.order], process_group=self.process_group,
            dtype=self.options.torch_comm_dtype, allow_missing=True, result_dtype=torch.float32,
            device=self.device, timeout=self.options.comm_timeout_s, names=[f"layer {i} {w}" for i, w in self.order],
            destinations=self._destinations(self.order, self.plan_groups),
        )
        check_plan_consistency(self.order, self.plan_groups, self.placement_owners, self._fused.shapes,
                               self.process_group, self.options.comm_timeout_s, settings=self.context.settings,
                               broadcast=self._planned_broadcast_order())

    def _destinations(self, order: Sequence[FactorKey], groups: Sequence[Sequence[int]]) -> list[int] | None:
        """The rank each fusion group is reduced to; None: every group is all-reduced (dpkfac reduces to owners)."""
        return None

    def _finish_profile(self) -> None:
        """Plan the fusion from the measured ready times (rank 0's, broadcast) on every rank."""
        window = [t for t in self._timings if len(t) == len(self.keys)]
        summary = None
        if self.rank == 0 and window:
            summary = {k: statistics.median(t[k] for t in window) for k in self.keys}
        summary = broadcast_object(summary, src=0, group=self.process_group)
        self._timings.clear()
        self._measuring = False
        if summary is None:  # no complete step measured: keep the canonical order
            order, ready = list(self.keys), [0.0] * len(self.keys)
        else:
            order = sorted(self.keys, key=lambda k: (summary[k], self._canonical[k]))
            t0 = summary[order[0]]
            ready = [summary[k] - t0 for k in order]
        self._set_plan(order, self._plan_groups(order, ready), pipelined=self.options.pipelining)

    # ------------------------------------------------------------------ per step
    def begin_step(self, step: int) -> None:
        opts = self.options
        if opts.needs_profile:
            if self._measuring and self.factor_steps >= self._profile_window[1]:
                self._finish_profile()
            elif (not self._measuring and opts.replan_every
                  and self.factor_steps > 0 and self.factor_steps % opts.replan_every == 0):
                length = opts.profile_steps[1] - opts.profile_steps[0]
                self._start_measuring((self.factor_steps, self.factor_steps + length))
            if self._measuring:
                self.pipelined = True  # hand factors over from the hooks, to time them
        self._held = {}
        self._step_ready = {}
        self._t_begin = self._clock.stamp() if self._measuring else None
        self._fused.begin_step()

    def factor_final(self, index: int, which: str, matrix: torch.Tensor | None) -> None:
        key = (index, which)
        if self._measuring:
            self._step_ready[key] = self._clock.stamp()  # no host read in the hook: seconds at the step's end
            self._held[key] = matrix
        else:
            self._fused.submit(self.position[key], matrix)

    def reduce_factors(self, local: dict[FactorKey, torch.Tensor | None]) -> dict[FactorKey, torch.Tensor | None]:
        pending = {**self._held, **local}
        with record_function("kfac/factor_comm_wait"):
            t0 = time.perf_counter()
            for key in sorted(pending, key=self.position.__getitem__):  # plan order: groups launch in order
                self._fused.submit(self.position[key], pending[key])
            t1 = time.perf_counter()
            reduced = self._fused.wait(defer_missing=True)  # presence stays on the device: no host read here
        self._account_factor_comm(self._fused.last_timings, pack_seconds=t1 - t0)
        self._held = {}
        if self._measuring and self.factor_steps >= self._profile_window[0] and self._step_ready:
            keys = list(self._step_ready)
            seconds = self._clock.seconds(self._t_begin, [self._step_ready[k] for k in keys])
            self._timings.append(dict(zip(keys, seconds)))
        self.factor_steps += 1
        present = self._fused.last_present
        flags = {key: flag for key in self.order if (flag := present[self.position[key]]) is not None}
        return ReducedFactors({key: reduced[self.position[key]] for key in self.order}, flags)

    def _account_factor_comm(self, t: StepTimings | None, pack_seconds: float) -> None:
        """Split the step's factor communication into exposed wait, packing and in-flight time."""
        if t is None:
            return
        done = [g for g in range(len(t.launch)) if t.work_end[g] == t.work_end[g]]  # not NaN
        self.context.timer.add("factor_comm_wait", sum(t.work_end[g] - t.wait_start[g] for g in done))
        self.context.timer.add("factor_pack", pack_seconds + sum(t.wait_end[g] - t.work_end[g] for g in done))
        inflight, end = 0.0, float("-inf")
        for start, stop in sorted((t.launch[g], t.work_end[g]) for g in done):
            if stop > end:
                inflight += stop - max(start, end)
                end = stop
        self.context.timer.add("factor_comm_inflight", inflight)

    def _owners(self, tasks: Sequence[Task]) -> list[int]:
        return [self.placement_owners[self._canonical[(t[0], t[1])]] if self.world_size > 1 else -1 for t in tasks]

    def _broadcaster(self, tasks: Sequence[Task], owners: list[int], group: dist.ProcessGroup | None
                     ) -> tuple[InverseBroadcaster, list[int]]:
        """A broadcast round of ``tasks`` on ``group``, in the order every rank issues them."""
        shapes = [self._shape((t[0], t[1])) for t in tasks]
        order = self._broadcast_order(tasks, owners, shapes)
        self.last_broadcast_order = [(tasks[i][0], tasks[i][1]) for i in order]
        bc = InverseBroadcaster(owners, shapes, process_group=group,
                                dtype=self.options.torch_comm_dtype, result_dtype=self.context.inv_dtype,
                                device=self.device, order=order, timeout=self.options.comm_timeout_s,
                                names=[f"layer {t[0]} {t[1]}" for t in tasks], inverse_method=self.context.inverse_method)
        return bc, order

    def invert(
        self,
        tasks: Sequence[Task],
        invert_fn: Callable[[list[Task]], list[torch.Tensor]],
        on_ready: Callable[[int, str, torch.Tensor], None],
    ) -> None:
        owners = self._owners(tasks)
        if all(o == -1 for o in owners):
            super().invert(tasks, invert_fn, on_ready)
            return
        computed = self._compute(tasks, owners, invert_fn)
        self._exchange(tasks, owners, computed, self.process_group, on_ready)

    def _compute(self, tasks: Sequence[Task], owners: Sequence[int],
                 invert_fn: Callable[[list[Task]], list[torch.Tensor]]) -> dict[int, torch.Tensor]:
        """This rank's inverses of the round (the factors it owns, and the replicated ones), by position in
        ``tasks``: one call of ``invert_fn`` for all of them, so that they are inverted batched by size with one
        finiteness read (kfac/inverse.py), not one factor (and one host read) at a time."""
        mine = self._mine(owners)
        if not mine:
            return {}
        return dict(zip(mine, invert_fn([tasks[i] for i in mine]), strict=True))

    def _mine(self, owners: Sequence[int]) -> list[int]:
        """Positions of a round's factors this rank inverts: those it owns and the replicated ones."""
        return [i for i, o in enumerate(owners) if o in (-1, self.rank)]

    def _exchange(self, tasks: Sequence[Task], owners: list[int], computed: dict[int, torch.Tensor],
                  group: dist.ProcessGroup | None, on_ready: Callable[[int, str, torch.Tensor], None]) -> None:
        """Broadcast the owned inverses of ``computed`` and receive the others, in the order every rank issues them;
        ``on_ready`` for each as soon as it is here (replicated and own ones first), so the preconditioner works on
        those layers while later broadcasts are still in flight."""
        bc, order = self._broadcaster(tasks, owners, group)
        bc.begin_round()
        bc.exchange(computed.pop)
        arrival = self._mine(owners)
        arrival += [i for i in order if owners[i] != self.rank]
        for i in arrival:
            t0 = time.perf_counter()
            inverse = bc.wait(i)
            self.context.timer.add("inverse_comm_wait", time.perf_counter() - t0)
            on_ready(tasks[i][0], tasks[i][1], inverse)
        with self.context.timer.phase("inverse_comm_wait"):
            bc.wait_all()  # this rank's own broadcasts

    def invert_async(self, tasks: Sequence[Task],
                     invert_fn: Callable[[list[Task]], list[torch.Tensor]]) -> PendingInverses:
        """:meth:`invert`'s round with its computation on a worker thread, which only computes. The broadcasts are
        issued by the caller's (training) thread when it waits for the round (the next step's ``step()``, the same
        point on every rank), on the asynchronous group, in the same order on every rank: collectives never leave
        the threads NCCL allows them on."""
        tasks = list(tasks)
        owners = self._owners(tasks)
        if all(o == -1 for o in owners):
            return super().invert_async(tasks, invert_fn)
        self._new_async_group()  # (created at setup whenever async inverses are on from the start)
        mine = self._mine(owners)

        def run() -> list[Inverse]:  # the worker: compute only
            computed = self._compute(tasks, owners, invert_fn)
            return [(tasks[i][0], tasks[i][1], inverse) for i, inverse in computed.items()]

        def then(results: list[Inverse]) -> list[Inverse]:  # the caller's thread: the broadcasts
            computed = {i: inverse for i, (_, _, inverse) in zip(mine, results, strict=True)}
            arrived: dict[FactorKey, torch.Tensor] = {}
            self._exchange(tasks, owners, computed, self._async_group,
                           lambda index, which, inverse: arrived.__setitem__((index, which), inverse))
            return [(t[0], t[1], arrived[(t[0], t[1])]) for t in tasks]

        # The factors' device decides the worker's stream (a CUDA side stream for CUDA factors), as in one process.
        return PendingInverses(run, tasks[0][2].device, timeout=self.options.comm_timeout_s, then=then,
                               what=f"K-FAC asynchronous inversions (rank {self.rank})")

    def _broadcast_order(self, tasks: Sequence[Task], owners: Sequence[int], sides: Sequence[FactorShape]
                         ) -> list[int]:
        """Positions in ``tasks`` of the owned factors, in the order every rank issues their broadcasts:
        :func:`~lightning_spdkfac.schedule.placement.broadcast_order` over the tasks in canonical factor
        order (the placement's), with the inversion model every rank holds (rank 0's). Each owner inverts
        in this order too (:meth:`InverseBroadcaster.exchange`), so the predicted finishes hold."""
        assert self.models is not None  # measured in setup()
        canonical = sorted(range(len(tasks)), key=lambda i: self._canonical[(tasks[i][0], tasks[i][1])])
        issue = broadcast_order([owners[i] for i in canonical], [sides[i] for i in canonical], self.models.inverse)
        return [canonical[k] for k in issue]

    def _planned_broadcast_order(self) -> list[FactorKey]:
        """The broadcast order of an inverse step that inverts every factor (for the cross-rank plan check)."""
        if self.world_size == 1 or not self.placement_owners:
            return []
        assert self.models is not None  # measured in setup()
        ns = [self._shape(k) for k in self.keys]
        return [self.keys[i] for i in broadcast_order(self.placement_owners, ns, self.models.inverse)]

    def describe(self) -> dict[str, Any]:
        """The current plan, for logs and tests."""
        return {
            "schedule": self.options.schedule,
            "pipelined": self.pipelined,
            "measuring": self._measuring,
            "order": list(self.order),
            "groups": [list(g) for g in self.plan_groups],
            "owners": list(self.placement_owners),
            "broadcast_order": list(self.last_broadcast_order),  # of the last inverse step
            "models": self.models,
        }
