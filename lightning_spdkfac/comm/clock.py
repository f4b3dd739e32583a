"""One timing interface for the plans: CUDA events on GPUs, the host clock on CPUs.

The fusion planner (DTF) needs when each factor *exists*, and ``schedule="auto"`` how long its candidates'
periods take. On a CPU the host clock tells both. On a GPU it does not: a hook runs when the host *queues* the
kernels that make its factor, long before they run, so host stamps would plan from launch times. There a stamp is
a CUDA event recorded on the current stream (no host wait), and the stamps of a measured step are turned into
seconds once, at its end, with one synchronisation.

    clock = clock_for(device)
    begin = clock.stamp()            # start of the measured step
    marks = [clock.stamp(), ...]     # in the hooks, as factors become final: no host read
    seconds = clock.seconds(begin, marks)   # at the end of the step: one synchronisation on a GPU
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import torch

__all__ = ["Clock", "CudaClock", "HostClock", "clock_for"]


class Clock(Protocol):
    """Stamps now, seconds later."""

    def stamp(self) -> object:
        """A mark of this point of the work (of the current stream, on a GPU); never waits."""
        ...

    def seconds(self, start: object, marks: Sequence[object]) -> list[float]:
        """Seconds from ``start`` to each of ``marks`` (at most one synchronisation)."""
        ...


class HostClock:
    """``time.perf_counter``: on a CPU the host runs the work, so its clock tells when the work is done."""

    def stamp(self) -> float:
        return time.perf_counter()

    def seconds(self, start: object, marks: Sequence[object]) -> list[float]:
        assert isinstance(start, float)
        return [float(m) - start for m in marks]  # type: ignore[arg-type]


class CudaClock:
    """CUDA events with timing on the current stream of ``device``; :meth:`seconds` synchronises once."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def stamp(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start: object, marks: Sequence[object]) -> list[float]:
        assert isinstance(start, torch.cuda.Event)
        if not marks:
            return []
        torch.cuda.synchronize(self.device)  # the one synchronisation of a measured step
        return [start.elapsed_time(m) / 1e3 for m in marks]  # type: ignore[arg-type]


def clock_for(device: torch.device | str) -> HostClock | CudaClock:
    """The clock that tells when work on ``device`` happens: CUDA events for a GPU, else the host clock."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return CudaClock(dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device()))
    return HostClock()
