"""Run a function on N local ranks: one process per rank, bounded, never left behind.

    results = run_distributed(worker, 2, extra_arg, timeout=30)   # worker(rank, world_size, extra_arg)

Used by the multi-process tests and benchmarks (and handy for trying a distributed schedule on one
machine). Each rank runs in a fresh process with ``torch.distributed`` initialized (gloo on
127.0.0.1 by default) and ``threads`` intra-op threads (1 by default). The worker must be a module-level function (it is pickled by reference) and
return something picklable. Any failure - an exception in a rank, a rank dying, the whole run exceeding
``timeout`` - kills every rank and raises :class:`RanksFailed` (an AssertionError, so a test fails
with it) with the rank's traceback. Fault-injection tests pass ``allow_failures=True`` instead: a rank that
raises or dies does not stop the others, and its place in the result list holds a :class:`RankFailure`
(with its traceback or exit code), so a test can read what the surviving ranks saw.

With ``backend="nccl"`` rank r runs on GPU r: ``torch.cuda.set_device(r)`` before the process group is created
(and ``init_process_group(device_id=...)`` where torch has it); a rank without its own GPU fails, saying so.

Start method: "forkserver" by default. Its server process imports torch and the worker's module once per
pytest session, and every rank is then forked from it in milliseconds, instead of re-importing torch
(and the package under test) in every rank as "spawn" does (~3-7 s per run on 2 cores). It is as clean
as spawn (the server is a fresh interpreter that has only imported modules; it starts no threads) and
it exits with the parent. Pass ``start_method="spawn"`` to get one fully fresh interpreter per rank.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import forkserver
from typing import Any

__all__ = ["RankFailure", "RanksFailed", "free_port", "run_distributed"]

_GRACE_S = 1.0  # after a first failure, how long to collect the other ranks' reports
_STOP_S = 3.0  # how long a terminated rank may take to exit before it is killed
_PRELOAD = ["torch", "torch.distributed"]


class RanksFailed(AssertionError):
    """A rank raised, died or did not finish in time; the message holds the ranks' tracebacks."""


