"""The seam between the K-FAC math and whatever runs it across processes.

:class:`KFACPreconditioner` does the math; a *distributor* decides where the cross-rank parts
happen: averaging the step's factors over ranks, and which rank inverts which factor. This
module holds the interface and the one-process implementation; the torch.distributed
implementations (D-KFAC, MPD-KFAC, SPD-KFAC) live in ``lightning_spdkfac.comm`` so that this
package never touches torch.distributed.

Contract, per optimizer step (every rank calls the same methods in the same order):

0. ``setup(sides, context)`` once, before the first step: ``context`` is the :class:`DistributorContext` (inversion
   dtype, inverse method, asynchronous-inverses option, inverse cadence, settings text, phase timer), the only way
   the preconditioner configures a distributor (nothing is assigned on it from outside); an override calls
   ``super().setup(sides, context)``, which keeps it as ``self.context``. ``sides``: per layer, in index order, ``(A shape, G shape)``. Each is an
   ``int`` n (legacy: an n x n dense factor) or a :data:`~lightning_spdkfac.factor_shapes.FactorShape`:
   ``(n, n)`` dense, ``(n,)`` diagonal (only the diagonal is kept), ``(b, n, n)`` grouped (b dense blocks).
   Every factor handed to ``factor_final`` / ``reduce_factors`` and returned by them has its layer's shape
   for it, and so does every inverse ``invert_fn`` returns with ``inverse_method == "cholesky"`` (symmetric
   per dense block; a diagonal factor's inverse is the (n,) vector of reciprocals); with ``"eigen"`` an
   inverse has :func:`~lightning_spdkfac.factor_shapes.inverse_shape`: (n+1, n) for a dense factor,
   (b, n+1, n) for a grouped one, (n,) (the eigenvalues alone) for a diagonal one.
1. ``begin_step(step)`` before the first forward of the step (called by the preconditioner): ``step`` is the
   optimizer step about to begin (0, 1, ...); inverse steps are those with ``step % context.inv_update_steps == 0``.
2. With ``pipelined`` true, the preconditioner calls ``factor_final(index, which, matrix)``
   from its hooks as soon as a layer's A (forward) or G (backward) of this step is final,
   on the micro-batch that ends the step (None: this rank has no data for it, e.g. an empty input).
   The distributor may launch communication at once.
3. ``reduce_factors(local)`` in ``step()``: ``local`` maps ``(layer index, "A" or "G")`` to
   this rank's step factor for every factor not already given to ``factor_final`` (None where
   this rank has no data for it). Returns a value for every factor of every layer: the factor
   averaged over the ranks that had data, or None where no rank had; identical on every rank. A
   :class:`ReducedFactors` leaves "no rank had data" on the device (its ``present`` flags), so that the
   preconditioner reads it with the step's finiteness verdict: no host read of its own. Nothing in
   ``factor_final`` (called from the hooks) may read the device on the host.
4. ``invert(tasks, invert_fn, on_ready)`` on inverse steps: ``tasks`` lists ``(index, which,
   factor)`` in the same order on every rank; ``invert_fn(sub_list_of_tasks) -> inverses`` does
   the math; ``on_ready(index, which, inverse)`` must be called for every task on every rank,
   in any order, as soon as that inverse is available there. An inverse is what ``invert_fn``
   returned, of the shape item 0 gives (an eigen payload with ``inverse_method == "eigen"``).
5. ``invert_async(tasks, invert_fn)`` on inverse steps with asynchronous inverses: the same work
   as ``invert``, started off the caller's thread; returns a :class:`PendingInverses` whose
   ``wait()`` gives ``(index, which, inverse)`` for every task, identical on every rank. Until that
   wait returns, the caller leaves the tasks' factors untouched and calls no other ``invert`` or
   ``invert_async``. The worker thread only computes: every collective is issued from the caller's
   thread (inside ``wait()``, which every rank reaches at the same point of its step), never from the
   worker, because NCCL does not allow several threads to issue on the communicators of one device.
6. Capability :class:`OwnerHeld` (distributed preconditioning, ``schedule="dpkfac"``): with ``layer_owners`` set, ``reduce_factors`` returns a layer's factors on
   its owner only (None elsewhere), ``invert`` is given owned layers only, and the preconditioned gradients
   are exchanged every step: ``begin_share(layers)`` (the layers to exchange, identical on every rank) before
   the inversions, ``offer(index, P or None)`` on the owner as soon as a layer is preconditioned, and
   ``finish_share()`` returns every exchanged layer's P (None: left as it is; a received P whose ``share_flags()``
   entry, a 0-dim boolean device tensor, is false was not sent, and its gradient is left as it is), identical on
   every rank. P has
   the shape :func:`~lightning_spdkfac.factor_shapes.preconditioned_shape` gives: ``(side(G), side(A))`` when
   neither factor is grouped, ``(b, side(G), side(A))`` when either is (b the grouped one's blocks; both have
   the same b when both are grouped).
   ``agree_tensor(ok)`` (every factor step, on every rank) is the AND over ranks of the 0-dim boolean ``ok``, left
   on the device, and
   ``gather_layers(...)`` gives every rank every layer's state (for checkpoints).

Capabilities beyond the base class are declared, never probed by name: pipelined factors are the base's
``pipelined`` flag with ``factor_final`` (which the base refuses); owner-held state is the :class:`OwnerHeld`
protocol, which a distributor claims by naming it among its bases and the preconditioner finds with
:func:`owner_held`. mypy checks every call against these declarations.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from ..factor_shapes import FactorShape, ShapeLike
from ..telemetry import StepTimer
from ..vocabulary import InverseMethodName

FactorKey = tuple[int, str]  # (layer index, "A" or "G")
Task = tuple[int, str, torch.Tensor]
Inverse = tuple[int, str, torch.Tensor]  # (layer index, "A" or "G", its inverse)
# A layer's checkpointed state: (A, G, A_inv, G_inv, damping of the inverses)
LayerTensors = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, float | None]


@dataclass(frozen=True, eq=False)
class DistributorContext:
    """What the preconditioner tells its distributor, once, at :meth:`Distributor.setup` (contract item 0).

    Attributes:
        inv_dtype: the dtype of inversions and preconditioning (that of the inverses a distributor moves).
        inverse_method: ``"cholesky"`` inverses are n x n symmetric matrices, ``"eigen"`` ones (n+1) x n eigen
            payloads (kfac/inverse.py); a distributor that moves them needs to know which.
        async_inverses: the preconditioner's ``async_inverses`` option (:meth:`Distributor.use_async_inverses`
            decides).
        inv_update_steps: inverses are recomputed on steps ``step % inv_update_steps == 0`` (``begin_step(step)``).
        settings: the preconditioner's K-FAC settings as text (``KFACPreconditioner.settings_text``): distributors
            that check the plan across ranks check these too.
        timer: the preconditioner's phase timer (a distributor adds its communication waits there).
    """

    inv_dtype: torch.dtype = torch.float32
    inverse_method: InverseMethodName = "cholesky"
    async_inverses: bool = False
    inv_update_steps: int = 1
    settings: str = ""
    timer: StepTimer = field(default_factory=StepTimer)


_SIDE_STREAMS: dict[torch.device, Any] = {}
_SIDE_STREAMS_LOCK = threading.Lock()


def side_stream(device: torch.device) -> Any:
    """The one persistent side stream of the inverse worker on ``device`` (a CUDA device). One, not one per launch:
    the caching allocator keeps its blocks per stream, so a new stream per inverse step would grow reserved memory
    until an allocation fails and the cache is flushed (a device-wide synchronisation)."""
    with _SIDE_STREAMS_LOCK:
        stream = _SIDE_STREAMS.get(device)
        if stream is None:
            stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return stream


class PendingInverses:
    """Inversions running on a worker thread, which only computes: it never communicates.

    ``run()`` is called once on a worker thread; on CUDA it runs on the device's persistent side stream
    (:func:`side_stream`), which first waits for the work already queued on the current stream (which produced the
    factors), and the stream is synchronized (on the worker) before the result is published, so what :meth:`wait`
    returns is complete. torch releases the GIL in its kernels: on CPU the inversions run on another core while the
    caller's thread goes on with the optimizer step and the next forward/backward.

    ``then(result)``, if given, runs on the caller's thread inside :meth:`wait`, after the worker is done: that is
    where a distributed schedule issues the inverse broadcasts (NCCL does not allow collectives issued from several
    threads on several communicators, and every rank must issue them in the same order: the wait point of a step is
    the same on every rank). Its result is what :meth:`wait` returns.

    :meth:`wait` returns that result or raises the worker's exception (its errors surface on the caller's thread,
    with their traceback). ``timeout`` (seconds, None: unbounded) bounds the wait for the worker: a worker that is
    not done by then is abandoned (its result, should it still come, is never read) and :class:`TimeoutError`
    raised.
    """

    def __init__(self, run: Callable[[], list[Inverse]], device: torch.device, *, timeout: float | None = None,
                 what: str = "K-FAC asynchronous inversions",
                 then: Callable[[list[Inverse]], list[Inverse]] | None = None) -> None:
        self.timeout = timeout
        self.what = what
        self.seconds = 0.0  # the worker's wall time (set when it ends)
        self._then = then
        self._result: list[Inverse] | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._event = None
        self._stream = None
        if device.type == "cuda":  # the factors are produced on the caller's stream: the side stream waits for it
            self._stream = side_stream(device)
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._event.record(torch.cuda.current_stream(device))
        self._device = device
        # Not a daemon: an interpreter that exits with inversions in flight waits for them (they end: the work is
        # compute and waits bounded by comm_timeout_s) instead of tearing torch down under a running kernel.
        self._thread = threading.Thread(target=self._work, args=(run,), name="kfac-inverses", daemon=False)
        self._thread.start()

    def _work(self, run: Callable[[], list[Inverse]]) -> None:
        t0 = time.perf_counter()
        try:
            if self._event is not None:
                stream = self._stream
                assert stream is not None  # set with the event
                stream.wait_event(self._event)
                with torch.cuda.stream(stream):
                    self._result = run()
                stream.synchronize()
            else:
                self._result = run()
        except BaseException as e:  # handed to the caller's thread by wait()
            self._error = e
        finally:
            self.seconds = time.perf_counter() - t0
            self._done.set()

    def done(self) -> bool:
        """Has the worker finished (successfully or not)?"""
        return self._done.is_set()

    def wait(self) -> list[Inverse]:
        """The inverses, once the worker is done; its exception if it failed; TimeoutError past ``timeout``."""
        if not self._done.wait(self.timeout):
            raise TimeoutError(
                f"{self.what} did not finish within {self.timeout:g} s (comm_timeout_s): a peer rank stalled or "
                "crashed while the inverse broadcasts were in flight; this step keeps the inverses it had")
        if self._error is not None:
            raise self._error
        assert self._result is not None  # set whenever no error was
        if self._device.type == "cuda":  # made on the side stream, used on the caller's from now on
            current = torch.cuda.current_stream(self._device)
            for _, _, inverse in self._result:
                inverse.record_stream(current)
        if self._then is not None:  # on the caller's thread: the broadcasts of a distributed schedule
            then, self._then = self._then, None
            self._result = then(self._result)
        return self._result


class ReducedFactors(dict[FactorKey, "torch.Tensor | None"]):
    """What ``reduce_factors`` returns when whether any rank had data for a factor is still on the device: every
    value that is a tensor may stand for "no rank had data" (then it holds zeros), which ``present[key]`` (a 0-dim
    boolean device tensor) tells; the preconditioner reads those flags with the step's finiteness verdict, in one
    host read, and treats a factor whose flag is false as None."""

    def __init__(self, values: dict[FactorKey, torch.Tensor | None], present: dict[FactorKey, torch.Tensor]) -> None:
        super().__init__(values)
        self.present = present


class Distributor:
    """One process: factors are used as they are, every inverse is computed here."""

    # True: factors are used in place and nothing crosses processes (the preconditioner's fast path).
    # A subclass is taken to move data unless it declares is_local = True itself.
    is_local: ClassVar[bool] = True
    world_size: int = 1
    rank: int = 0
    pipelined: bool = False
    # What setup() was given (a default one until then).
    context: DistributorContext = DistributorContext()
    # Distributed preconditioning (schedule="dpkfac"): the rank that owns each layer (its running factors,
    # inverses and preconditioning live there only; see the contract's last item). None: every rank holds every
    # layer. Set by setup().
    layer_owners: tuple[int, ...] | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "is_local" not in cls.__dict__:
            cls.is_local = False

    def setup(self, sides: Sequence[tuple[ShapeLike, ShapeLike]], context: DistributorContext) -> None:
        """Called once with the (A shape, G shape) of every layer, in layer-index order (contract item 0: an
        int n is an n x n factor), and the preconditioner's :class:`DistributorContext`, kept as ``context``."""
        self.context = context

    def begin_step(self, step: int) -> None:
        """Optimizer step ``step`` starts (before its first forward)."""

    def factor_final(self, index: int, which: str, matrix: torch.Tensor | None) -> None:
        raise RuntimeError("factor_final is only called on pipelined distributors")

    def reduce_factors(self, local: dict[FactorKey, torch.Tensor | None]) -> dict[FactorKey, torch.Tensor | None]:
        return local

    def invert(
        self,
        tasks: Sequence[Task],
        invert_fn: Callable[[list[Task]], list[torch.Tensor]],
        on_ready: Callable[[int, str, torch.Tensor], None],
    ) -> None:
        for (index, which, _), inv in zip(tasks, invert_fn(list(tasks))):
            on_ready(index, which, inv)

    def use_async_inverses(self) -> bool:
        """Whether this inverse step's inversions run asynchronously (:meth:`invert_async`); asked by the
        preconditioner on every inverse step, identical on every rank. A distributed schedule may decide
        otherwise than the preconditioner's option (the strategies' ``async_inverses``, ``schedule="auto"``)."""
        return self.context.async_inverses

    def invert_async(self, tasks: Sequence[Task],
                     invert_fn: Callable[[list[Task]], list[torch.Tensor]]) -> PendingInverses:
        """:meth:`invert`'s work on a worker thread: every inverse computed here (no communication)."""
        tasks = list(tasks)

        def run() -> list[Inverse]:
            return [(index, which, inv) for (index, which, _), inv in zip(tasks, invert_fn(tasks))]

        return PendingInverses(run, tasks[0][2].device)

    def average_scalars(self, values: torch.Tensor) -> torch.Tensor:
        """The mean over the ranks of a few float64 numbers (the step-size rule's per-rank curvature terms and loss
        change), the same tensor on every rank; one process: ``values`` itself."""
        return values

    def close(self) -> None:
        """The preconditioner is done with this distributor (its hooks are removed): release what it holds."""


