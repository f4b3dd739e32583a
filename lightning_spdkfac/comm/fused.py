"""Fused, asynchronous all-reduce of Kronecker factors: the executor of a fusion plan (DTF).

A fusion plan is a partition of the factor indices into groups (normally runs of consecutive indices
in the order the factors become final). Per step::

    fused.begin_step()
    fused.submit(i, A_i)      # from a forward/backward hook, as soon as factor i is final
    ...                       # the group of i is packed and all-reduced as soon as its last member arrives
    factors = fused.wait()    # before the optimizer step: averaged, exactly symmetric, in index order

Ordering contract: collectives on one process group are matched by issue order, so every rank must
launch the groups in the same order. A group is launched when its last member is submitted and every
group before it (in ``groups`` order) has been launched, so the launch order is the groups' order on
every rank, even where one rank's factors arrive out of plan order. Other collectives issued on the same process group between launch and wait
must also come at the same point on every rank; DDP all-reduces gradient buckets on the group it was
given (default: WORLD) from its own autograd hooks, so give K-FAC a dedicated group
(``dist.new_group()``, called on every rank) rather than relying on identical hook interleaving.

Each member is packed into its group's buffer at ``submit`` (a dense factor's upper triangle, a diagonal
factor's entries, a grouped factor's b upper triangles: :mod:`.triangle`; in the communication ``dtype``); the caller's matrix is neither kept nor modified. Averaging is a SUM followed by
a division after the wait (gloo has no AVG op). Timestamps (``time.perf_counter``) are taken per factor
at submit and per group at launch, wait start and wait end; :attr:`last_timings` holds those of the last
completed step, so a profiling window can feed the fusion planner.

Failures: every wait is bounded by ``timeout`` seconds. A group whose all-reduce fails (a peer crashed) or
does not complete in time raises :class:`~lightning_spdkfac.comm.faults.KFACCommError` naming the phase
("K-FAC factor all-reduce"), the group and its factors, the rank and the timeout. The step is then
abandoned: the collectives still pending are not waited again, and their buffers (which gloo may still
write into when a late peer arrives) are dropped, never read or reused. Until :meth:`reset` acknowledges
the failure, every call raises instead of starting a step on a process group in an unknown state; after
it, each step packs into freshly allocated buffers. That protocol is
:class:`~lightning_spdkfac.comm.executor.CollectiveExecutor`'s, shared with the inverse broadcasts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from .. import validation as val
from ..factor_shapes import ShapeLike, describe, packed_numel
from ..kfac.factors import fill_runs
from ._common import NAN, check_wire_dtype, default_device, global_rank
from .executor import CollectiveExecutor
from .faults import FACTOR_ALLREDUCE, Work
from .triangle import pack_factors, unpack_factors

__all__ = ["FusedAllReduce", "StepTimings"]


@dataclass(frozen=True)
class StepTimings:
    """``time.perf_counter`` stamps of one step; NaN where the event did not happen.

    ``submit[i]``: factor i was submitted (packed into its group buffer), i.e. its ready time.
    ``launch[g]``: group g's all-reduce was issued (right after its last member's submit).
    ``work_end[g]``: group g's all-reduce was complete (end of ``work.wait()``, before unpacking).
    ``wait_start[g]`` / ``wait_end[g]``: the caller blocked on group g; ``work_end - wait_start`` is the
    exposed communication of g and ``wait_end - work_end`` its unpacking. ``launch_order``: groups in the
    order their all-reduces were issued.
    """

    begin: float
    submit: tuple[float, ...]
    launch: tuple[float, ...]
    wait_start: tuple[float, ...]
    wait_end: tuple[float, ...]
    work_end: tuple[float, ...]
    launch_order: tuple[int, ...]


class _LocalWork:
    """Stands in for a Work object with a single process (nothing to reduce)."""

    def wait(self, timeout: object = None) -> bool:
        return True


class FusedAllReduce(CollectiveExecutor):
    """Executes a fusion plan: each group of factors is one asynchronous all-reduce of packed factors.

    Args:
        groups: the fusion plan, a partition of ``range(len(sides))`` into groups of factor indices.
        sides: the shape of each factor, by factor index: an int n (n x n dense) or a FactorShape, ``(n,)``
            diagonal, ``(n, n)`` dense, ``(b, n, n)`` grouped (:mod:`lightning_spdkfac.factor_shapes`); a group
            may mix them. What is submitted for a factor must have its shape, and so has its result.
        process_group: the group to reduce over (None: the default group). With torch.distributed not
            initialized and no group given: one local process, nothing is sent, results are the inputs
            passed through the same packing and dtype.
        dtype: communication dtype; bfloat16/float16 halve the bytes (results are unpacked to
            ``result_dtype``).
        op: ``"average"`` (sum, then divide by the number of contributing ranks) or ``"sum"``.
        allow_missing: allow ``submit(i, None)`` on a rank without data for factor i: one count per
            factor travels with its group, the average is over the ranks that had data (divided on the
            device) and the result is None where no rank had any: one host read of every group's counts at
            the end of :meth:`wait`, or none with ``wait(defer_missing=True)``, which returns every result as a
            tensor (zeros where no rank had data) and leaves the verdict on the device in :attr:`last_present`.
        result_dtype: dtype of the results; None: the submitted matrix's dtype (float32 for None).
        device: buffer device for a group whose members were all None on this rank (default: the
            current GPU with NCCL, else CPU); other buffers live with the submitted matrices.
        timeout: seconds any one wait on a group's all-reduce may block before it raises
            :class:`~lightning_spdkfac.comm.faults.KFACCommError` (see the module docstring).
        names: a label per factor index for error messages (e.g. ``"layer 3 G"``); default: the index.
        destinations: per group, the rank (in ``process_group``) that alone receives the group's result
            (``dist.reduce`` instead of an all-reduce: distributed preconditioning, ``schedule="dpkfac"``);
            on the other ranks the group's members come back None from :meth:`wait`. None: every group is
            all-reduced.
    """

    unit = "step"
    collective = "all_reduce"
    phase = FACTOR_ALLREDUCE

    def __init__(
        self,
        groups: Sequence[Sequence[int]],
        sides: Sequence[ShapeLike],
        process_group: dist.ProcessGroup | None = None,
        dtype: torch.dtype = torch.float32,
        op: Literal["average", "sum"] = "average",
        allow_missing: bool = False,
        result_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        timeout: float = 600.0,
        names: Sequence[str] | None = None,
        destinations: Sequence[int] | None = None,
    ) -> None:
        super().__init__(sides, timeout, names)
        n = len(self.sides)
        plan = val.check_sequence("groups", groups, "groups of factor indices")
        self.groups = tuple(tuple(val.check_ints(f"groups[{g}]", members)) for g, members in enumerate(plan))
        self._group_of = [-1] * n
        for g, members in enumerate(self.groups):
            if not members:
                raise ValueError(f"groups[{g}] is empty")
            for i in members:
                if not 0 <= i < n:
                    raise ValueError(f"groups[{g}] holds factor {i}, outside [0, {n})")
                if self._group_of[i] != -1:
                    raise ValueError(f"groups: factor {i} is in groups[{self._group_of[i]}] and groups[{g}]")
                self._group_of[i] = g
        missing = [i for i, g in enumerate(self._group_of) if g == -1]
        if missing:
            raise ValueError(f"groups must cover every factor index; missing {missing}")
        self.op = val.check_choice("op", op, ("average", "sum"))
        self.dtype = check_wire_dtype("dtype", dtype)
        self.allow_missing = val.check_bool("allow_missing", allow_missing)
        self.result_dtype = None if result_dtype is None else check_wire_dtype("result_dtype", result_dtype)
        self._join(process_group)
        self.destinations: tuple[int, ...] | None = None
        if destinations is not None:
            dsts = tuple(val.check_ints("destinations", destinations, low=0))
            if len(dsts) != len(self.groups) or any(d >= self.world_size for d in dsts):
                raise ValueError(f"destinations must give one rank in [0, {self.world_size}) per group "
                                 f"({len(self.groups)}), got {list(dsts)}")
            self.destinations = dsts
        if self.allow_missing and self.dtype == torch.bfloat16 and self.world_size > 256:
            raise ValueError("allow_missing with dtype=bfloat16 needs a world size <= 256 (exact counts)")
        self.device = torch.device(device) if device is not None else default_device(process_group)

        # Each group's buffer: packed members in group order, then (allow_missing) one count per member.
        self._offset = [0] * n
        self._numel: list[int] = []
        for members in self.groups:
            off = 0
            for i in members:
                self._offset[i] = off
                off += packed_numel(self.shapes[i])
            self._numel.append(off + (len(members) if self.allow_missing else 0))

        self.last_timings: StepTimings | None = None
        # allow_missing, wait(defer_missing=True): per factor index, a 0-dim bool device tensor, True where some
        # rank had data (None for a group reduced to another rank); set by each wait().
        self.last_present: list[torch.Tensor | None] = [None] * n
        self._sizes_cache: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._clear()

    # ------------------------------------------------------------------------------------ inspection
    def _clear(self) -> None:
        n, m = len(self.sides), len(self.groups)
        self._buffers: list[torch.Tensor | None] = [None] * m
        self._works: list[Work | None] = [None] * m
        self._remaining = [len(g) for g in self.groups]
        self._submitted = [False] * n
        self._present = [False] * n
        self._out_dtype: list[torch.dtype | None] = [None] * n
        self._results: dict[int, torch.Tensor | None] = {}
        self._counts: list[torch.Tensor | None] = [None] * m
        self._launch_order: list[int] = []
        self._launched = [False] * m
        self._next_launch = 0
        self._waited = [False] * m
        self._t_begin = NAN
        self._t_submit = [NAN] * n
        self._t_launch = [NAN] * m
        self._t_wait_start = [NAN] * m
        self._t_work_end = [NAN] * m
        self._t_wait_end = [NAN] * m

    def _describe(self, key: int) -> str:
        labels = ", ".join(self.names[i] for i in self.groups[key])
        return f"fusion group {key} of {len(self.groups)} (factors {labels})"

    def _in_flight(self) -> list[tuple[int, Work]]:
        return [(g, work) for g in self._launch_order
                if not self._waited[g] and (work := self._works[g]) is not None]

    def group_of(self, index: int) -> int:
        return self._group_of[val.check_index("index", index, len(self.sides))]

    def is_launched(self, group: int) -> bool:
        """Whether group ``group``'s all-reduce has been issued in the current step."""
        return self._launched[group]

    @property
    def launched_groups(self) -> tuple[int, ...]:
        """Groups issued in the current step, in launch order."""
        return tuple(self._launch_order)

    @property
    def outstanding(self) -> tuple[int, ...]:
        """Groups issued in the current step and not waited yet, in launch order."""
        return tuple(g for g in self._launch_order if not self._waited[g])

    def timings(self) -> StepTimings:
        """The stamps of the current step so far."""
        return StepTimings(self._t_begin, tuple(self._t_submit), tuple(self._t_launch),
                           tuple(self._t_wait_start), tuple(self._t_wait_end), tuple(self._t_work_end),
                           tuple(self._launch_order))

    # ------------------------------------------------------------------------------------------ step
    def begin_step(self) -> None:
        """Start a step. Raises if the previous step still has submitted factors or outstanding works, or
        if a step failed and :meth:`reset` was not called since."""
        with self._lock:
            self._check_usable("begin_step()")
            if self._active and (any(self._submitted) or self._launch_order):
                raise RuntimeError(
                    "FusedAllReduce.begin_step() while the previous step is unfinished (submitted factors "
                    f"{[i for i, s in enumerate(self._submitted) if s]}, outstanding groups "
                    f"{list(self.outstanding)}); call wait(), or reset() to discard it, first")
            self._clear()
            self._active = True
            self._t_begin = time.perf_counter()

    def submit(self, index: int, matrix: torch.Tensor | None) -> None:
        """Factor ``index`` of this step is final: pack it now; launch its group if it is the last member.

        ``matrix`` is read (upper triangle only) and not kept. None (only with ``allow_missing``) means
        this rank has no data for the factor.
        """
        index = val.check_index("index", index, len(self.sides))
        with self._lock:
            self._check_usable(f"submit({index})")
            if not self._active:
                raise RuntimeError(f"submit({index}) outside a step: call begin_step() first")
            g = self._group_of[index]
            if self._submitted[index]:
                raise RuntimeError(
                    f"factor {index} was already submitted in this step (its group {g} is "
                    f"{'launched' if self._launched[g] else 'pending'}); call wait() and begin_step() "
                    "before submitting the next step's factors")
            shape = self.shapes[index]
            if matrix is None:
                if not self.allow_missing:
                    raise ValueError(f"submit({index}, None) needs allow_missing=True")
                out_dtype = self.result_dtype or torch.float32
            else:
                val.check_instance("matrix", matrix, torch.Tensor)
                if tuple(matrix.shape) != shape:
                    raise ValueError(f"factor {index} ({self.names[index]}) must have shape {shape} "
                                     f"({describe(shape)}, as given in sides), got {tuple(matrix.shape)}")
                if not matrix.is_floating_point():
                    raise ValueError(f"factor {index} must be a floating-point tensor, got {matrix.dtype}")
                out_dtype = self.result_dtype or matrix.dtype
                buf = self._buffers[g]
                if buf is None:
                    buf = torch.empty(self._numel[g], dtype=self.dtype, device=matrix.device)
                    self._buffers[g] = buf
                elif buf.device != matrix.device:
                    raise ValueError(f"factor {index} is on {matrix.device} but group {g} is on {buf.device}")
                off = self._offset[index]
                pack_factors([matrix], out=buf[off:off + packed_numel(shape)])
                self._present[index] = True
            self._submitted[index] = True
            self._out_dtype[index] = out_dtype
            self._t_submit[index] = time.perf_counter()
            self._remaining[g] -= 1
            if self._remaining[g] == 0:
                # Launch in group order only: if factors arrive out of plan order on one rank, the
                # all-reduces are still issued in the same order on every rank (collectives on a
                # group are matched by issue order), a completed later group waiting for earlier ones.
                while self._next_launch < len(self.groups) and self._remaining[self._next_launch] == 0:
                    self._launch(self._next_launch)
                    self._next_launch += 1

    def _launch(self, g: int) -> None:
        """Issue group ``g``'s all-reduce (called with the lock held)."""
        members = self.groups[g]
        buf = self._buffers[g]
        if buf is None:
            buf = self._buffers[g] = torch.zeros(self._numel[g], dtype=self.dtype, device=self.device)
        else:
            for i in members:
                if not self._present[i]:
                    off = self._offset[i]
                    buf[off:off + packed_numel(self.shapes[i])].zero_()
        if self.allow_missing:
            # Filled on the device: a host tensor copied into the buffer would block the host inside the hook that
            # launches the group.
            fill_runs(buf[self._numel[g] - len(members):], [1.0 if self._present[i] else 0.0 for i in members])
        work: Work
        if self._distributed and self.destinations is not None:
            dst = global_rank(self.process_group, self.destinations[g])
            work = self._issue(g, lambda: dist.reduce(buf, dst, op=dist.ReduceOp.SUM, group=self.process_group,
                                                      async_op=True))
        elif self._distributed:
            work = self._issue(g, lambda: dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.process_group,
                                                          async_op=True))
        else:
            work = _LocalWork()
        self._works[g] = work
        self._launched[g] = True
        self._launch_order.append(g)
        self._t_launch[g] = time.perf_counter()

    def _missing_message(self, indices: Sequence[int]) -> str:
        missing = [i for i in indices if not self._submitted[i]]
        groups = sorted({self._group_of[i] for i in missing})
        return (f"factors {missing} were never submitted in this step (so groups {groups} were never "
                "launched); every factor of the fusion plan must be submitted before waiting")

    def wait_group(self, group: int) -> list[torch.Tensor | None]:
        """Block on group ``group``'s all-reduce; its members' results, in group order."""
        val.check_index("group", group, len(self.groups))
        with self._lock:
            self._check_usable(f"wait_group({group})")
            if not self._active:
                raise RuntimeError("wait_group() outside a step: call begin_step() first")
            if self._waited[group]:
                return [self._results[i] for i in self.groups[group]]
            if not self._launched[group]:
                raise RuntimeError(self._missing_message(self.groups[group]))
            work = self._works[group]
            assert work is not None  # launched, not waited
        t0 = time.perf_counter()
        self._wait(group, work)
        t1 = time.perf_counter()
        with self._lock:
            results = self._finish(group)
            self._t_wait_start[group] = t0
            self._t_work_end[group] = t1
            self._t_wait_end[group] = time.perf_counter()
        return results

    def _finish(self, g: int) -> list[torch.Tensor | None]:
        members = self.groups[g]
        buf = self._buffers[g]
        assert buf is not None
        if self.destinations is not None and self.destinations[g] != self.rank and self._distributed:
            return self._done(g, [None] * len(members))  # reduced to another rank: nothing arrives here
        tri = buf[: self._numel[g] - (len(members) if self.allow_missing else 0)]
        if tri.dtype in (torch.bfloat16, torch.float16):
            tri = tri.to(torch.float32)  # divide in float32: no second rounding to the comm dtype
        if self.allow_missing:
            # The counts stay on the device: each member is divided by max(its count, 1) there (a member no rank
            # had is zeros on every rank), and whether any rank had it is kept as a device flag.
            counts = buf[tri.numel():].to(torch.float32, copy=True)
            self._counts[g] = counts
            if self.op == "average":
                divisors = counts.clamp(min=1.0)
                if len(members) == 1:
                    tri.div_(divisors)
                else:
                    tri.div_(torch.repeat_interleave(divisors, self._segment_sizes(g, buf.device),
                                                     output_size=tri.numel()))
        elif self.op == "average" and self.world_size != 1:
            tri.div_(self.world_size)  # ours to modify: a view of the group buffer or a fresh copy
        results: list[torch.Tensor | None] = []
        for i in members:
            shape = self.shapes[i]
            off = self._offset[i]
            seg = tri[off:off + packed_numel(shape)]
            out = torch.empty(shape, dtype=self._out_dtype[i], device=buf.device)
            results.append(unpack_factors(seg, [shape], out=[out])[0])
        return self._done(g, results)

    def _segment_sizes(self, g: int, device: torch.device) -> torch.Tensor:
        """Group ``g``'s members' packed sizes as a device tensor, made once (not on every step's hot path)."""
        key = (g, device)
        sizes = self._sizes_cache.get(key)
        if sizes is None:
            sizes = torch.tensor([packed_numel(self.shapes[i]) for i in self.groups[g]], dtype=torch.int64,
                                 device=device)
            self._sizes_cache[key] = sizes
        return sizes

    def _resolve_missing(self, results: list[torch.Tensor | None], defer: bool) -> list[torch.Tensor | None]:
        """allow_missing at the end of a step: :attr:`last_present` from the counts; unless ``defer``, None for a
        factor no rank had (one host read for every group)."""
        present: list[torch.Tensor | None] = [None] * len(self.sides)
        reduced = [g for g, counts in enumerate(self._counts) if counts is not None]
        flags = [self._counts[g].gt(0.0) for g in reduced]  # type: ignore[union-attr]
        for g, f in zip(reduced, flags):
            for k, i in enumerate(self.groups[g]):
                present[i] = f[k]
        self.last_present = present
        if defer or not flags:
            return results
        here = torch.cat(flags).tolist()  # the one host read of the step's counts
        pos = 0
        for g in reduced:
            for i in self.groups[g]:
                if not here[pos]:
                    results[i] = None
                pos += 1
        return results

    def _done(self, g: int, results: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        for i, r in zip(self.groups[g], results):
            self._results[i] = r
        self._buffers[g] = None  # drop the buffer and the work that references it
        self._works[g] = None
        self._waited[g] = True
        return results

    def wait(self, defer_missing: bool = False) -> list[torch.Tensor | None]:
        """Block on every group (in launch order); the step's averaged factors, in index order.

        With ``allow_missing``, a factor no rank had is None, decided by one host read of every group's counts
        together; ``defer_missing=True`` skips that read: such a factor comes back as zeros and the verdicts stay
        on the device, in :attr:`last_present`, for the caller to read with whatever else it reads.

        Raises RuntimeError naming the factors never submitted (nothing is waited then, so the caller
        may still submit them and wait again), and KFACCommError when an all-reduce fails or times out
        (the step is then abandoned, see the module docstring). Ends the step: no tensor is kept afterwards.
        """
        with self._lock:
            self._check_usable("wait()")
            if not self._active:
                raise RuntimeError("wait() outside a step: call begin_step() first")
            if not all(self._submitted):
                raise RuntimeError(self._missing_message(range(len(self.sides))))
            order = list(self._launch_order)
        for g in order:
            self.wait_group(g)
        with self._lock:
            results = [self._results[i] for i in range(len(self.sides))]
            if self.allow_missing:
                results = self._resolve_missing(results, defer_missing)
            self.last_timings = self.timings()
            self._end()
        return results
