"""Distributed preconditioning (DP-KFAC, Zhang, Shi, Wang, Li 2022) as ``schedule="dpkfac"``.

Under the other schedules every rank holds every layer's running factors and inverses. Here a layer is the
unit of work and has one owner (:func:`~lightning_spdkfac.schedule.plan_layer_placement`):

* **factors**: each step's A and G of a layer are *reduced* to its owner only (``dist.reduce`` of fused
  buffers, one per fusion group of one owner's factors, launched from the hooks as they become final, like
  spd's all-reduces); the other ranks get nothing back and keep no running factor of the layer;
* **inverses**: the owner inverts its layers' factors locally (no inverse broadcast; with
  ``async_inverses`` on a worker thread, also without communication);
* **preconditioning**: the owner preconditions its layers' gradients and broadcasts each result to every
  rank (:class:`GradientBroadcaster`): each broadcast is launched as soon as its result is computed, in one
  global order, that of predicted finish (:func:`~lightning_spdkfac.schedule.preconditioned_order`), while
  the owner goes on with its next layer. Every rank then
  holds the same preconditioned gradients (the owner's tensors, bit for bit) and computes the same KL clip.

So a rank holds about ``1/P`` of the K-FAC state: that is what makes K-FAC fit beside ZeRO 1/2. Per step it
sends a reduce of the factors (about half an all-reduce's volume with ring algorithms) plus one broadcast of
each preconditioned gradient (the size of the gradient), and no inverse.

Two things every rank must still agree on, because they decide which collectives run: whether a step's factor
update is skipped for non-finite values (only owners see their factors; :meth:`DPKFACDistributor.agree_tensor` is one
all-reduce of one flag per factor step, read with the finiteness verdict), and whether a layer was preconditioned at all (its owner may have no
inverse yet): the broadcast payload carries a flag after the gradient.

Checkpoints stay independent of the world size: :meth:`DPKFACDistributor.gather_layers` gives every rank every
layer's state (moved to the host, one layer at a time), and a loaded state keeps the owned layers only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..factor_shapes import FactorShape, ShapeLike, numel, packed_numel, preconditioned_shape
from ..kfac.distributor import (
    Distributor,
    DistributorContext,
    FactorKey,
    LayerTensors,
    OwnerHeld,
    PendingInverses,
    ReducedFactors,
    Task,
)
from ..schedule import plan_fusion, plan_layer_placement, preconditioned_order
from ..schedule.layer_placement import LayerPlacement
from ._common import NAN, default_device, global_rank
from .executor import CollectiveExecutor
from .faults import FINITE_AGREEMENT, PRECONDITIONED_BROADCAST, STATE_GATHER, Work, stream_ordered, wait_work
from .scheduler import SPDDistributor, SPDOptions

__all__ = ["DPKFACDistributor", "GradientBroadcaster"]


def _gradient_shape(name: str, shape: object) -> FactorShape:
    """A preconditioned gradient's shape: ``(rows, columns)`` or ``(b, rows, columns)``, positive ints."""
    if (not isinstance(shape, Sequence) or isinstance(shape, str) or len(shape) not in (2, 3)
            or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape)):
        raise TypeError(f"{name} must be a gradient shape, (rows, columns) or (b, rows, columns) ints (see "
                        f"factor_shapes.preconditioned_shape), got {shape!r}")
    if any(d < 1 for d in shape):
        raise ValueError(f"{name} must have every dimension >= 1, got {shape!r}")
    return tuple(shape)


