"""Per-phase timing of K-FAC steps: wall-clock seconds per phase, and ``record_function`` ranges.

Every phase of an iteration that K-FAC adds is timed on the host and marked with
``torch.profiler.record_function("kfac/<phase>")``, so it shows by name in the PyTorch profiler
and in Chrome traces. Phases (seconds per optimizer step):

- ``factor_compute``: factor statistics in the hooks and this step's factors (forward + backward).
- ``factor_comm_wait``: time blocked on factor all-reduces in ``step()`` (the *exposed*
  factor communication); ``factor_comm_inflight``: the union of the intervals from each fused
  all-reduce's launch to its completion (an upper bound of the time factor communication was
  under way, overlapped or not); ``factor_pack``: packing factors submitted in ``step()`` and
  unpacking the reduced triangles into full matrices.
- ``factor_update``: finiteness check and running averages.
- ``inverse_compute`` / ``inverse_comm_wait``: inversions on this rank / time blocked on
  inverse broadcasts.
- ``inverse_async`` / ``inverse_wait`` (``async_inverses``): the worker's time on the inversions (and
  broadcasts) launched by the last inverse step, off this thread's path / the time this step's
  ``step()`` waited for them to finish (the part that was not hidden).
- ``precondition``: preconditioning, KL clip and write-back.

Times are host times: on a GPU they are the time to *issue* the work unless something in the
phase synchronizes (factor and inverse waits do).

Thread cap: every phase also runs with at most :func:`kfac_thread_cap` intra-op threads (torch's setting
is lowered on entry and restored on exit; the switch costs about a microsecond). K-FAC's own CPU work is
many small matmuls and inversions, each a parallel region that stalls when one of its threads waits for
a core something else holds (measured by ``benchmarks/threads.py``; the README's "Threads on CPU").
The cap is 1 unless the environment variable ``SPDKFAC_KFAC_THREADS`` says otherwise (a positive
integer, or ``0``/``off`` for no cap), read when the preconditioner is built.

:class:`WindowStats` aggregates such per-step times (plain floats) over the steps between two
writes of a logger: the ``KFAC`` callback logs their mean and max, not single samples.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext

import torch
from torch.profiler import record_function

PHASES = (
    "factor_compute",
    "factor_comm_wait",
    "factor_comm_inflight",
    "factor_pack",
    "factor_update",
    "inverse_compute",
    "inverse_comm_wait",
    "inverse_async",
    "inverse_wait",
    "precondition",
    "precondition_comm_wait",
)


THREADS_ENV = "SPDKFAC_KFAC_THREADS"
DEFAULT_THREAD_CAP = 1


def _parse_cap(text: str) -> int | None:
    value = text.strip().lower()
    if value in ("0", "off", "none", ""):
        return None
    try:
        cap = int(value)
    except ValueError:
        raise ValueError(f"{THREADS_ENV} must be a positive integer, or 0/off for no cap; got {text!r}") from None
    if cap < 0:
        raise ValueError(f"{THREADS_ENV} must be a positive integer, or 0/off for no cap; got {text!r}")
    return cap or None


def kfac_thread_cap() -> int | None:
    """The most intra-op threads K-FAC's own phases run with (None: torch's setting, no cap)."""
    text = os.environ.get(THREADS_ENV)
    return DEFAULT_THREAD_CAP if text is None else _parse_cap(text)


@contextmanager
def capped_threads(cap: int | None) -> Iterator[None]:
    """Run the block with at most ``cap`` intra-op threads (None: unchanged); restores torch's setting."""
    before = torch.get_num_threads()
    if cap is None or before <= cap:
        yield
        return
    torch.set_num_threads(cap)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _profiler_enabled() -> bool:
    return torch._C._autograd._profiler_enabled()


class StepTimer:
    """Accumulates phase seconds during a step; :attr:`last` holds the previous step's totals."""

    def __init__(self) -> None:
        self._totals: dict[str, float] = defaultdict(float)
        self.last: dict[str, float] = {}
        self.thread_cap = kfac_thread_cap()  # read once: the environment is not consulted per phase

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        # A record_function range costs microseconds even with no profiler running, and phases sit
        # in per-layer hooks: open one only while a profiler is recording.
        with record_function(f"kfac/{name}") if _profiler_enabled() else nullcontext():
            with capped_threads(self.thread_cap):
                t0 = time.perf_counter()
                try:
                    yield
                finally:
                    self._totals[name] += time.perf_counter() - t0

    def add(self, name: str, seconds: float) -> None:
        self._totals[name] += seconds

    def end_step(self) -> dict[str, float]:
        self.last = {name: self._totals.get(name, 0.0) for name in PHASES}
        self._totals = defaultdict(float)
        return self.last


class WindowStats:
    """Mean and max of named per-step values over a window of steps, in plain Python floats.

    :meth:`add` takes one step's values (a name missing in a step is left out of that name's mean)
    and whether the step is *flagged* (the callback: it computed inverses); :meth:`means`,
    :meth:`maxima` and :attr:`flagged_share` describe the steps added since the last :meth:`reset`.
    Nothing here touches a tensor, so adding a step costs a few dictionary updates.
    """

    def __init__(self) -> None:
        self.steps = 0  # steps added since the last reset
        self.flagged = 0  # ... of which flagged
        self._sum: dict[str, float] = {}
        self._max: dict[str, float] = {}
        self._count: dict[str, int] = {}

    def add(self, values: Mapping[str, float], flagged: bool = False) -> None:
        self.steps += 1
        if flagged:
            self.flagged += 1
        total, most, count = self._sum, self._max, self._count
        for name, v in values.items():
            if name in total:
                total[name] += v
                count[name] += 1
                if v > most[name]:
                    most[name] = v
            else:
                total[name] = most[name] = v
                count[name] = 1

    def means(self) -> dict[str, float]:
        """Per name: the mean over the steps of the window that had it."""
        return {name: s / self._count[name] for name, s in self._sum.items()}

    def maxima(self) -> dict[str, float]:
        return dict(self._max)

    @property
    def flagged_share(self) -> float:
        """Flagged steps / steps (0.0 for an empty window)."""
        return self.flagged / self.steps if self.steps else 0.0

    def reset(self) -> None:
        self.steps = self.flagged = 0
        self._sum, self._max, self._count = {}, {}, {}
