"""Count the host synchronisations of lightning_spdkfac per optimizer step (issue 34, "sync budget").

Usage::

    with SyncAudit() as audit:                # patches torch; everything is restored on exit
        pre = KFACPreconditioner(model, ...)  # build it inside: its hooks are wrapped with the in-hook flag
        for step in range(steps):
            audit.step = step                 # the optimizer step the next events belong to
            ...forward, backward, pre.step(opt), opt.step()
    audit.summary(steps)                      # reads per step, inside hooks, max per step, collectives
    audit.reads(in_hook=True)                 # the events themselves (:class:`Read`)

While active, these are recorded as host reads (:class:`Read`) when the nearest calling frame outside torch,
the standard library and this file lies under one of ``roots`` (default: the lightning_spdkfac package), so
that a test's own ``loss.item()`` is not counted (it only adds to :attr:`SyncAudit.ignored`):

- ``Tensor.item / tolist / numpy / cpu`` and ``bool() / float() / int() / operator.index()`` of a tensor:
  on a GPU each is a device-to-host copy that blocks the host until the stream is done;
- ``torch.equal / torch.allclose / Tensor.equal / Tensor.allclose / torch.nonzero / Tensor.nonzero``
  (a Python result, or an output sized by the data);
- ``torch.tensor / torch.as_tensor`` with an explicit ``device=``: on a GPU a blocking host-to-device copy
  (on the CPU the call itself is counted, whatever the device);
- a *host tensor* (made by ``torch.tensor / as_tensor / frombuffer / from_numpy`` without a device) copied
  with ``dst.copy_(host)`` or moved with ``host.to(<device>)``: on a GPU a host-to-device copy from pageable
  memory, which synchronises the stream (kind ``copy_(host tensor)`` / ``to(host tensor)``);
- ``tensor[index] = <Python number>`` (``Tensor.__setitem__`` with an int, float or bool value): the number
  becomes a host tensor copied into the device tensor, a blocking copy on a GPU (seen by the GPU check on an H200:
  ``A[..., n, n] = 1.0`` synchronised once per layer and factor step; ``.fill_(1.0)`` on the view is a kernel);
- ``torch.linalg.eigh / eigvalsh / cholesky / inv`` (not the ``_ex`` variants): on a GPU they check the
  LAPACK info on the host (a sync) before returning;
- ``Work.wait(timeout=...)`` (``torch.distributed.Work``): with a timeout, NCCL's work busy-waits on the
  host for the kernel instead of only ordering the current stream.

Every collective of ``torch.distributed`` called from Python (all_reduce, reduce, broadcast, all_gather,
all_gather_into_tensor, reduce_scatter(_tensor), all_to_all(_single), gather, scatter, barrier,
send/recv/isend/irecv, batch_isend_irecv, the object collectives and DDP's ``_broadcast_coalesced``),
whoever calls it, is recorded as a :class:`Collective` with its thread; one issued from a thread other than
``training_threads`` (default: the thread that entered the audit; on the CPU autograd runs the backward
on that thread too; on a GPU autograd runs it on its own C++ device threads, which Python sees as dummy
threads: a collective from one of them inside a K-FAC hook is allowed as well) is a violation (:meth:`SyncAudit.off_thread_collectives`): NCCL forbids issuing on
communicators of one device from several threads.

"Inside a hook": hooks registered from ``roots`` while the audit is active (``nn.Module``'s forward,
forward-pre, full-backward and full-backward-pre hooks, ``Tensor.register_hook``,
``torch.autograd.graph.register_multi_grad_hook``) are wrapped so that a thread-local flag is set while
they run; a read then has ``in_hook=True``. Build the preconditioner inside the audit; a wrapped hook keeps
working (and only sets its flag) after the audit ends.

Limits: a host tensor is recognised only as made by those functions (not, e.g., ``torch.zeros(n)`` filled on
the host); reads made in C++ (DDP's reducer, an autograd kernel) are not seen.
One audit at a time per process.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Collective", "Read", "SyncAudit", "package_root"]


def package_root() -> str:
    """The directory of the lightning_spdkfac package this process imports."""
    import lightning_spdkfac

    return os.path.dirname(os.path.abspath(lightning_spdkfac.__file__))


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_THIS_FILE = os.path.abspath(__file__)
_STDLIB = tuple({os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib")})
_SITE = tuple({os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("purelib", "platlib")})

# Host reads by method of torch.Tensor (kind = the name).
TENSOR_READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__",
                "equal", "allclose", "nonzero")
# Host reads by function of torch (kind = "torch.<name>").
TORCH_READS = ("equal", "allclose", "nonzero")
LINALG_READS = ("eigh", "eigvalsh", "cholesky", "inv")
# Blocking host-to-device copies when given a device.
DEVICE_COPIES = ("tensor", "as_tensor")
# Makers of host tensors (when given no device): a later copy_/to(device) of one is a host-to-device copy.
HOST_MAKERS = ("tensor", "as_tensor", "frombuffer", "from_numpy")
_HOST_MARK = "_sync_audit_host"
COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier",
               "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv", "all_gather_object",
               "broadcast_object_list", "gather_object", "scatter_object_list", "_broadcast_coalesced")
MODULE_HOOKS = ("register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
                "register_full_backward_pre_hook")


@dataclass(frozen=True)
class Read:
    """One host read: what, where (``file:line`` of the package's calling frame), on which thread, inside a
    K-FAC hook or not, at which optimizer step (-1: before the first)."""

    kind: str
    where: str
    function: str
    via: str  # the next frame up in roots (file:line) from another function: who called ``where``
    thread: str
    training_thread: bool
    in_hook: bool
    step: int


@dataclass(frozen=True)
class Collective:
    """One collective call: its name, its caller (``file:line``, first frame outside torch), the thread,
    whether that is a training thread, inside a hook or not, the step, and whether the caller is in ``roots``."""

    op: str
    where: str
    thread: str
    training_thread: bool
    in_hook: bool
    step: int
    from_package: bool


_ACTIVE_LOCK = threading.Lock()
_ACTIVE: list[SyncAudit] = []  # the active audit (at most one)


def _active() -> SyncAudit | None:
    return _ACTIVE[0] if _ACTIVE else None


class _Local(threading.local):
    hook_depth = 0
    collective_depth = 0
    busy = False  # inside the harness's own bookkeeping (no recording of its own reads)


_LOCAL = _Local()


def _outside(filename: str) -> bool:
    path = os.path.abspath(filename)
    if path == _THIS_FILE or path.startswith(_TORCH_DIR):
        return False
    if path.startswith(_STDLIB) and not path.startswith(_SITE):
        return False
    return not filename.startswith("<frozen")


def _caller_frame(depth: int = 2) -> Any:
    """The nearest frame outside torch, the standard library and this file (None: none)."""
    frame = sys._getframe(depth)
    while frame is not None and not _outside(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def _caller(depth: int = 2) -> tuple[str, int, str]:
    """The nearest frame outside torch, the standard library and this file: (file, line, function)."""
    frame = _caller_frame(depth + 1)
    if frame is None:
        return "<unknown>", 0, "<unknown>"
    return os.path.abspath(frame.f_code.co_filename), frame.f_lineno, frame.f_code.co_name


class SyncAudit:
    """A recorder of host reads and collectives; see the module docstring.

    ``roots``: directories (or files) whose calls count (default: the lightning_spdkfac package).
    ``training_threads``: thread idents allowed to issue collectives (default: the thread entering).
    """

    def __init__(self, roots: Iterable[str] | None = None, training_threads: Iterable[int] | None = None,
                 as_nccl: bool = True) -> None:
        # as_nccl: the package's waits take the path they take on NCCL (stream-ordered ``Work.wait()``, no host
        # wait): on gloo a wait without a timeout still ends (bounded by the group's own timeout), so the run is the
        # same and the count says what a GPU run would do. False: gloo's timed host waits, counted as reads.
        self.as_nccl = as_nccl
        self.roots = tuple(os.path.abspath(r) for r in (roots if roots is not None else (package_root(),)))
        self._training = set(training_threads or ())
        self.step = -1
        self.events: list[Read] = []
        self.collectives: list[Collective] = []
        self.ignored = 0  # reads seen from callers outside roots (test code): not counted
        self.hooks_wrapped = 0  # hooks registered from roots while active (wrapped with the in-hook flag)
        self.hook_calls = 0  # calls of those hooks while active
        self._lock = threading.Lock()
        self._saved: list[tuple[Any, str, bool, Any]] = []  # (owner, name, had own attribute, original)

    # ------------------------------------------------------------------ recording

    def _in_roots(self, path: str) -> bool:
        return any(path == r or path.startswith(r + os.sep) for r in self.roots)

    def _record_read(self, kind: str) -> None:
        if _LOCAL.busy:
            return
        _LOCAL.busy = True
        try:
            frame = _caller_frame(3)
            path = os.path.abspath(frame.f_code.co_filename) if frame is not None else "<unknown>"
            if not self._in_roots(path):
                with self._lock:
                    self.ignored += 1
                return
            t = threading.current_thread()
            event = Read(kind, f"{self._short(path)}:{frame.f_lineno}", frame.f_code.co_name, self._via(frame),
                         t.name, t.ident in self._training, _LOCAL.hook_depth > 0, self.step)
            with self._lock:
                self.events.append(event)
        finally:
            _LOCAL.busy = False

    def _record_collective(self, op: str) -> None:
        path, line, _ = _caller(3)
        t = threading.current_thread()
        in_hook = _LOCAL.hook_depth > 0
        # (threading._DummyThread: a thread Python did not start, such as autograd's device threads on a GPU)
        allowed = t.ident in self._training or (in_hook and isinstance(t, threading._DummyThread))
        event = Collective(op, f"{self._short(path)}:{line}", t.name, allowed, in_hook, self.step,
                           self._in_roots(path))
        with self._lock:
            self.collectives.append(event)

    def _via(self, frame: Any) -> str:
        code = frame.f_code
        up = frame.f_back
        while up is not None:
            path = os.path.abspath(up.f_code.co_filename)
            if up.f_code is not code and self._in_roots(path):
                return f"{self._short(path)}:{up.f_lineno}"
            up = up.f_back
        return ""

    def _short(self, path: str) -> str:
        for r in self.roots:
            base = os.path.dirname(r)
            if path.startswith(base + os.sep):
                return os.path.relpath(path, base)
        return path

    # ------------------------------------------------------------------ patching

    def _patch(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        if not hasattr(owner, name):
            return
        own = name in vars(owner)
        original = vars(owner)[name] if own else getattr(owner, name)
        self._saved.append((owner, name, own, original))
        setattr(owner, name, make(getattr(owner, name)))

    def _install(self) -> None:
        if self.as_nccl:
            import importlib

            for mod in ("faults", "executor", "consistency", "auto", "dpkfac", "scheduler"):
                module = importlib.import_module(f"lightning_spdkfac.comm.{mod}")
                self._patch(module, "stream_ordered", lambda _original: (lambda *a, **k: True))
        for name in TENSOR_READS:
            self._patch(torch.Tensor, name, functools.partial(_reading, kind=name))
        for name in TORCH_READS:
            self._patch(torch, name, functools.partial(_reading, kind=f"torch.{name}"))
        for name in LINALG_READS:
            self._patch(torch.linalg, name, functools.partial(_reading, kind=f"linalg.{name}"))
        for name in HOST_MAKERS:
            self._patch(torch, name, functools.partial(_device_copy, kind=f"torch.{name}(device=)"))
        self._patch(torch.Tensor, "copy_", _host_copy)
        self._patch(torch.Tensor, "__setitem__", _scalar_setitem)
        self._patch(torch.Tensor, "to", _host_to)
        self._patch(dist.Work, "wait", _timed_wait)
        from torch.distributed import distributed_c10d as c10d

        for owner in (dist, c10d):
            for name in COLLECTIVES:
                self._patch(owner, name, functools.partial(_collective, op=name))
        for name in MODULE_HOOKS:
            self._patch(nn.Module, name, _hook_registrar)
        self._patch(torch.Tensor, "register_hook", _hook_registrar)
        import torch.autograd.graph as graph

        self._patch(graph, "register_multi_grad_hook", _multi_grad_registrar)

    def _uninstall(self) -> None:
        for owner, name, own, original in reversed(self._saved):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
        self._saved.clear()

    def __enter__(self) -> SyncAudit:
        with _ACTIVE_LOCK:
            if _ACTIVE:
                raise RuntimeError("another SyncAudit is active in this process")
            if not self._training:
                self._training.add(threading.get_ident())
            self._install()
            _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        with _ACTIVE_LOCK:
            _ACTIVE.remove(self)
            self._uninstall()

    def add_training_thread(self, ident: int | None = None) -> None:
        """Allow collectives from thread ``ident`` (default: the calling thread)."""
        self._training.add(ident if ident is not None else threading.get_ident())

    # ------------------------------------------------------------------ results

    def reads(self, *, in_hook: bool | None = None, step: int | None = None,
              min_step: int | None = None) -> list[Read]:
        """The counted reads, optionally only those inside (True) / outside (False) hooks, or of one step,
        or from step ``min_step`` on."""
        return [e for e in self.events
                if (in_hook is None or e.in_hook == in_hook) and (step is None or e.step == step)
                and (min_step is None or e.step >= min_step)]

    def per_step(self, steps: int, *, training_only: bool = False) -> list[int]:
        """Counted reads of each step 0 .. steps-1 (reads before step 0, at set-up, are left out); with
        ``training_only``, those of the training threads only (not an inverse worker's)."""
        counts = Counter(e.step for e in self.events if e.training_thread or not training_only)
        return [counts.get(s, 0) for s in range(steps)]

    def off_thread_collectives(self) -> list[Collective]:
        """The collectives issued from a thread other than the training threads."""
        return [c for c in self.collectives if not c.training_thread]

    def top(self, n: int = 10, *, in_hook: bool | None = None) -> list[tuple[str, str, str, str, bool, int]]:
        """The ``n`` most frequent (where, via, kind, thread, in_hook) among the counted reads, with their counts."""
        counts = Counter((e.where, e.via, e.kind, e.thread, e.in_hook) for e in self.reads(in_hook=in_hook))
        return [(*key, c) for key, c in counts.most_common(n)]

    def summary(self, steps: int) -> dict[str, Any]:
        """Picklable figures of a run of ``steps`` optimizer steps (reads at set-up, step -1, excluded)."""
        per = self.per_step(steps)
        counted = [e for e in self.events if 0 <= e.step < steps]
        off = self.off_thread_collectives()
        return dict(
            steps=steps,
            reads=len(counted),
            reads_per_step=len(counted) / steps if steps else 0.0,
            in_hook=sum(e.in_hook for e in counted),
            outside_hooks=sum(not e.in_hook for e in counted),
            max_per_step=max(per, default=0),
            worst_step=per.index(max(per)) if per else None,
            per_step=per,
            max_per_step_training=max(self.per_step(steps, training_only=True), default=0),
            # torch.linalg.eigh checks its LAPACK info on the host on a GPU and has no _ex variant: the eigen
            # method's unavoidable syncs, one per batched call, counted apart from the package's own reads.
            max_per_step_training_without_eigh=max(
                (Counter(e.step for e in counted if e.training_thread and e.kind != "linalg.eigh").get(s, 0)
                 for s in range(steps)), default=0),
            setup_reads=sum(e.step < 0 for e in self.events),
            off_training_thread_reads=sum(not e.training_thread for e in counted),
            by_kind=dict(Counter(e.kind for e in counted).most_common()),
            top=self.top(12),
            top_in_hook=self.top(8, in_hook=True),
            collectives=len(self.collectives),
            collectives_by_thread=dict(Counter(c.thread for c in self.collectives)),
            off_thread_collectives=len(off),
            off_thread_top=Counter((c.op, c.where, c.thread) for c in off).most_common(8),
            ignored=self.ignored,
            hooks_wrapped=self.hooks_wrapped,
            hook_calls=self.hook_calls,
        )


# ---------------------------------------------------------------------- the wrappers (module level: picklable)


def _reading(original: Callable[..., Any], kind: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def read(*args: Any, **kwargs: Any) -> Any:
        audit = _active()
        if audit is not None:
            audit._record_read(kind)
        return original(*args, **kwargs)

    return read


def _device_copy(original: Callable[..., Any], kind: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def copy(*args: Any, **kwargs: Any) -> Any:
        audit = _active()
        device = kwargs.get("device")
        if device is None and original.__name__ == "as_tensor" and len(args) > 2:
            device = args[2]
        if audit is not None and device is not None:
            audit._record_read(kind)
        out = original(*args, **kwargs)
        if audit is not None and device is None and isinstance(out, torch.Tensor):
            try:
                setattr(out, _HOST_MARK, True)
            except (AttributeError, RuntimeError):
                pass
        return out

    return copy


def _is_host(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, _HOST_MARK, False) is True


def _host_copy(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def copy_(self: Any, src: Any, *args: Any, **kwargs: Any) -> Any:
        audit = _active()
        if audit is not None and _is_host(src) and not _is_host(self):
            audit._record_read("copy_(host tensor)")
        return original(self, src, *args, **kwargs)

    return copy_


def _scalar_setitem(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def setitem(self: Any, index: Any, value: Any) -> Any:
        audit = _active()
        if audit is not None and isinstance(value, (bool, int, float)):
            audit._record_read("__setitem__(Python number)")
        return original(self, index, value)

    return setitem


def _to_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` names a device (a device, a string, an index or a tensor)."""
    if kwargs.get("device") is not None:
        return True
    return bool(args) and isinstance(args[0], (torch.device, str, int, torch.Tensor))


def _host_to(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def to(self: Any, *args: Any, **kwargs: Any) -> Any:
        audit = _active()
        if audit is not None and _is_host(self) and _to_device(args, kwargs):
            audit._record_read("to(host tensor)")
        return original(self, *args, **kwargs)

    return to


def _timed_wait(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        audit = _active()
        if audit is not None and (args or kwargs.get("timeout") is not None):
            audit._record_read("Work.wait(timeout)")
        return original(self, *args, **kwargs)

    return wait


def _collective(original: Callable[..., Any], op: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        audit = _active()
        if audit is None or _LOCAL.collective_depth:  # (one nested in another, e.g. broadcast_object_list's)
            return original(*args, **kwargs)
        audit._record_collective(op)
        _LOCAL.collective_depth += 1
        try:
            return original(*args, **kwargs)
        finally:
            _LOCAL.collective_depth -= 1

    return collective


def _flagged(hook: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(hook)
    def in_hook(*args: Any, **kwargs: Any) -> Any:
        audit = _active()
        if audit is not None:
            with audit._lock:
                audit.hook_calls += 1
        _LOCAL.hook_depth += 1
        try:
            return hook(*args, **kwargs)
        finally:
            _LOCAL.hook_depth -= 1

    return in_hook


def _wrap_if_ours(hook: Callable[..., Any]) -> Callable[..., Any]:
    audit = _active()
    if audit is None:
        return hook
    path, _, _ = _caller(4)
    if not audit._in_roots(path):
        return hook
    with audit._lock:
        audit.hooks_wrapped += 1
    return _flagged(hook)


def _hook_registrar(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def register(self: Any, hook: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return original(self, _wrap_if_ours(hook), *args, **kwargs)

    return register


def _multi_grad_registrar(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def register(tensors: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return original(tensors, _wrap_if_ours(fn), *args, **kwargs)

    return register
