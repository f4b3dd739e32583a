"""The inverse steps of the preconditioner: damped inverses (Cholesky) or eigen payloads of the running
factors, every ``inv_update_steps`` (and a layer's first), on this thread or asynchronously (``async_inverses``:
launched by one step, swapped in at the start of the next), with the fallbacks counted and reported.

:class:`Inverter` is a part of :class:`~lightning_spdkfac.kfac.KFACPreconditioner`; the math is in
kfac/inverse.py and docs/math.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .. import validation as val
from ..telemetry import capped_threads
from .core import Core
from .distributor import PendingInverses, Task
from .inverse import (
    EIGEN_FALLBACK_ACTION,
    FALLBACK_ACTION,
    Fallback,
    pi_split,
    robust_eigens,
    robust_inverses,
)
from .inverse_memory import stack_budget
from .layer_state import KFACLayer


@dataclass
class _InFlight:
    """Asynchronous inversions launched on an inverse step, until the next step() swaps them in."""

    pending: PendingInverses
    layers: dict[int, KFACLayer]  # by index: the layers being inverted
    damping: float  # the block damping they were computed with (eigen applies it when preconditioning)
    # Fallback reports the worker made, replayed on the caller's thread at the swap (warnings and counters
    # are not touched from the worker).
    reports: list[Callable[[], None]] = field(default_factory=list)
    compute_seconds: float = 0.0  # inversion time on the worker (inverse_async)


class Inverter:
    """A part of the preconditioner that owns the inverse steps: the inversions in flight (``async_inverses``), the
    fallback count and whether the last step inverted. ``on_ready`` preconditions a layer once both its inverses
    arrived (kfac/preconditioning.py)."""

    def __init__(self, core: Core, on_ready: Callable[[KFACLayer], None]) -> None:
        self.core = core
        self._on_ready = on_ready
        # Inversions running asynchronously (async_inverses), launched by an inverse step and swapped in at the start
        # of the next step(); None when nothing is in flight.
        self.in_flight: _InFlight | None = None
        self.inverse_fallbacks = 0  # factor inversions Cholesky could not do (see kfac.inverse)
        # Did the last step() recompute inverses (every inv_update_steps, or a layer's first)? Telemetry.
        self.last_step_inverted = False

    def update(self, k: int) -> None:
        core = self.core
        due = k % core.inv_update_steps == 0
        todo = [ly for ly in core.layers.values() if ly.A is not None and (due or ly.A_inv is None)]
        self.last_step_inverted = bool(todo)
        if not todo:
            return
        damping = val.resolve("damping", core.damping, k, val.NONNEGATIVE)
        if core.distributor.use_async_inverses():
            # A layer's first inverses are computed now (there is nothing to precondition with yet); the others
            # are recomputed off this thread while this step preconditions with the ones held.
            now = [ly for ly in todo if ly.A_inv is None]
            later = [ly for ly in todo if ly.A_inv is not None]
            if later:
                self._launch_inverses(k, damping, later)
            todo = now
            if not todo:
                return
        by_index = {ly.index: ly for ly in todo}
        invert = (self._eigen_fn(k, by_index, self._report_now) if core.eigen
                  else self._cholesky_fn(k, damping, todo, by_index, self._report_now))
        for ly in todo:
            ly.inv_damping = damping  # eigen applies it when preconditioning, until the next inverse step

        arrived: set[tuple[int, str]] = set()

        def on_ready(index: int, which: str, inverse: torch.Tensor) -> None:
            layer = by_index[index]
            setattr(layer, f"{which}_inv", inverse)
            layer.inv_version += 1
            arrived.add((index, which))
            if (index, "A") in arrived and (index, "G") in arrived:
                # Both inverses are here: precondition this layer now, while others still arrive.
                with core.timer.phase("precondition"):
                    self._on_ready(layer)

        tasks = [(ly.index, which, getattr(ly, which)) for ly in todo for which in ("A", "G")]
        core.distributor.invert(tasks, invert, on_ready)

    def _report_now(self, report: Callable[[], None]) -> None:
        report()

    @contextmanager
    def _inverse_timing(self, flight: _InFlight | None) -> Iterator[None]:
        """The inversion phase: on this thread a timer phase (``inverse_compute``); on the worker the thread
        cap and a plain clock into ``flight`` (the timer belongs to the caller's thread)."""
        if flight is None:
            with self.core.timer.phase("inverse_compute"):
                yield
            return
        with capped_threads(self.core.timer.thread_cap):
            t0 = time.perf_counter()
            try:
                yield
            finally:
                flight.compute_seconds += time.perf_counter() - t0

    def _launch_inverses(self, k: int, damping: float, layers: list[KFACLayer]) -> None:
        """Start the inversions of ``layers`` on the distributor's worker (async_inverses); see settle."""
        by_index = {ly.index: ly for ly in layers}
        flight = _InFlight(pending=None, layers=by_index, damping=damping)  # type: ignore[arg-type]
        invert = (self._eigen_fn(k, by_index, flight.reports.append, flight) if self.core.eigen
                  else self._cholesky_fn(k, damping, layers, by_index, flight.reports.append, flight))
        # The worker reads these factors; they are not modified before the next step() settles it.
        tasks = [(ly.index, which, getattr(ly, which)) for ly in layers for which in ("A", "G")]
        flight.pending = self.core.distributor.invert_async(tasks, invert)
        self.in_flight = flight

    def settle(self, keep: bool = True) -> None:
        """Swap in the inverses of the asynchronous inversions in flight (waiting for what is not done), or,
        with ``keep=False``, wait for them and drop them. Their worker's errors are raised here, with ``keep``;
        either way nothing is left in flight and the inverses held stay consistent (all of one inverse step's
        layers swapped in, or none)."""
        flight, self.in_flight = self.in_flight, None
        if flight is None:
            return
        t0 = time.perf_counter()
        try:
            results = flight.pending.wait()
        except BaseException:
            if keep:
                raise
            return
        finally:
            self.core.timer.add("inverse_wait", time.perf_counter() - t0)
        if not keep:
            return
        self.core.timer.add("inverse_async", flight.compute_seconds)
        for report in flight.reports:
            report()
        for index, which, inverse in results:
            setattr(flight.layers[index], f"{which}_inv", inverse)
            flight.layers[index].inv_version += 1
        for layer in flight.layers.values():
            layer.inv_damping = flight.damping

    def _targets(self, tasks: list[Task], by_index: dict[int, KFACLayer],
                 flight: _InFlight | None) -> tuple[list[torch.Tensor | None] | None, int]:
        """Where the new inverses of ``tasks`` go, and the bound on one stack (kfac/inverse_memory.py stack_budget).

        On this thread the held inverses are overwritten in place, group by group: nothing reads them until the
        step's inverses are all in (each layer is preconditioned once both of its have arrived), and an inverse
        step then holds one set of inverses, not the old and the new side by side (the summary's peak). The
        asynchronous worker makes new ones instead: the held ones precondition this step meanwhile (the summary's
        "async" set)."""
        size = torch.empty((), dtype=self.core.inv_dtype).element_size()
        budget = stack_budget([t[2].numel() * size for t in tasks])
        if flight is not None:
            return None, budget
        return [getattr(by_index[index], f"{which}_inv") for index, which, _ in tasks], budget

    def _cholesky_fn(self, k: int, damping: float, todo: list[KFACLayer], by_index: dict[int, KFACLayer],
                     report: Callable[[Callable[[], None]], None],
                     flight: _InFlight | None = None) -> Callable[[list[Task]], list[torch.Tensor]]:
        """The distributor's ``invert_fn`` for inverse_method="cholesky": damped inverses, pi-balanced split.
        ``report`` takes each fallback report (run now, or kept for the swap of ``flight``'s inverses)."""
        split = self._factor_dampings(todo, damping)  # (on this thread: the factors are read before any launch)

        def invert(tasks: list[Task]) -> list[torch.Tensor]:
            dampings = [split[(index, which)] for index, which, _ in tasks]
            out, budget = self._targets(tasks, by_index, flight)
            with self._inverse_timing(flight):
                inverses, fallbacks = robust_inverses([t[2] for t in tasks], dampings, self.core.inv_dtype, out, budget)
            if fallbacks:
                report(lambda: self._report_fallbacks(fallbacks, tasks, by_index, "inverse", lambda fb, which: (
                    f"Cholesky of the damped {which} factor failed at step {k} (damping {damping:g}, "
                    f"{_shown(dampings[fb.index])} on this factor): {fb.reason}; "
                    + FALLBACK_ACTION[fb.level].format(damping=fb.damping))))
            return inverses

        return invert

    def _eigen_fn(self, k: int, by_index: dict[int, KFACLayer], report: Callable[[Callable[[], None]], None],
                  flight: _InFlight | None = None) -> Callable[[list[Task]], list[torch.Tensor]]:
        """The distributor's ``invert_fn`` for inverse_method="eigen": eigen payloads (kfac/inverse.py)."""

        def invert(tasks: list[Task]) -> list[torch.Tensor]:
            out, budget = self._targets(tasks, by_index, flight)
            with self._inverse_timing(flight):
                payloads, fallbacks = robust_eigens([t[2] for t in tasks], self.core.inv_dtype, out, budget)
            if fallbacks:
                report(lambda: self._report_fallbacks(fallbacks, tasks, by_index, "eigen", lambda fb, which: (
                    f"the eigendecomposition of the {which} factor failed at step {k} (inv_dtype "
                    f"{self.core.inv_dtype}): {fb.reason}; " + EIGEN_FALLBACK_ACTION[fb.level])))
            return payloads

        return invert

    def _report_fallbacks(self, fallbacks: list[Fallback], tasks: list[Task], by_index: dict[int, KFACLayer],
                          kind: str, describe: Callable[[Fallback, str], str]) -> None:
        """Count the inversions that fell back and warn once per layer and level (kfac/inverse.py)."""
        self.inverse_fallbacks += len(fallbacks)
        for fb in fallbacks:
            index, which, _ = tasks[fb.index]
            name = by_index[index].name
            self.core.warn_once(name, f"{kind}-{fb.level}", f"K-FAC layer {name!r}: " + describe(fb, which))

    @staticmethod
    def _factor_dampings(layers: list[KFACLayer], damping: float) -> dict[tuple[int, str], torch.Tensor]:
        """(layer index, "A"/"G") -> the damping added to that factor: the pi-balanced split of ``damping``.

        Every rank holds the same reduced factors, so every rank computes the same split; no host sync.
        """
        out: dict[tuple[int, str], torch.Tensor] = {}
        for ly in layers:
            assert ly.A is not None and ly.G is not None  # set together
            out[(ly.index, "A")], out[(ly.index, "G")] = pi_split(ly.A, ly.G, damping)
        return out


def _shown(damping: float | torch.Tensor) -> str:
    """A factor's damping for a warning: one number, or the range over the blocks of a grouped factor (an expert
    stack, a grouped convolution: one pi-balanced damping per block)."""
    if isinstance(damping, torch.Tensor) and damping.numel() > 1:
        return f"{float(damping.min()):.3g}-{float(damping.max()):.3g} over its {damping.numel()} blocks"
    return f"{float(damping):.3g}"
