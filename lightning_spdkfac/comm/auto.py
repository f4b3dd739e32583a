"""``schedule="auto"``: time the candidate schedules on the job itself and keep the fastest.

Which schedule is fastest depends on the model, the world size, the network and the K-FAC intervals (on
2 CPU ranks, SPD without pipelining beats SPD with it when inverses are rare; on a 64-GPU cluster the
simulator says the opposite), so instead of asking the user to guess, :class:`AutoDistributor` holds one
:class:`~lightning_spdkfac.comm.scheduler.SPDDistributor` per candidate and runs each in turn:

* **Candidates.** With ``schedule="auto"``: ``spd``, ``spd`` without pipelining, ``mpd`` and ``dkfac``; with
  a named schedule, that one alone. With ``async_inverses="auto"`` each of them with and without
  asynchronous inverses, else at the one setting given (None: the ``KFAC`` callback's). The schedules are
  numerically equal (factors averaged over the same ranks, inverses of the same factors), so which one
  runs a step is invisible to the math; asynchronous inverses are not (one step staler), which is why they
  are only timed when asked for.
* **Warm-up.** ``spd`` measures its factor ready times first (its ``profile_steps``); until then, and up to
  the next inverse step, it runs and nothing is timed.
* **Timing.** Each candidate then runs slots of whole inverse periods (from an inverse step to the step before
  the next one: a period holds every kind of step in its real proportion, including the step after an
  inverse step that waits for asynchronous inversions), at least :data:`MIN_SLOT_STEPS` steps per slot, in
  rotation, ``auto_rounds`` slots each. A slot's time is the wall time between the starts of its first step
  and of the next slot (forward, backward, ``step()`` and the optimizer step), per period.
* **Decision.** Every rank takes its fastest slot per candidate (the minimum, not the median: on a shared
  machine, and on a cluster with data-loading hiccups or network jitter, disturbances only ever add time, so
  the least disturbed slot is the best estimate of what a schedule costs; in one benchmark run on 2 heavily
  loaded CPU ranks, the median of 3 slots chose dkfac, 14% slower than mpd in the timed rounds that followed); one all-reduce (MAX) gives the slowest rank's, which
  is the time the job runs at; every rank keeps the candidate with the smallest (ties: the earlier candidate
  in the list above), so the decision is the same everywhere. The medians are logged beside them. The table and
  the choice are logged on rank 0 (logger ``lightning_spdkfac.comm.auto``, INFO) and kept in
  :attr:`AutoDistributor.decisions`.
* ``replan_every``: the rotation starts again every this many steps after a decision (at the next
  inverse step), and decides again.

The candidates share the cost models (measured once, by ``spd``) and one process group for asynchronous
broadcasts (one :class:`~lightning_spdkfac.comm.scheduler.SharedPlanning` given to each at construction); each
candidate is driven through the distributor contract alone (setup with the preconditioner's context, then the
per-step calls). Nothing of this is checkpointed: a resumed run times again.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..factor_shapes import ShapeLike
from ..kfac.distributor import Distributor, DistributorContext, FactorKey, PendingInverses, Task
from ._common import default_device, distributed_ready
from .clock import CudaClock, HostClock, clock_for
from .faults import Work, stream_ordered, wait_work
from .scheduler import SharedPlanning, SPDDistributor, SPDOptions

__all__ = ["AUTO_SCHEDULES", "AutoDistributor", "candidates"]

log = logging.getLogger(__name__)

AUTO_PHASE = "K-FAC schedule=auto decision"
MIN_SLOT_STEPS = 5  # a timing slot holds at least this many steps (whole inverse periods): one step is too noisy

# schedule="auto": the candidates, as (label, SPDOptions.from_schedule arguments), in tie-break order.
AUTO_SCHEDULES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("spd", dict(schedule="spd")),
    ("spd-no-pipelining", dict(schedule="spd", pipelining=False)),
    ("mpd", dict(schedule="mpd")),
    ("dkfac", dict(schedule="dkfac")),
)


def candidates(options: SPDOptions) -> list[tuple[str, SPDOptions]]:
    """The (label, options) of every configuration ``options`` asks to be timed."""
    keep: dict[str, Any] = dict(comm_dtype=options.comm_dtype, comm_timeout_s=options.comm_timeout_s, fuse_g=options.fuse_g,
                profile_steps=options.profile_steps)
    if options.schedule == "auto":
        base = [(label, SPDOptions.from_schedule(**kw, **keep)) for label, kw in AUTO_SCHEDULES]
    else:  # a named schedule with async_inverses="auto": that one, as configured
        base = [(options.schedule, dataclasses.replace(options, async_inverses=None,
                                                      auto_rounds=SPDOptions.auto_rounds))]
    base = [(label, dataclasses.replace(o, replan_every=None)) for label, o in base]
    if options.async_inverses != "auto":
        return [(label, dataclasses.replace(o, async_inverses=options.async_inverses)) for label, o in base]
    return [(f"{label}{suffix}", dataclasses.replace(o, async_inverses=flag))
            for label, o in base for suffix, flag in (("", False), ("+async", True))]


class AutoDistributor(Distributor):
    """Times the candidate schedules (module docstring) and then runs the fastest.

    Args:
        options: with ``schedule="auto"`` or ``async_inverses="auto"`` (what is timed); ``auto_rounds``
            periods per candidate; ``replan_every``: decide again every this many steps.
        process_group, device: as :class:`SPDDistributor`'s (every candidate uses them).
    """

    def __init__(self, options: SPDOptions, process_group: dist.ProcessGroup | None = None,
                 device: torch.device | str | None = None) -> None:
        if not options.is_auto:
            raise ValueError("AutoDistributor needs options with schedule='auto' or async_inverses='auto', got "
                             f"schedule={options.schedule!r}, async_inverses={options.async_inverses!r}")
        self.options = options
        self.process_group = process_group
        self._dist = distributed_ready(process_group)
        self.labels: list[str] = []
        self.candidates: list[SPDDistributor] = []
        shared = SharedPlanning()  # the first candidate to set up measures the models; all plan from them
        for label, o in candidates(options):
            self.labels.append(label)
            self.candidates.append(SPDDistributor(o, process_group=process_group, device=device, shared=shared))
        first = self.candidates[0]
        self.world_size, self.rank, self.device = first.world_size, first.rank, first.device
        self.active = 0  # index of the candidate running the coming step
        self.chosen: int | None = None  # the decision, once made
        self.decisions: list[dict[str, Any]] = []  # one per decision: step, table, choice
        self._slot: int | None = None  # position in the rotation (None: warm-up or decided)
        self._slot_periods = 1  # inverse periods per slot (set at setup: MIN_SLOT_STEPS steps at least)
        self._periods_done = 0  # ... of the current slot
        self._periods: list[list[float]] = [[] for _ in self.candidates]
        # A slot is timed from its first step's start to its last step's end by one clock (comm/clock.py): CUDA
        # events on a GPU, where the host runs ahead of the work, with one synchronisation when a slot ends.
        self._clock: HostClock | CudaClock = clock_for(self.candidates[0].device)
        self._slot_start: object = None
        self._decided_at = 0

    @property
    def pipelined(self) -> bool:  # type: ignore[override]
        return self.candidates[self.active].pipelined

    @property
    def factor_steps(self) -> int:
        """Steps in which factors were reduced, by whichever candidate."""
        return sum(c.factor_steps for c in self.candidates)

    def setup(self, sides: Sequence[tuple[ShapeLike, ShapeLike]], context: DistributorContext) -> None:
        super().setup(sides, context)
        self._slot_periods = -(-MIN_SLOT_STEPS // context.inv_update_steps)
        # The first measures the cost models; the others plan from the same ones (their SharedPlanning). The first
        # candidate that inverts asynchronously creates the one asynchronous group, at the start of its setup (the
        # first or the second candidate, whose setup begins with it: the same point on every rank); every
        # candidate's broadcasts go there, one round at a time.
        for c in self.candidates:
            c.setup(sides, context)

    # ------------------------------------------------------------------ which candidate runs
    def _warming_up(self) -> bool:
        return self.candidates[0].measuring

    def begin_step(self, step: int) -> None:
        if step % self.context.inv_update_steps == 0:  # a period boundary
            self._at_period_boundary(step)
        self.candidates[self.active].begin_step(step)

    def _at_period_boundary(self, step: int) -> None:
        if self._slot is not None:  # a timed period ended
            self._periods_done += 1
            if self._periods_done < self._slot_periods:
                return  # the slot goes on
            seconds = self._clock.seconds(self._slot_start, [self._clock.stamp()])[0]
            self._periods[self.active].append(seconds / self._slot_periods)
            self._slot += 1
            if self._slot == len(self.candidates) * self.options.auto_rounds:
                self._decide(step)
        elif self.chosen is None and not self._warming_up():
            self._slot = 0  # warm-up over: start the rotation
        elif (self.chosen is not None and self.options.replan_every
              and step - self._decided_at >= self.options.replan_every):
            self._periods = [[] for _ in self.candidates]
            self.chosen, self._slot = None, 0
        if self._slot is not None:
            self.active = self._slot % len(self.candidates)
            self._slot_start = self._clock.stamp()
            self._periods_done = 0

    def _decide(self, step: int) -> None:
        n = len(self._periods)
        both = self._rank_max([min(p) for p in self._periods] + [statistics.median(p) for p in self._periods])
        fastest, medians = both[:n], both[n:]
        best = min(range(n), key=lambda i: (fastest[i], i))
        table = dict(zip(self.labels, fastest))
        self.decisions.append({"step": step, "seconds_per_period": table, "choice": self.labels[best],
                               "median_seconds_per_period": dict(zip(self.labels, medians)),
                               "steps_per_period": self.context.inv_update_steps,
                               "periods_per_slot": self._slot_periods})
        if self.rank == 0:
            per_step = 1e3 / self.context.inv_update_steps
            rows = "; ".join(f"{label} {t * per_step:.2f} ms/step (median {m * per_step:.2f})"
                             for label, t, m in zip(self.labels, fastest, medians))
            log.info("K-FAC schedule=auto at step %d (fastest of %d slot(s) of %d inverse period(s) each, slowest "
                     "rank): %s -> %s", step, self.options.auto_rounds, self._slot_periods, rows, self.labels[best])
        self.chosen = self.active = best
        self._slot = None
        self._decided_at = step

    def _rank_max(self, values: list[float]) -> list[float]:
        """Each value's maximum over the ranks (one all-reduce, bounded by comm_timeout_s)."""
        if not self._dist or self.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=default_device(self.process_group))
        work: Work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group, async_op=True)
        wait_work(work, self.options.comm_timeout_s, collective="all_reduce", phase=AUTO_PHASE,
                  what="the candidates' median times", rank=self.rank, world_size=self.world_size,
                  stream_only=stream_ordered(self.process_group))
        return [float(v) for v in t.cpu()]

    # ------------------------------------------------------------------ the active candidate does the work
    def factor_final(self, index: int, which: str, matrix: torch.Tensor | None) -> None:
        self.candidates[self.active].factor_final(index, which, matrix)

    def reduce_factors(self, local: dict[FactorKey, torch.Tensor | None]) -> dict[FactorKey, torch.Tensor | None]:
        return self.candidates[self.active].reduce_factors(local)

    def invert(self, tasks: Sequence[Task], invert_fn: Callable[[list[Task]], list[torch.Tensor]],
               on_ready: Callable[[int, str, torch.Tensor], None]) -> None:
        self.candidates[self.active].invert(tasks, invert_fn, on_ready)

    def use_async_inverses(self) -> bool:
        return self.candidates[self.active].use_async_inverses()

    def invert_async(self, tasks: Sequence[Task],
                     invert_fn: Callable[[list[Task]], list[torch.Tensor]]) -> PendingInverses:
        return self.candidates[self.active].invert_async(tasks, invert_fn)

    def average_scalars(self, values: torch.Tensor) -> torch.Tensor:
        return self.candidates[self.active].average_scalars(values)

    def close(self) -> None:
        for c in self.candidates:  # the first destroys the shared asynchronous group; the others find it gone
            c.close()

    def describe(self) -> dict[str, Any]:
        """The active candidate's plan, with what auto timed and decided."""
        return {**self.candidates[self.active].describe(), "auto": {
            "candidates": list(self.labels), "active": self.labels[self.active],
            "chosen": None if self.chosen is None else self.labels[self.chosen], "decisions": list(self.decisions)}}
