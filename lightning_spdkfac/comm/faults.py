"""Failures of K-FAC's collectives: bounded waits, and errors that say which collective failed, where, and why.

Every blocking wait of the comm executors on an asynchronous collective goes through :func:`wait_work`,
bounded by a timeout in seconds (``SPDOptions.comm_timeout_s``, 600 s by default). When a peer rank
crashes, gloo fails the pending collectives as soon as it sees the peer's socket close; when a peer
stalls (or issued a different collective), the wait ends at the timeout. Either way the caller gets a
:class:`KFACCommError` naming the collective (``all_reduce`` / ``broadcast`` / ``all_gather``), the phase
(:data:`FACTOR_ALLREDUCE`, :data:`INVERSE_BROADCAST`, :data:`PLAN_CHECK`), what was being sent, this
rank, the world size and the timeout, with the backend's exception as ``__cause__``.

Backends: with gloo (CPU tensors) ``Work.wait(timeout)`` blocks the host and raises at the deadline,
leaving the collective queued in gloo (the executors then abandon it: see :mod:`.executor`). With NCCL a
``Work.wait(timeout)`` would busy-wait on the host until the kernel is done, so there :func:`wait_work` calls
``Work.wait()`` with no timeout (``stream_only=True``, chosen per process group by :func:`stream_ordered`): the
current CUDA stream is ordered behind the collective and the host goes on. The bound that applies there is the
process group's own timeout (NCCL's watchdog, which the strategies set to ``comm_timeout_s``); its errors ("Watchdog
caught collective operation timeout ... ran for ... milliseconds before timing out") are recognised as timeouts.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Protocol

FACTOR_ALLREDUCE = "K-FAC factor all-reduce"
INVERSE_BROADCAST = "K-FAC inverse broadcast"
PLAN_CHECK = "K-FAC plan check"
PRECONDITIONED_BROADCAST = "K-FAC preconditioned-gradient broadcast"
STATE_GATHER = "K-FAC state gather"
FINITE_AGREEMENT = "K-FAC finite-factor agreement"

__all__ = [
    "FACTOR_ALLREDUCE",
    "FINITE_AGREEMENT",
    "INVERSE_BROADCAST",
    "PLAN_CHECK",
    "PRECONDITIONED_BROADCAST",
    "STATE_GATHER",
    "KFACCommError",
    "TIMEOUT_ACCEPTED",
    "Work",
    "comm_error",
    "stream_ordered",
    "wait_work",
]


class Work(Protocol):
    """What an asynchronous collective returns (``torch.distributed.Work``): something to wait on."""

    def wait(self, timeout: timedelta = ...) -> bool: ...


class KFACCommError(RuntimeError):
    """A K-FAC collective failed (a peer crashed or broke the connection) or did not complete in time.

    Attributes: ``collective`` (``"all_reduce"``, ``"broadcast"``, ``"all_gather"``), ``phase`` (e.g.
    ``"K-FAC factor all-reduce"``), ``what`` (the fusion group / factor / plan), ``rank`` and ``world_size``
    (in the K-FAC process group), ``timeout_s``, and ``timed_out`` (True: the wait hit the timeout; False:
    the backend reported an error). The backend's exception is ``__cause__``.
    """

    def __init__(self, message: str, *, collective: str, phase: str, what: str, rank: int, world_size: int,
                 timeout_s: float, timed_out: bool) -> None:
        super().__init__(message)
        self.collective = collective
        self.phase = phase
        self.what = what
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.timed_out = timed_out


TIMEOUT_ACCEPTED = ("a positive, finite number of seconds (the longest any rank waits for one K-FAC collective "
                    "before failing)")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


_TIMEOUT_WORDS = (
    "timed out",  # gloo's Work.wait(timeout): "Operation timed out!"; its process-group timeout: "Timed out waiting"
    "timing out",  # NCCL's watchdog: "WorkNCCL(SeqNum=..., OpType=ALLREDUCE, ...) ran for 600015 milliseconds before
    "collective operation timeout",  # timing out"; "Watchdog caught collective operation timeout: ..."
    "nccl timeout",
)


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(word in text for word in _TIMEOUT_WORDS)


def stream_ordered(process_group: object | None) -> bool:
    """Whether waits on ``process_group``'s collectives order the current CUDA stream instead of blocking the host
    (NCCL); False for host backends (gloo) and without torch.distributed."""
    import torch.distributed as dist  # (local: this module is also imported where torch.distributed is not set up)

    if not (dist.is_available() and dist.is_initialized()):
        return False
    try:
        return str(dist.get_backend(process_group)).lower() == "nccl"  # type: ignore[arg-type]
    except (RuntimeError, ValueError):  # a group this rank is not in
        return False


def comm_error(exc: BaseException, *, collective: str, phase: str, what: str, rank: int, world_size: int,
               timeout_s: float, launching: bool = False) -> KFACCommError:
    """The :class:`KFACCommError` for ``exc`` raised while launching or waiting on a K-FAC collective."""
    timed_out = not launching and _is_timeout(exc)
    if timed_out:
        happened = f"did not complete within comm_timeout_s={timeout_s:g} s"
        advice = ("A peer rank is stalled, has crashed without closing its connections, or issued a "
                  "different collective. Look at the other ranks' logs for the first error; check that every "
                  "rank runs the same steps (no rank-dependent evaluation, checkpointing or early exit) with "
                  "the same K-FAC plan; raise comm_timeout_s if one rank is legitimately slower than "
                  f"{timeout_s:g} s at this point.")
    else:
        verb = "could not be launched" if launching else "failed"
        happened = f"{verb} ({_first_line(exc)}; comm_timeout_s={timeout_s:g} s)"
        advice = ("A peer rank probably crashed or closed its connection: look at the other ranks' logs for the "
                  "first error (the one that is not a K-FAC communication error), and check that all ranks "
                  "are alive and can reach each other.")
    message = (f"{phase} failed: {collective} of {what} on rank {rank} of {world_size} {happened}. {advice} "
               "This process group can no longer be trusted (collectives may still be pending); restart the "
               "job or re-create the process group (an elastic restart resumes from the last checkpoint).")
    return KFACCommError(message, collective=collective, phase=phase, what=what, rank=rank,
                         world_size=world_size, timeout_s=timeout_s, timed_out=timed_out)


def wait_work(work: Work, timeout_s: float, *, collective: str, phase: str, what: str, rank: int,
              world_size: int, stream_only: bool = False) -> None:
    """``work.wait()``, bounded by ``timeout_s`` seconds; a failure or timeout raises :class:`KFACCommError`
    (with the backend's exception as ``__cause__``). ``stream_only`` (NCCL, :func:`stream_ordered`): no host wait,
    the current stream is ordered behind the collective, bounded by the process group's watchdog timeout."""
    try:
        done = work.wait() if stream_only else work.wait(timeout=timedelta(seconds=timeout_s))
        if done is False:  # a backend that reports the timeout instead of raising it
            raise TimeoutError(f"Work.wait timed out after {timeout_s:g} s")
    except Exception as exc:  # noqa: BLE001 - every backend error becomes one that names the collective
        raise comm_error(exc, collective=collective, phase=phase, what=what, rank=rank, world_size=world_size,
                         timeout_s=timeout_s) from exc
