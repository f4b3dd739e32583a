"""The failure protocol of the comm executors, written once: abandon, refuse, reset.

An executor runs a *unit* of asynchronous collectives on one process group: :class:`~.fused.FusedAllReduce`
a *step* of fused factor all-reduces, :class:`~.broadcast.InverseBroadcaster` a *round* of inverse
broadcasts. What happens when one of those collectives goes wrong is the same for both, and lives here:

* Every wait is bounded by ``timeout`` seconds (:meth:`CollectiveExecutor._wait`, through
  :func:`~.faults.wait_work`): a host wait on gloo, a stream-ordered one on NCCL (bounded there by the process
  group's watchdog timeout); a launch goes through :meth:`CollectiveExecutor._issue`.
* A collective that cannot be launched, fails, or does not complete in time raises
  :class:`~.faults.KFACCommError` naming the phase, the collective, what it carried (``_describe``), the
  rank and the timeout, and **abandons** the unit: the collectives still pending are not waited again, and
  the unit's buffers (which the backend may still write into when a late peer arrives) are dropped, never
  read or reused.
* Until :meth:`CollectiveExecutor.reset` acknowledges the failure (:attr:`~CollectiveExecutor.failure`),
  every call refuses with a RuntimeError (``_check_usable``) instead of starting a unit on a process group
  in an unknown state.
* ``reset()`` waits (each wait bounded) for the collectives the current unit still has in flight, then
  drops the unit; a wait that fails there abandons it all the same.

A subclass names its unit, collective and phase (class attributes), and provides ``_clear`` (forget the
unit's state and buffers: every unit starts from fresh buffers), ``_describe`` (one collective, for error
messages) and ``_in_flight`` (the works ``reset`` must wait for). ``_lock`` guards the unit's state; it is
never held across a wait.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar

import torch.distributed as dist

from .. import validation as val
from ..factor_shapes import FactorShape, ShapeLike, check_shapes, side
from ._common import distributed_ready
from .faults import TIMEOUT_ACCEPTED, KFACCommError, Work, comm_error, stream_ordered, wait_work

__all__ = ["CollectiveExecutor"]


class CollectiveExecutor(ABC):
    """Base of the comm executors: factor labels, the process group, and the failure protocol.

    Args:
        sides: the shape of each factor, by factor index: an int n (an n x n dense factor) or a
            :data:`~lightning_spdkfac.factor_shapes.FactorShape`, ``(n,)`` diagonal, ``(n, n)`` dense or
            ``(b, n, n)`` grouped. Kept as :attr:`shapes` (tuples) and :attr:`sides` (each one's n).
        timeout: seconds any one wait on a collective may block before it raises
            :class:`~lightning_spdkfac.comm.faults.KFACCommError`.
        names: a label per factor index for error messages (e.g. ``"layer 3 G"``); default: the index.

    A subclass calls :meth:`_join` with its process group once its own arguments are checked.
    """

    unit: ClassVar[str]  # what one unit of collectives is called: "step", "round"
    collective: ClassVar[str]  # the collective it issues: "all_reduce", "broadcast"
    phase: ClassVar[str]  # the K-FAC phase, in errors: faults.FACTOR_ALLREDUCE, faults.INVERSE_BROADCAST

    process_group: dist.ProcessGroup | None
    world_size: int
    rank: int

    def __init__(self, sides: Sequence[ShapeLike], timeout: float, names: Sequence[str] | None) -> None:
        self.shapes: tuple[FactorShape, ...] = tuple(check_shapes("sides", sides, low=1))
        self.sides = [side(s) for s in self.shapes]
        n = len(self.shapes)
        self.timeout = val.check_seconds("timeout", timeout, TIMEOUT_ACCEPTED)
        if names is not None and len(val.check_sequence("names", names, f"labels, one per factor ({n})")) != n:
            raise ValueError(f"names must give one label per factor ({n}), got {names!r}")
        self.names = tuple(str(x) for x in names) if names is not None else tuple(str(i) for i in range(n))
        self._lock = threading.Lock()
        self._active = False
        self._failure: KFACCommError | None = None

    def _join(self, process_group: dist.ProcessGroup | None) -> None:
        """Take part in ``process_group`` (None: the default group, or one local process without
        torch.distributed)."""
        self.process_group = process_group
        self._distributed = distributed_ready(process_group)
        self.world_size = dist.get_world_size(process_group) if self._distributed else 1
        self.rank = dist.get_rank(process_group) if self._distributed else 0
        self._stream_only = stream_ordered(process_group)  # NCCL: no host waits

    # ------------------------------------------------------------------------- what subclasses provide
    @abstractmethod
    def _clear(self) -> None:
        """Forget the current unit: its state, buffers and works (called with the lock held)."""

    @abstractmethod
    def _describe(self, key: int) -> str:
        """What collective ``key`` (a fusion group, a factor) carries, for error messages."""

    @abstractmethod
    def _in_flight(self) -> list[tuple[int, Work]]:
        """``(key, work)`` of the current unit's collectives issued and not yet waited (lock held)."""

    # ------------------------------------------------------------------------------------ the protocol
    @property
    def active(self) -> bool:
        """True between the start of a unit (step or round) and its end (or :meth:`reset`)."""
        return self._active

    @property
    def failure(self) -> KFACCommError | None:
        """The communication error that abandoned a unit (step or round), until :meth:`reset` (None: usable)."""
        return self._failure

    def _check_usable(self, call: str) -> None:
        """Raise if a unit was abandoned after a failed collective and :meth:`reset` was not called since
        (its buffers were dropped and the process group may still hold that collective; lock held)."""
        failure = self._failure
        if failure is not None:
            raise RuntimeError(
                f"{type(self).__name__}.{call}: this executor abandoned a {self.unit} after a failed collective "
                f"({failure.phase}, {failure.what}); its buffers were dropped and the process group may still "
                "have that collective pending. Restart the job (or re-create the process group); call reset() "
                "on every rank only if you know all ranks are back in step"
            ) from failure

    def _end(self) -> None:
        """The unit is over: drop its state (lock held)."""
        self._clear()
        self._active = False

    def _abandon(self, error: KFACCommError) -> None:
        """Abandon the unit after ``error`` (lock held): pending works are not waited again and their
        buffers are never read; every call refuses until :meth:`reset`."""
        self._failure = error
        self._end()

    def _fail(self, error: KFACCommError) -> None:
        """:meth:`_abandon`, taking the lock."""
        with self._lock:
            self._abandon(error)

    def _issue(self, key: int, launch: Callable[[], Work]) -> Work:
        """``launch()`` collective ``key`` (lock held); if the backend refuses (e.g. it already knows that a
        peer is gone), the unit is abandoned and :class:`KFACCommError` raised."""
        try:
            return launch()
        except Exception as exc:  # noqa: BLE001 - every backend error becomes one that names the collective
            error = comm_error(exc, collective=self.collective, phase=self.phase, what=self._describe(key),
                               rank=self.rank, world_size=self.world_size, timeout_s=self.timeout, launching=True)
            self._abandon(error)
            raise error from exc

    def _wait(self, key: int, work: Work) -> None:
        """Wait for collective ``key``, bounded by ``timeout`` (without the lock); a failure or timeout
        abandons the unit and raises :class:`KFACCommError`."""
        try:
            wait_work(work, self.timeout, collective=self.collective, phase=self.phase, what=self._describe(key),
                      rank=self.rank, world_size=self.world_size, stream_only=self._stream_only)
        except KFACCommError as error:
            self._fail(error)
            raise

    def reset(self) -> None:
        """Discard the current unit: wait for its issued collectives (each bounded by ``timeout``), drop all.

        Also acknowledges a failure (:attr:`failure`): the abandoned unit's collectives are not waited
        again, and the next unit uses new buffers. If a wait here fails, the unit is dropped all the same
        and the KFACCommError is raised (and kept in :attr:`failure`; a second reset() clears it).

        Only consistent when every rank resets at the same point: a collective issued on some ranks but not
        on others leaves the process group's collective sequence mismatched, which nothing local can fix.
        """
        with self._lock:
            works = self._in_flight()
            self._failure = None
        for key, work in works:
            self._wait(key, work)
        with self._lock:
            self._end()