@runtime_checkable
class OwnerHeld(Protocol):
    """Capability: distributed preconditioning (contract item 6). Each layer's running factors, inverses and
    preconditioning live on its owner (``layer_owners``, set by setup); the preconditioned gradients are exchanged
    every step and the ranks agree on what only owners see. A distributor claims it by naming this class among its
    bases; :func:`owner_held` is how the preconditioner finds it."""

    layer_owners: tuple[int, ...] | None

    def agree_tensor(self, ok: torch.Tensor) -> torch.Tensor:
        """The AND over ranks of the 0-dim boolean ``ok`` (every factor step, every rank), left on the device."""
        ...

    def begin_share(self, layers: Sequence[int]) -> None:
        """The layers whose preconditioned gradient this step exchanges (identical on every rank)."""
        ...

    def offer(self, index: int, value: torch.Tensor | None) -> None:
        """On the owner: layer ``index``'s preconditioned gradient (None: it has none), as soon as it is computed."""
        ...

    def finish_share(self) -> dict[int, torch.Tensor | None]:
        """Every exchanged layer's preconditioned gradient (None: left as it is), identical on every rank."""
        ...

    def share_flags(self) -> dict[int, torch.Tensor]:
        """Of the last :meth:`finish_share`: per received layer, a 0-dim boolean device tensor, false where its
        owner sent nothing (the gradient is then left as it is)."""
        ...

    def gather_layers(self, held: dict[int, LayerTensors], shapes: Sequence[tuple[FactorShape, ...]],
                      dtypes: tuple[torch.dtype, torch.dtype]) -> dict[int, LayerTensors]:
        """Every layer's state on every rank, from its owner (checkpoints)."""
        ...


def owner_held(distributor: Distributor) -> OwnerHeld | None:
    """``distributor`` as an :class:`OwnerHeld` when it holds layers on their owners (after setup), else None."""
    if isinstance(distributor, OwnerHeld) and distributor.layer_owners is not None:
        return distributor
    return None
