"""Run a function on N torch.distributed ranks (one process each), bounded, never leaving processes behind.

    results = run_ranks(worker, 2, cfg, timeout=900)   # worker(rank, world_size, cfg) on every rank

The approach of ``tests/dist_utils.py``, kept here so the benchmarks do not import the test suite:
every rank is a fresh process (forkserver: the server imports torch and the worker's module once, the
ranks are forked from it) with ``torch.distributed`` initialized (gloo on 127.0.0.1) and ``threads``
intra-op threads. The worker must be a module-level function of an importable module and return
something picklable. An exception in a rank, a rank dying or the run exceeding ``timeout`` kills every
rank and raises :class:`RanksFailed` carrying the failing ranks' tracebacks; the ranks are always
reaped (terminate, then kill) before this returns or raises, also on KeyboardInterrupt.
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
from multiprocessing import forkserver
from typing import Any

__all__ = ["RanksFailed", "free_port", "run_ranks"]

_GRACE_S = 2.0  # after a first failure, how long to collect the other ranks' reports
_STOP_S = 3.0  # how long a rank may take to exit before it is terminated / killed


class RanksFailed(RuntimeError):
    """A rank raised, died or did not finish in time; the message holds the tracebacks."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank, world_size, port, backend, pg_timeout, threads, args, conn) -> None:
    os.environ["OMP_NUM_THREADS"] = str(threads)
    initialized = False
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        initialized = True
        result = fn(rank, world_size, *args)
        dist.barrier()  # rank 0 hosts the store: nobody tears down while another rank still works
        report = pickle.dumps(("ok", result))
    except BaseException:  # noqa: B036 - report everything, KeyboardInterrupt included
        report = pickle.dumps(("error", traceback.format_exc()))
    try:
        conn.send_bytes(report)  # before teardown: the cause must arrive before the peers' secondary errors
    except OSError:
        pass
    finally:
        conn.close()
    if initialized:
        dist.destroy_process_group()


def _context(fn: Callable[..., Any], start_method: str) -> mp.context.BaseContext:
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch.distributed", fn.__module__])
        # Python < 3.12 does not hand sys.path to the server: pass it through the server's environment only.
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


def _stop(procs: list, patience: float) -> None:
    """Join for ``patience`` seconds, then terminate, then kill; every rank is reaped."""
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


def _collect(procs, pipes, timeout: float) -> tuple[dict[int, Any], list[tuple[int, str]]]:
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
                if died:
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
        if errors:
            deadline = min(deadline, time.monotonic() + _GRACE_S)
    return results, errors


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 900.0,
    pg_timeout: float = 300.0,
    threads: int = 1,
    backend: str = "gloo",
    start_method: str = "forkserver",
) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` ranks; the results in rank order.

    ``timeout`` bounds the whole run (seconds after the ranks started); ``pg_timeout`` is the process
    group's timeout, which bounds every collective (and so every barrier) inside the ranks.
    """
    if "<locals>" in getattr(fn, "__qualname__", "<locals>") or fn.__module__ in ("__main__", "__mp_main__"):
        raise ValueError(f"fn must be a module-level function of an importable module, got {fn!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context(fn, start_method)
    port = free_port()
    procs: list = []
    pipes: list = []
    clean = False
    try:
        for rank in range(world_size):
            recv, send = ctx.Pipe(duplex=False)
            pipes.append(recv)
            p = ctx.Process(
                target=_rank_main,
                name=f"rank{rank}",
                daemon=True,
                args=(fn, rank, world_size, port, backend, pg_timeout, threads, args, send),
            )
            p.start()
            send.close()
            procs.append(p)
        results, errors = _collect(procs, pipes, timeout)
        if errors:
            report = "\n".join(f"--- rank {r} failed:\n{tb}" for r, tb in errors)
            raise RanksFailed(f"{len(errors)} of {world_size} ranks failed in {fn.__qualname__}:\n{report}")
        missing = [r for r in range(world_size) if r not in results]
        if missing:
            raise RanksFailed(
                f"{fn.__qualname__} timed out after {timeout:.0f} s: ranks {missing} had not "
                "finished (killed)"
            )
        clean = True
        return [results[r] for r in range(world_size)]
    finally:
        _stop(procs, patience=_STOP_S if clean else 0.0)
        for c in pipes:
            c.close()