class GradientBroadcaster(CollectiveExecutor):
    """One round per step: each layer's preconditioned gradient broadcast by its owner, in one global order.

    Args:
        owners: owner rank (in ``process_group``) of each layer.
        shapes: the shape of each layer's gradient matrix and so of its preconditioned gradient: ``(rows,
            columns)``, or ``(b, rows, columns)`` for a layer with a grouped factor
            (:func:`~lightning_spdkfac.factor_shapes.preconditioned_shape`).
        process_group, device, timeout, names: as for the other executors.
        dtype: of the preconditioned gradients on the wire and as received (the preconditioner's inv_dtype).
        order: the global order of the layers' broadcasts (every layer once), identical on every rank; each
            owner's layers must come in the order it offers them for its sends not to wait on each other.

    A round exchanges the layers :meth:`begin_round` names (the same on every rank). The owner hands each of
    them to :meth:`offer` (its preconditioned gradient, or None: left as it is), in any order; broadcasts are
    issued in the round's order as far as this rank can go (a receive is posted at once, a send once offered).
    :meth:`finish` offers None for what the owner did not offer, waits, and returns every layer's result.
    """

    unit = "round"
    collective = "broadcast"
    phase = PRECONDITIONED_BROADCAST

    def __init__(self, owners: Sequence[int], shapes: Sequence[Sequence[int]],
                 process_group: dist.ProcessGroup | None = None, device: torch.device | str | None = None,
                 timeout: float = 600.0, names: Sequence[str] | None = None, *,
                 dtype: torch.dtype = torch.float32, order: Sequence[int]) -> None:
        checked = [_gradient_shape(f"shapes[{i}]", s) for i, s in enumerate(shapes)]
        super().__init__([(max(1, numel(s)),) for s in checked], timeout, names)  # (labels and checks only)
        self.shapes = tuple(checked)  # gradient shapes here, not factor shapes
        self.owners = tuple(int(o) for o in owners)
        if len(self.owners) != len(self.shapes):
            raise ValueError(f"owners and shapes must have the same length, got {len(self.owners)} and {len(self.shapes)}")
        self._join(process_group)
        self.device = torch.device(device) if device is not None else default_device(process_group)
        self.dtype = dtype
        self.order = tuple(int(i) for i in order)
        if sorted(self.order) != list(range(len(self.owners))):
            raise ValueError(f"order must list every layer once, got {list(self.order)}")
        self.last_flags: dict[int, torch.Tensor] = {}
        self._clear()

    def _clear(self) -> None:
        self._round: list[int] = []
        self._pos = 0
        self._offered: dict[int, torch.Tensor | None] = {}
        self._posted: dict[int, tuple[torch.Tensor, Work | None]] = {}
        self._t_begin = NAN

    def _describe(self, key: int) -> str:
        owner = self.owners[key]
        who = "this rank" if owner == self.rank else f"rank {owner}"
        return f"the preconditioned gradient of {self.names[key]} (from its owner, {who})"

    def _in_flight(self) -> list[tuple[int, Work]]:
        return [(i, w) for i, (_, w) in self._posted.items() if w is not None]

    def begin_round(self, layers: Sequence[int]) -> None:
        """Start the step's exchange of ``layers`` (identical on every rank)."""
        with self._lock:
            self._check_usable("begin_round()")
            if self._active:
                raise RuntimeError("GradientBroadcaster.begin_round() while the previous round is unfinished; "
                                   "call finish() (or reset()) first")
            self._clear()
            wanted = set(layers)
            self._round = [i for i in self.order if i in wanted]
            self._active = True
            self._t_begin = time.perf_counter()
        self._pump()

    def in_round(self, index: int) -> bool:
        return self._active and index in self._round and index not in self._offered

    def offer(self, index: int, value: torch.Tensor | None) -> None:
        """On the owner: layer ``index``'s preconditioned gradient (None: this layer is left unpreconditioned)."""
        with self._lock:
            self._check_usable(f"offer({index})")
            if self.owners[index] != self.rank:
                raise RuntimeError(f"offer({index}) on rank {self.rank}, but layer {index} is owned by rank "
                                   f"{self.owners[index]}")
            if index in self._offered:
                raise RuntimeError(f"layer {index} was already offered in this round")
            if value is not None and tuple(value.shape) != self.shapes[index]:
                raise ValueError(f"layer {index}'s preconditioned gradient must have shape {self.shapes[index]}, "
                                 f"got {tuple(value.shape)}")
            self._offered[index] = value
        self._pump()

    def _pump(self) -> None:
        """Issue the round's broadcasts in order, as far as this rank can (a send waits for its offer)."""
        with self._lock:
            while self._pos < len(self._round):
                i = self._round[self._pos]
                size = numel(self.shapes[i])
                if self.owners[i] == self.rank:
                    if i not in self._offered:
                        return
                    # Every rank's buffer of one broadcast has the same size and dtype, whatever the owner offers
                    # (None included): receivers cannot know which.
                    value = self._offered[i]
                    buf = torch.zeros(size + 1, dtype=self.dtype,
                                      device=value.device if value is not None else self.device)
                    if value is not None:
                        buf[:-1].copy_(value.reshape(-1))
                        buf[-1].fill_(1.0)  # (a fill: a Python scalar set into a CUDA tensor is a host copy)
                else:
                    buf = torch.empty(size + 1, dtype=self.dtype, device=self.device)
                work = None
                if self._distributed:
                    work = self._issue(i, self._launcher(buf, global_rank(self.process_group, self.owners[i])))
                self._posted[i] = (buf, work)
                self._pos += 1

    def _launcher(self, buf: torch.Tensor, src: int) -> Callable[[], Work]:
        return lambda: dist.broadcast(buf, src=src, group=self.process_group, async_op=True)

    def finish(self, defer_flags: bool = False) -> dict[int, torch.Tensor | None]:
        """Offer None for every owned layer not offered, wait for the round; every layer's result by index
        (None: its owner left it unpreconditioned), from one host read of the flags. ``defer_flags``: no host read,
        a received layer's result is its buffer whatever the owner sent, and the flags stay on the device, in
        :attr:`last_flags` (a 0-dim boolean per received layer: True where the owner sent a gradient)."""
        for i in self._round:
            if self.owners[i] == self.rank and i not in self._offered:
                self.offer(i, None)
        with self._lock:
            posted = [(i, *self._posted[i]) for i in self._round]
        for i, _, work in posted:
            if work is not None:
                self._wait(i, work)
        out: dict[int, torch.Tensor | None] = {}
        received = [(i, buf) for i, buf, _ in posted if self.owners[i] != self.rank]
        if defer_flags:
            self.last_flags = {i: buf[-1].eq(1.0) for i, buf in received}
            for i, buf in received:
                out[i] = buf[:-1].view(self.shapes[i])
        else:
            flags = torch.stack([buf[-1] for _, buf in received]).tolist() if received else []
            for (i, buf), flag in zip(received, flags):
                out[i] = buf[:-1].view(self.shapes[i]) if flag == 1.0 else None
        for i in self._round:
            if self.owners[i] == self.rank:
                out[i] = self._offered[i]
        with self._lock:
            self._end()
        return out