@dataclass(frozen=True)
class RankFailure:
    """What ``run_distributed(..., allow_failures=True)`` returns for a rank that did not return normally.

    ``message``: the rank's traceback (it raised), or why there is none ("exited without a report (exit
    code 1)", "did not finish within 30 s (killed)"). ``exitcode``: the process's exit code where known.
    """

    rank: int
    message: str
    exitcode: int | None = None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it: bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nccl_device(rank: int) -> dict[str, Any]:
    """Bind an NCCL rank to its GPU before its process group exists: ``torch.cuda.set_device(rank)`` (the ranks
    are local, so the local rank is the rank), and the ``device_id`` keyword of ``init_process_group`` where
    this torch has it (2.3+: the communicator is created eagerly, on that device). Without the binding every rank
    would put its NCCL communicator, and DDP its buffers, on GPU 0."""
    import inspect

    import torch
    import torch.distributed as dist

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if rank >= count:
        raise RuntimeError(f"backend='nccl' needs one CUDA device per rank: rank {rank}, but this machine has "
                           f"{count} visible CUDA device(s) (torch {torch.__version__}, CUDA {torch.version.cuda})")
    torch.cuda.set_device(rank)
    if "device_id" in inspect.signature(dist.init_process_group).parameters:
        return {"device_id": torch.device("cuda", rank)}
    return {}


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, port: int, backend: str, timeout: float,
               threads: int, args: tuple[Any, ...], kwargs: dict[str, Any], conn: mpc.Connection[Any, Any],
               final_barrier: bool = True) -> None:
    """Entry point of one rank: init, run ``fn``, report ("ok", result) or ("error", traceback).

    ``final_barrier=False`` (fault injection: a peer may be gone) skips the barrier before teardown."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    initialized = False
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        extra = _nccl_device(rank) if backend == "nccl" else {}
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout), **extra)
        initialized = True
        result = fn(rank, world_size, *args, **kwargs)
        if final_barrier:
            dist.barrier()  # nobody tears down (rank 0 hosts the store) while another rank still works
        # Plain pickle, by value: the connection's own pickler would hand tensors over as shared memory
        # owned by this process, which may be gone by the time the parent rebuilds them.
        report = pickle.dumps(("ok", result))
    except BaseException:  # noqa: B036 - report everything, even KeyboardInterrupt/SystemExit
        report = pickle.dumps(("error", traceback.format_exc()))
    try:
        # Report before tearing down: a failing rank's own traceback must reach the parent before the
        # secondary errors ("connection reset") that its teardown causes in the other ranks.
        conn.send_bytes(report)
    except OSError:  # the parent gave up on us; nothing else to do
        pass
    finally:
        conn.close()
    if initialized:
        dist.destroy_process_group()


def _context(start_method: str, fn: Callable[..., Any]) -> mp.context.BaseContext:
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        # The preload list is only read when the server starts (first use in this process).
        preload = list(_PRELOAD)
        if fn.__module__ not in ("__main__", "__mp_main__"):
            preload.append(fn.__module__)
        ctx.set_forkserver_preload(preload)
        # Python < 3.12 does not hand sys.path to the server, so a test module found through a path that
        # pytest inserted could not be preloaded; pass it through the environment of the server only.
        saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + ([saved] if saved else []))
        try:
            forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = saved
    return ctx


def _stop(procs: list[mp.process.BaseProcess], patience: float) -> None:
    """Let the ranks exit for ``patience`` seconds, then terminate, then kill them; reap them all."""
    deadline = time.monotonic() + patience
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + _STOP_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(_STOP_S)


def _collect(procs: list[mp.process.BaseProcess], pipes: list[mpc.Connection[Any, Any]], timeout: float,
             grace: bool = True) -> tuple[dict[int, Any], list[tuple[int, str]]]:
    """Read every rank's report until all reported, the timeout passes, or a failure's grace ends
    (``grace=False``: a failure does not shorten the wait for the other ranks)."""
    waiting = {pipe: rank for rank, pipe in enumerate(pipes)}
    results: dict[int, Any] = {}
    errors: list[tuple[int, str]] = []
    deadline = time.monotonic() + timeout
    while waiting:
        now = time.monotonic()
        if now >= deadline:
            break
        watch = list(waiting) + [procs[r].sentinel for r in waiting.values()]
        ready = set(mpc.wait(watch, timeout=deadline - now))
        for pipe, rank in list(waiting.items()):
            died = procs[rank].sentinel in ready
            if pipe not in ready and not (died and pipe.poll(0)):
                if died:  # gone without a word (killed, segfault, os._exit)
                    del waiting[pipe]
                    procs[rank].join(_STOP_S)
                    errors.append((rank, f"exited without a report (exit code {procs[rank].exitcode})"))
                continue
            del waiting[pipe]
            try:
                status, payload = pickle.loads(pipe.recv_bytes())
            except (EOFError, OSError):
                procs[rank].join(_STOP_S)
                status, payload = "error", f"exited without a report (exit code {procs[rank].exitcode})"
            if status == "ok":
                results[rank] = payload
            else:
                errors.append((rank, payload))
        if errors and grace:
            # The first report is usually the cause; let the others say their part briefly, then stop.
            deadline = min(deadline, time.monotonic() + _GRACE_S)
    return results, errors


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    timeout: float = 60,
    backend: str = "gloo",
    start_method: str = "forkserver",
    pg_timeout: float | None = None,
    threads: int = 1,
    allow_failures: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks; the results in rank order.

    ``timeout`` (seconds) bounds the whole run after the ranks started; ``pg_timeout`` (default: the
    same) is the process group's timeout, which bounds every collective inside the ranks. On failure
    every rank is killed and :class:`RanksFailed` carries the failing ranks' tracebacks.

    ``allow_failures=True`` (fault-injection tests): nothing raises for a rank's failure. Each rank runs
    until it returns, raises or dies, or ``timeout`` passes (then it is killed); the list holds each rank's
    result or a :class:`RankFailure`. The barrier that normally precedes teardown is skipped (a peer may
    be gone), and every process is still reaped before this returns.
    """
    if "<locals>" in getattr(fn, "__qualname__", "<locals>") or fn.__module__ in ("__main__", "__mp_main__"):
        raise ValueError(f"fn must be a module-level function of an importable module, got {fn!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context(start_method, fn)
    port = free_port()
    procs: list[mp.process.BaseProcess] = []
    pipes: list[mpc.Connection[Any, Any]] = []
    clean = False
    try:
        for rank in range(world_size):
            recv, send = ctx.Pipe(duplex=False)
            pipes.append(recv)
            # (typeshed declares Process on the concrete contexts only, not on the BaseContext get_context returns)
            p = ctx.Process(target=_rank_main, name=f"rank{rank}", daemon=True,  # type: ignore[attr-defined]
                            args=(fn, rank, world_size, port, backend, pg_timeout or timeout, threads, args,
                                  kwargs, send, not allow_failures))
            p.start()
            send.close()  # the rank holds the write end now
            procs.append(p)
        results, errors = _collect(procs, pipes, timeout, grace=not allow_failures)
        if allow_failures:
            failed = {r: RankFailure(r, tb, procs[r].exitcode) for r, tb in errors}
            for r in range(world_size):
                if r not in results and r not in failed:
                    failed[r] = RankFailure(r, f"did not finish within {timeout} s (killed)")
            # Every rank reported or died: let them tear down in peace; else kill them all at once below.
            clean = len(results) + len(errors) == world_size
            return [results[r] if r in results else failed[r] for r in range(world_size)]
        if errors:
            report = "\n".join(f"--- rank {r} failed:\n{tb}" for r, tb in errors)
            raise RanksFailed(f"{len(errors)} of {world_size} ranks failed in {fn.__qualname__}:\n{report}")
        missing = [r for r in range(world_size) if r not in results]
        if missing:
            raise RanksFailed(f"{fn.__qualname__} timed out after {timeout} s: ranks {missing} had not "
                                 "finished (killed)")
        clean = True
        return [results[r] for r in range(world_size)]
    finally:
        _stop(procs, patience=_STOP_S if clean else 0.0)
        for c in pipes:
            c.close()
