"""Asynchronous broadcast of inverses from their owners (the placement of LBP / round-robin).

Each non-replicated factor has an owner rank (in the process group) that inverts it and broadcasts the
inverse packed (``inverse_method="cholesky"``: an inverse has its factor's shape, and travels like the factor
does, :mod:`.triangle`: the upper triangle of a symmetric n x n inverse, the n entries of a diagonal one,
the b upper triangles of a grouped one) or the whole eigen payload, flattened (``"eigen"``: eigenvectors and
eigenvalues, kfac/inverse.py; its shape is
:func:`~lightning_spdkfac.factor_shapes.inverse_shape`, (n+1) x n per dense block, the n eigenvalues alone
for a diagonal factor); every other rank posts the matching receive. The payload kind is the method's, given to every rank, never
inferred from the data. Replicated factors (owner -1) are inverted on every rank and never sent.

Ordering contract: collectives on a process group are matched by issue order, so **every rank calls
publish/expect for the non-replicated factors in one global order**, :attr:`InverseBroadcaster.order`
(ascending factor index unless given; the SPD scheduler gives
:func:`~lightning_spdkfac.schedule.placement.broadcast_order`, by predicted finish of the inversions, so
that an inverse ready early is not issued behind another rank's slow inversion). At position k of the
order, the owner of ``order[k]`` computes that inverse and calls ``publish``; every other rank calls
``expect`` (which returns at once). Because the calls are asynchronous, an owner's next inversion overlaps the broadcasts already in flight, and
receivers go straight on to their own next inversion. Any deviation raises (the position is checked on
each rank), rather than hanging or pairing the wrong tensors. Replicated factors are published by every
rank at any time. :meth:`InverseBroadcaster.exchange` runs this loop for you::

    bc.begin_round()
    bc.exchange(invert)             # invert(i) -> inverse of factor i, called for owned and replicated i
    inverses = bc.wait_all()        # or bc.wait(i) per layer, as late as possible

Post everything before waiting anything, so that no rank blocks on a receive while a broadcast it owes
others is still unissued. Everybody gets bit-identical inverses: the owner's own copy is also rebuilt
from the buffer it sent (symmetrized from the upper triangle, or the eigen payload as it was, rounded
to the comm dtype either way).

Failures: every wait (a receive, or the completion of this rank's own broadcasts) is bounded by ``timeout``
seconds. A broadcast that fails (its owner or a receiver crashed) or does not complete in time raises
:class:`~lightning_spdkfac.comm.faults.KFACCommError` naming the phase ("K-FAC inverse broadcast"), the
factor, its owner, this rank and the timeout. The round is then abandoned: no pending broadcast is waited
again and no receive buffer of the round is read (gloo may still fill one when a late owner arrives);
until :meth:`InverseBroadcaster.reset` acknowledges the failure, every call raises. Every round receives
into freshly allocated buffers. That protocol is :class:`~lightning_spdkfac.comm.executor.CollectiveExecutor`'s,
shared with the fused factor all-reduces.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import validation as val
from ..factor_shapes import FactorShape, ShapeLike, describe, inverse_numel, inverse_shape
from ..vocabulary import INVERSE_METHODS, InverseMethodName
from ._common import NAN, check_wire_dtype, default_device, global_rank
from .executor import CollectiveExecutor
from .faults import INVERSE_BROADCAST, Work
from .triangle import pack_factors, unpack_factors

__all__ = ["InverseBroadcaster", "RoundTimings"]


@dataclass(frozen=True)
class RoundTimings:
    """``time.perf_counter`` stamps of one round, per factor index; NaN where the event did not happen.

    ``post[i]``: publish/expect of factor i returned its broadcast (on the owner: just after the
    inversion, so consecutive owner stamps time the inversions). ``wait_start[i]`` / ``wait_end[i]``: the
    caller blocked on factor i (the exposed inverse communication).
    """

    begin: float
    post: tuple[float, ...]
    wait_start: tuple[float, ...]
    wait_end: tuple[float, ...]


@dataclass
class _Entry:
    buffer: torch.Tensor | None = None  # packed triangle or flat eigen payload in flight (non-replicated)
    work: Work | None = None
    value: torch.Tensor | None = None  # replicated inverse, or the owner's rebuilt copy


class InverseBroadcaster(CollectiveExecutor):
    """Owners broadcast inverses asynchronously, receivers post matching receives, in one global order.

    Args:
        owners: owner rank (in ``process_group``) of each factor's inverse; -1: replicated (every rank
            inverts it; no communication).
        sides: the shape of each factor: an int n (n x n dense) or a FactorShape, ``(n,)`` diagonal, ``(n, n)``
            dense, ``(b, n, n)`` grouped (:mod:`lightning_spdkfac.factor_shapes`).
        process_group: None: the default group. Without torch.distributed initialized (and no group): one
            process, every owner must be 0 or -1.
        dtype: communication dtype.
        result_dtype: dtype of every returned inverse (the same on every rank).
        device: where received inverses live (default: the current GPU with NCCL, else CPU).
        order: the global order of the non-replicated factors (default: ascending index).
        timeout: seconds any one wait on a broadcast may block before it raises
            :class:`~lightning_spdkfac.comm.faults.KFACCommError` (see the module docstring).
        names: a label per factor index for error messages (e.g. ``"layer 3 G"``); default: the index.
        inverse_method: what every factor's inverse is: ``"cholesky"`` a tensor of its factor's shape,
            symmetric per dense block (packed like a factor: n(n+1)/2 elements per block, n for a diagonal),
            ``"eigen"`` an eigen payload of :func:`~lightning_spdkfac.factor_shapes.inverse_shape` ((n+1) x n
            per block, (n,) for a diagonal factor), all of which travels.
    """

    unit = "round"
    collective = "broadcast"
    phase = INVERSE_BROADCAST

    def __init__(
        self,
        owners: Sequence[int],
        sides: Sequence[ShapeLike],
        process_group: dist.ProcessGroup | None = None,
        dtype: torch.dtype = torch.float32,
        result_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        order: Sequence[int] | None = None,
        timeout: float = 600.0,
        names: Sequence[str] | None = None,
        inverse_method: InverseMethodName = "cholesky",
    ) -> None:
        super().__init__(sides, timeout, names)
        self.inverse_method = val.check_choice("inverse_method", inverse_method, INVERSE_METHODS)
        self._eigen = self.inverse_method == "eigen"
        self.owners = tuple(val.check_ints("owners", owners))
        if len(self.owners) != len(self.sides):
            raise ValueError(f"owners and sides must have the same length, got {len(self.owners)} and {len(self.sides)}")
        self._join(process_group)
        for i, o in enumerate(self.owners):
            if not -1 <= o < self.world_size:
                raise ValueError(f"owners[{i}] must be -1 or a rank in [0, {self.world_size}), got {o}")
        self.dtype = check_wire_dtype("dtype", dtype)
        self.result_dtype = check_wire_dtype("result_dtype", result_dtype)
        self.device = torch.device(device) if device is not None else default_device(process_group)
        sent = [i for i, o in enumerate(self.owners) if o >= 0]
        if order is None:
            self.order = tuple(sent)
        else:
            self.order = tuple(val.check_ints("order", order))
            if sorted(self.order) != sent:
                raise ValueError(f"order must list every non-replicated factor exactly once ({sent}), "
                                 f"got {list(self.order)}")
        self.replicated = tuple(i for i, o in enumerate(self.owners) if o == -1)
        self.owned = tuple(i for i in self.order if self.owners[i] == self.rank)
        self._src = {i: global_rank(process_group, self.owners[i]) for i in sent} if self._distributed else {}
        self.last_timings: RoundTimings | None = None
        self._clear()

    # ------------------------------------------------------------------------------------ inspection
    def _clear(self) -> None:
        n = len(self.sides)
        self._pos = 0
        self._sends: list[tuple[int, Work]] = []  # (factor, work) of own broadcasts already returned
        self._entries: dict[int, _Entry] = {}
        self._returned = [False] * n
        self._t_begin = NAN
        self._t_post = [NAN] * n
        self._t_wait_start = [NAN] * n
        self._t_wait_end = [NAN] * n

    @property
    def next_index(self) -> int | None:
        """The non-replicated factor whose publish/expect comes next in the global order (None: done)."""
        return self.order[self._pos] if self._pos < len(self.order) else None

    @property
    def pending(self) -> tuple[int, ...]:
        """Factors posted (or published, if replicated) in this round and not yet returned by a wait."""
        return tuple(sorted(self._entries))

    def timings(self) -> RoundTimings:
        return RoundTimings(self._t_begin, tuple(self._t_post), tuple(self._t_wait_start),
                            tuple(self._t_wait_end))

    def shape(self, index: int) -> FactorShape:
        """The shape of factor ``index``'s inverse: its factor's shape, or with ``inverse_method="eigen"`` the
        eigen payload's (:func:`~lightning_spdkfac.factor_shapes.inverse_shape`: (n+1, n), (b, n+1, n), (n,))."""
        return inverse_shape(self.shapes[index], self.inverse_method)

    def message_size(self, index: int) -> int:
        """Elements of factor ``index``'s broadcast (:func:`~lightning_spdkfac.factor_shapes.inverse_numel`):
        the packed inverse (n(n+1)/2 per dense block, n for a diagonal) or the whole eigen payload."""
        return inverse_numel(self.shapes[index], self.inverse_method)

    def _pack(self, inverse: torch.Tensor, index: int) -> torch.Tensor:
        buf = torch.empty(self.message_size(index), dtype=self.dtype, device=inverse.device)
        if self._eigen:
            return buf.copy_(inverse.reshape(-1))
        return pack_factors([inverse], out=buf)

    def _unpack(self, buf: torch.Tensor, index: int) -> torch.Tensor:
        if self._eigen:
            return buf.to(self.result_dtype, copy=True).reshape(self.shape(index))
        return unpack_factors(buf, [self.shapes[index]], dtype=self.result_dtype)[0]

    def _describe(self, key: int) -> str:
        owner = self.owners[key]
        who = "this rank" if owner == self.rank else f"rank {owner}"
        return f"the inverse of factor {self.names[key]} (from its owner, {who})"

    def _in_flight(self) -> list[tuple[int, Work]]:
        return [(i, e.work) for i, e in self._entries.items() if e.work is not None] + self._sends

    # ----------------------------------------------------------------------------------------- round
    def begin_round(self) -> None:
        """Start an inverse round. Raises if the previous round was left incomplete or not fully waited,
        or if a round failed and :meth:`reset` was not called since."""
        with self._lock:
            self._check_usable("begin_round()")
            if self._active and (self._pos not in (0, len(self.order)) or self._entries):
                raise RuntimeError(
                    f"begin_round() while the previous round is unfinished (next factor in the order: "
                    f"{self.next_index}, not yet waited: {list(self.pending)}); finish it and call "
                    "wait_all(), or reset()")
            sends = self._sends
            if self._active and any(self._returned):  # the previous round ended by wait(i) calls
                self.last_timings = self.timings()
        for i, w in sends:  # the previous round's own broadcasts, if only wait(i) was used
            self._wait(i, w)
        with self._lock:
            self._clear()
            self._active = True
            self._t_begin = time.perf_counter()

    def _advance(self, index: int, verb: str) -> None:
        self._check_usable(f"{verb}({index})")
        if not self._active:
            raise RuntimeError(f"{verb}({index}) outside a round: call begin_round() first")
        if index in self._entries or self._returned[index]:
            raise RuntimeError(f"factor {index} was already posted in this round")
        expected = self.next_index
        if index != expected:
            raise RuntimeError(
                f"{verb}({index}) out of order: every rank must post the non-replicated factors in the "
                f"global order {list(self.order)}; the next one is {expected}")
        self._pos += 1

    def publish(self, index: int, inverse: torch.Tensor) -> None:
        """On the owner (or any rank, for a replicated factor): hand over the inverse of factor ``index``.

        A non-replicated inverse is packed (like its factor, or the whole eigen payload; comm dtype) and
        its broadcast launched at once; ``inverse`` itself is not kept. A replicated one is kept as given (no communication).
        """
        index = val.check_index("index", index, len(self.sides))
        val.check_instance("inverse", inverse, torch.Tensor)
        want = self.shape(index)
        if tuple(inverse.shape) != want:
            raise ValueError(f"inverse {index} ({self.names[index]}) must have shape {want} (factor "
                             f"{describe(self.shapes[index])}, inverse_method={self.inverse_method!r}), "
                             f"got {tuple(inverse.shape)}")
        owner = self.owners[index]
        with self._lock:
            if owner == -1:
                self._check_usable(f"publish({index})")
                if not self._active:
                    raise RuntimeError(f"publish({index}) outside a round: call begin_round() first")
                if index in self._entries or self._returned[index]:
                    raise RuntimeError(f"factor {index} was already published in this round")
                self._entries[index] = _Entry(value=inverse)
                self._t_post[index] = time.perf_counter()
                return
            if owner != self.rank:
                raise RuntimeError(f"publish({index}) on rank {self.rank}, but factor {index} is owned by "
                                   f"rank {owner}: call expect({index}) here")
            self._advance(index, "publish")
            buf = self._pack(inverse, index)
            work = self._launch(index, buf)
            self._entries[index] = _Entry(buffer=buf, work=work)
            self._t_post[index] = time.perf_counter()

    def expect(self, index: int, device: torch.device | str | None = None) -> None:
        """On every rank but the owner: post the receive for factor ``index``'s inverse (returns at once)."""
        index = val.check_index("index", index, len(self.sides))
        owner = self.owners[index]
        with self._lock:
            if owner == -1:
                raise RuntimeError(f"expect({index}): factor {index} is replicated; every rank publishes it")
            if owner == self.rank:
                raise RuntimeError(f"expect({index}) on rank {self.rank}, which owns factor {index}: "
                                   f"call publish({index}, inverse) here")
            self._advance(index, "expect")
            dev = torch.device(device) if device is not None else self.device
            buf = torch.empty(self.message_size(index), dtype=self.dtype, device=dev)
            work = self._launch(index, buf)
            self._entries[index] = _Entry(buffer=buf, work=work)
            self._t_post[index] = time.perf_counter()

    def _launch(self, index: int, buf: torch.Tensor) -> Work | None:
        """Issue the broadcast of ``index`` (called with the lock held); None: one process, nothing sent."""
        if not self._distributed:
            return None
        return self._issue(index, lambda: dist.broadcast(buf, src=self._src[index], group=self.process_group,
                                                         async_op=True))

    def exchange(self, invert: Callable[[int], torch.Tensor]) -> None:
        """Post the rest of the round: for each factor left in :attr:`order`, ``publish(i, invert(i))`` on
        its owner and ``expect(i)`` elsewhere; then ``publish(i, invert(i))`` for every replicated factor
        not yet published (computed while the broadcasts are in flight)."""
        while (index := self.next_index) is not None:
            if self.owners[index] == self.rank:
                self.publish(index, invert(index))
            else:
                self.expect(index)
        for index in self.replicated:
            if index not in self._entries and not self._returned[index]:
                self.publish(index, invert(index))

    def wait(self, index: int) -> torch.Tensor:
        """Factor ``index``'s inverse (dense blocks rebuilt exactly symmetric), or eigen payload (blocks on a receive; an owner returns at once).

        Each factor is returned once per round; the broadcaster keeps no reference to it afterwards.
        """
        index = val.check_index("index", index, len(self.sides))
        with self._lock:
            self._check_usable(f"wait({index})")
            entry = self._entries.get(index)
            if entry is None:
                state = "was already returned" if self._returned[index] else "was never posted"
                raise RuntimeError(f"wait({index}): factor {index} {state} in this round")
        t0 = time.perf_counter()
        own_send = entry.work is not None and self.owners[index] == self.rank
        if entry.value is None:
            if entry.work is not None and not own_send:
                self._wait(index, entry.work)
            assert entry.buffer is not None
            entry.value = self._unpack(entry.buffer, index)
        value = entry.value
        with self._lock:
            if own_send:
                assert entry.work is not None
                self._sends.append((index, entry.work))  # may still be in flight: wait_all ends it
            del self._entries[index]
            self._returned[index] = True
            self._t_wait_start[index] = t0
            self._t_wait_end[index] = time.perf_counter()
        return value

    def wait_all(self) -> dict[int, torch.Tensor]:
        """Every posted factor not yet returned, by index; also completes this rank's own broadcasts.

        When the whole order has been posted, this ends the round (no tensor is kept afterwards). A
        broadcast that fails or times out raises KFACCommError and abandons the round (module docstring).
        """
        with self._lock:
            indices = sorted(self._entries)
        # Receives in the global order, so the earliest broadcasts are consumed first.
        rank_of = {i: k for k, i in enumerate(self.order)}
        indices.sort(key=lambda i: rank_of.get(i, len(self.order)))
        out = {i: self.wait(i) for i in indices}
        with self._lock:
            sends, self._sends = self._sends, []
        for i, w in sends:
            self._wait(i, w)
        with self._lock:
            if self._pos == len(self.order) and not self._entries:
                self.last_timings = self.timings()
                self._end()
        return dict(sorted(out.items()))