class DPKFACDistributor(SPDDistributor, OwnerHeld):
    """``schedule="dpkfac"``: every layer's K-FAC state and work on its owner only (module docstring)."""

    def __init__(self, options: SPDOptions, process_group: dist.ProcessGroup | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__(options, process_group, device)
        self.layer_placement: LayerPlacement | None = None
        self._grads: GradientBroadcaster | None = None
        self._owner: tuple[int, ...] = ()  # = layer_owners, typed as set (setup)

    # ------------------------------------------------------------------ planning
    def setup(self, sides: Sequence[tuple[ShapeLike, ShapeLike]], context: DistributorContext) -> None:
        super().setup(sides, context)
        shapes = [preconditioned_shape(a, g) for a, g in self.sides]
        assert self.models is not None  # measured by super().setup()
        self._grads = GradientBroadcaster(self._owner, shapes, process_group=self.process_group,
                                          device=self.device, timeout=self.options.comm_timeout_s,
                                          names=[f"layer {i}" for i in range(len(self.sides))],
                                          dtype=self.context.inv_dtype,
                                          order=preconditioned_order(self.sides, self._owner,
                                                                     self.models.inverse))

    def _plan_placement(self) -> tuple[int, ...]:
        """The layer placement, and each factor's owner (that of its layer) in canonical factor order."""
        assert self.models is not None  # measured in setup()
        self.layer_placement = plan_layer_placement(self.sides, self.world_size, self.models.inverse,
                                                    inverse_method=self.context.inverse_method)
        self.layer_owners = self._owner = self.layer_placement.owners
        return tuple(self._owner[i] for i, _ in self.keys)

    def _new_async_group(self) -> None:
        """Nothing to create: asynchronous inversions communicate nothing under dpkfac."""

    def _plan_groups(self, order: list[FactorKey], ready: list[float]) -> list[tuple[int, ...]]:
        """The fusion plan of each owner's factors (in ``order``), merged by the position of each group's last
        member: a group is complete when its last factor is, so the groups launch in that order everywhere."""
        opts = self.options
        assert self.models is not None  # measured in setup()
        if self.world_size == 1:
            return super()._plan_groups(order, ready)
        alone = set() if opts.fuse_g else {pos for pos, key in enumerate(order) if key[1] == "G"}
        groups: list[tuple[int, ...]] = []
        for owner in sorted(set(self._owner)):
            mine = [pos for pos, key in enumerate(order) if self._owner[key[0]] == owner]
            plan = plan_fusion([packed_numel(self._shape(order[p])) for p in mine], [ready[p] for p in mine],
                               self.models.allreduce, policy=opts.fusion, bucket_bytes=int(opts.bucket_mb * 2**20),
                               bytes_per_element=opts.bytes_per_element,
                               alone=[k for k, p in enumerate(mine) if p in alone])
            groups += [tuple(mine[k] for k in g) for g in plan.groups]
        return sorted(groups, key=lambda g: (max(g), g))

    def _destinations(self, order: Sequence[FactorKey], groups: Sequence[Sequence[int]]) -> list[int] | None:
        owners = [{self._owner[order[p][0]] for p in g} for g in groups]
        if self.world_size == 1 or any(len(o) != 1 for o in owners):
            return None  # (the measuring plan: one all-reduce of everything; non-owners drop what they get)
        return [o.pop() for o in owners]

    def _planned_broadcast_order(self) -> list[FactorKey]:
        return []  # no inverse is broadcast

    # ------------------------------------------------------------------ per step
    def reduce_factors(self, local: dict[FactorKey, torch.Tensor | None]) -> dict[FactorKey, torch.Tensor | None]:
        reduced = super().reduce_factors(local)
        present = reduced.present if isinstance(reduced, ReducedFactors) else {}
        return ReducedFactors({k: (v if self._owner[k[0]] == self.rank else None) for k, v in reduced.items()},
                              {k: f for k, f in present.items() if self._owner[k[0]] == self.rank})

    def _check_owned(self, tasks: Sequence[Task]) -> None:
        stray = sorted({t[0] for t in tasks if self._owner[t[0]] != self.rank})
        if stray:
            raise RuntimeError(f"dpkfac: rank {self.rank} was asked to invert layers {stray}, which it does not own")

    def invert(self, tasks: Sequence[Task], invert_fn: Callable[[list[Task]], list[torch.Tensor]],
               on_ready: Callable[[int, str, torch.Tensor], None]) -> None:
        """The owner inverts its layers here, all in one call (batched by size, one finiteness read: kfac/inverse.py),
        then hands each over (its gradient is preconditioned and its broadcast launched at once); nothing is sent."""
        self._check_owned(tasks)
        if not tasks:
            return
        for task, inverse in zip(tasks, invert_fn(list(tasks)), strict=True):
            on_ready(task[0], task[1], inverse)

    def invert_async(self, tasks: Sequence[Task],
                     invert_fn: Callable[[list[Task]], list[torch.Tensor]]) -> PendingInverses:
        self._check_owned(tasks)
        return Distributor.invert_async(self, tasks, invert_fn)

    def begin_share(self, layers: Sequence[int]) -> None:
        assert self._grads is not None  # set up
        self._grads.begin_round(layers)

    def offer(self, index: int, value: torch.Tensor | None) -> None:
        assert self._grads is not None  # set up
        if self._grads.in_round(index):
            self._grads.offer(index, value)

    def finish_share(self) -> dict[int, torch.Tensor | None]:
        assert self._grads is not None  # set up
        t0 = time.perf_counter()
        out = self._grads.finish(defer_flags=True)  # no host read per step: the flags stay on the device
        self.context.timer.add("precondition_comm_wait", time.perf_counter() - t0)
        return out

    def share_flags(self) -> dict[int, torch.Tensor]:
        """Of the last :meth:`finish_share`: per received layer, a 0-dim boolean device tensor, True where its owner
        sent a preconditioned gradient (False: the receiver keeps the gradient, as the owner does)."""
        assert self._grads is not None  # set up
        return self._grads.last_flags

    def agree_tensor(self, ok: torch.Tensor) -> torch.Tensor:
        """The AND over ranks of the boolean 0-dim ``ok``, on ``ok``'s device, without a host read (one MIN
        all-reduce; the caller reads the verdict with whatever else it reads)."""
        if not self._dist or self.world_size == 1:
            return ok
        flag = ok.to(device=self.device, dtype=torch.float32).reshape(1)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.process_group, async_op=True)
        wait_work(work, self.options.comm_timeout_s, collective="all_reduce", phase=FINITE_AGREEMENT,
                  what="the finite-factor flag of this step", rank=self.rank, world_size=self.world_size,
                  stream_only=stream_ordered(self.process_group))
        return flag.reshape(()).eq(1.0).to(ok.device)

    def gather_layers(self, held: dict[int, LayerTensors], shapes: Sequence[tuple[FactorShape, ...]],
                      dtypes: tuple[torch.dtype, torch.dtype]) -> dict[int, LayerTensors]:
        """Every layer's (A, G, A_inv, G_inv, damping) on every rank, from its owner (``held``: the owned
        layers' own; ``shapes[i]``: layer i's four shapes; ``dtypes``: of the factors and of the inverses).
        Received tensors are moved to the host as they arrive (device memory grows by one layer at a time)."""
        n = len(shapes)
        out = dict(held)
        if not self._dist or self.world_size == 1:
            return out
        header = torch.zeros(n, 3, dtype=torch.float64, device=self.device)  # has factors, has inverses, damping
        for i, (A, _, A_inv, _, damping) in held.items():
            header[i, 0], header[i, 1] = float(A is not None), float(A_inv is not None)
            header[i, 2] = -1.0 if damping is None else float(damping)
        self._wait_state(dist.all_reduce(header, group=self.process_group, async_op=True), "the layer headers")
        for i, (has_factors, has_inverses, damping) in enumerate(header.tolist()):
            owner = self._owner[i]
            if not has_factors:
                continue
            mine = held.get(i) if owner == self.rank else None
            parts: list[torch.Tensor | None] = []
            for k, (shape, dtype) in enumerate(zip(shapes[i], (dtypes[0], dtypes[0], dtypes[1], dtypes[1]))):
                if k >= 2 and not has_inverses:
                    parts.append(None)
                    continue
                if mine is not None:
                    own = mine[k]
                    assert isinstance(own, torch.Tensor)  # the header says it is there
                    buf = own.contiguous()
                else:
                    buf = torch.empty(shape, dtype=dtype, device=self.device)
                src = global_rank(self.process_group, owner)
                self._wait_state(dist.broadcast(buf, src=src, group=self.process_group, async_op=True),
                                 f"layer {i}'s state (from rank {owner})")
                parts.append(None if mine is not None else buf.cpu())
            if mine is None:
                out[i] = (parts[0], parts[1], parts[2], parts[3], damping if has_inverses and damping >= 0 else None)
        return out

    def _wait_state(self, work: Work, what: str) -> None:
        wait_work(work, self.options.comm_timeout_s, collective="broadcast", phase=STATE_GATHER, what=what,
                  rank=self.rank, world_size=self.world_size, stream_only=stream_ordered(self.process_group))

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        out["layer_owners"] = list(self._owner)
        out["destinations"] = list(self._fused.destinations or ())
        return out
