"""What K-FAC added to a fit, in one line: one record, one formatter, for the callback and the CLI alike.

The :class:`~lightning_spdkfac.KFAC` callback keeps a :class:`KFACRunRecord` of every K-FAC step of the fit
(the per-phase seconds of :mod:`lightning_spdkfac.telemetry`, whether it inverted, the wall time of the whole
optimizer step) and, at the end of training on rank 0, prints :func:`kfac_line` of it; the ``spdkfac`` CLI
prints the same line in its outcome block (and turns the callback's own print off, so it shows once).

:func:`possible_phases` is the set of phases that can be non-zero in a run, decided from the distributor
once set up: the callback logs only those (one process has no factor all-reduce or inverse broadcast to
wait for, a run without asynchronous inverses no worker time).
"""

from __future__ import annotations

from typing import Any

import torch

from ..kfac.distributor import Distributor
from ..telemetry import PHASES

# Phases that only a distributor moving data between processes records (comm/scheduler.py, comm/dpkfac.py).
COMM_PHASES = ("factor_comm_wait", "factor_comm_inflight", "factor_pack", "inverse_comm_wait")
DPKFAC_PHASES = ("precondition_comm_wait",)  # schedule="dpkfac": layers preconditioned on their owner
ASYNC_PHASES = ("inverse_async", "inverse_wait")  # async_inverses: the worker's time, the wait for it
# Phases off the training thread's path: shown apart, not in K-FAC's per-step sum. factor_comm_inflight
# spans launch to completion of the all-reduces, overlapping the other phases; inverse_async is the worker's.
OVERLAPPED = ("factor_comm_inflight", "inverse_async")


def possible_phases(distributor: Distributor) -> tuple[str, ...]:
    """The phases of :data:`~lightning_spdkfac.telemetry.PHASES` that can be non-zero with ``distributor``
    (after its ``setup``), in that order."""
    impossible: set[str] = set()
    if distributor.is_local:
        impossible.update(COMM_PHASES + DPKFAC_PHASES)
    elif distributor.layer_owners is None:
        impossible.update(DPKFAC_PHASES)
    # A distributor that decides for itself (the strategies' async_inverses, schedule="auto") may go async.
    decides = type(distributor).use_async_inverses is not Distributor.use_async_inverses
    if not distributor.context.async_inverses and not decides:
        impossible.update(ASYNC_PHASES)
    return tuple(p for p in PHASES if p not in impossible)


def thread_note(cap: int | None) -> str:
    """A line for the setup summary when K-FAC's own phases run on fewer threads than torch's setting (the cap of
    :mod:`lightning_spdkfac.telemetry`, documented but otherwise invisible); "" when they do not."""
    threads = torch.get_num_threads()
    if cap is None or threads <= cap:
        return ""
    return (f"\nK-FAC threads: its own phases run on {cap} of torch's {threads} intra-op threads "
            "(SPDKFAC_KFAC_THREADS=N sets the cap, 0 removes it; docs/guide/threads.md)")


def auto_choice(distributor: Any) -> str | None:
    """What an AutoDistributor (comm/auto.py) chose, for the line; None for a fixed schedule."""
    decisions = getattr(distributor, "decisions", None)
    if decisions is None:
        return None
    if not decisions:
        return "auto still timing its candidates when the run ended (no choice yet)"
    last = decisions[-1]
    return f"auto chose {last['choice']} at step {last['step']}"


class KFACRunRecord:
    """The K-FAC steps of one fit: counts and summed seconds, plain floats (a few dict updates per step).

    ``steps`` counts the K-FAC steps taken in this fit (one per optimizer step at which K-FAC
    preconditioned; a resumed fit counts from the resume, not from step 0).
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.inverse_steps = 0
        self.phase_seconds: dict[str, float] = {}
        self.step_seconds = 0.0  # wall time of the optimizer steps K-FAC took part in (forward to optimizer)
        self.timed_steps = 0  # ... how many (a step whose start was not seen is not timed)
        self.counters: dict[str, int] = {}
        self.auto: str | None = None

    def add_step(self, phases: dict[str, float], inverted: bool) -> None:
        """One K-FAC step: its per-phase seconds (``preconditioner.timer.last``), whether it inverted."""
        self.steps += 1
        self.inverse_steps += bool(inverted)
        for name, sec in phases.items():
            self.phase_seconds[name] = self.phase_seconds.get(name, 0.0) + sec

    def add_step_time(self, seconds: float) -> None:
        """The wall time of one whole optimizer step (first micro-batch's start to the optimizer step's end)."""
        self.step_seconds += seconds
        self.timed_steps += 1

    def finish(self, preconditioner: Any) -> None:
        """At the end of training: the preconditioner's fault counters and ``auto``'s choice."""
        self.counters = {"skipped factor steps": int(preconditioner.skipped_factor_steps),
                         "skipped precondition steps": int(preconditioner.skipped_precondition_steps),
                         "inverse fallbacks": int(preconditioner.inverse_fallbacks)}
        self.auto = auto_choice(preconditioner.distributor)


def kfac_line(record: KFACRunRecord | None) -> str:
    """What K-FAC added to the fit, one line (``None``: no KFAC callback). For example::

        40 steps, 2.31 ms per step in K-FAC (21% of a 11.0 ms step; factor_compute 1.20, precondition 0.70,
        inverse_compute 0.30, factor_update 0.11); inverse steps 8 of 40 (20%); skipped factor steps 0,
        skipped precondition steps 0, inverse fallbacks 0
    """
    if record is None:
        return "off (no KFAC callback: kfac is null)"
    n = record.steps
    if n == 0:
        return "on, no optimizer step taken"
    ms = {k: v * 1e3 / n for k, v in record.phase_seconds.items() if v > 0}
    overlapped = {k: ms.pop(k) for k in OVERLAPPED if k in ms}
    kfac_ms = sum(ms.values())
    phases = ", ".join(f"{k} {v:.2f}" for k, v in sorted(ms.items(), key=lambda kv: -kv[1]))
    if overlapped:
        phases += "; " + ", ".join(f"{k} {v:.2f}" for k, v in overlapped.items()) + ", overlapped"
    share = ""
    if record.timed_steps:
        step_ms = record.step_seconds * 1e3 / record.timed_steps
        share = f"{100.0 * kfac_ms / step_ms:.0f}% of a {step_ms:.1f} ms step; " if step_ms > 0 else ""
    counters = ", ".join(f"{k} {v}" for k, v in record.counters.items())
    return (f"{n} steps, {kfac_ms:.2f} ms per step in K-FAC ({share}{phases or 'no phase timed'}); "
            f"inverse steps {record.inverse_steps} of {n} ({100.0 * record.inverse_steps / n:.0f}%)"
            + (f"; {counters}" if counters else "") + (f"; {record.auto}" if record.auto else ""))
