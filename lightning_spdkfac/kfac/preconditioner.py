"""KFACPreconditioner: the single-process K-FAC state machine.

Usage (plain PyTorch)::

    pre = KFACPreconditioner(model)
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        pre.step(opt)       # rewrites .grad of the layers opt steps, in place
        opt.step()

One optimizer step is: hooks collect factor statistics during forward/backward (on factor steps)
-> ``step()`` turns them into this step's factors, checks they and the gradients are finite,
updates the running averages -> (on inverse steps) damped inverses -> preconditioned gradients
-> KL clip -> written back to ``.grad``. The math is in docs/math.md.

The preconditioner is composed of parts, each owning its state, built here and given what they share (kfac/core.py):
:class:`~.registration.LayerRegistry` (which layers, their hooks), :class:`~.factor_updates.FactorStatistics` (the
hooks' statistics -> running factors), :class:`~.inverse_steps.Inverter` (inverses, async_inverses),
:class:`~.preconditioning.Preconditioning` (P, KL clip, write-back), :class:`~.coverage.Coverage` (what is left out),
:class:`~.guard.NonFiniteGuard` (non-finite values) and :class:`~.checkpoint.CheckpointState` (state_dict /
load_state_dict). This module holds their assembly and ``step()``; docs/concepts/how-it-is-built.md draws it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar, cast, overload

import torch
from torch import nn

from .. import validation as val
from ..factor_shapes import describe
from . import auto_damping
from .checkpoint import STATE_VERSION, CheckpointState
from .core import Core
from .coverage import Coverage
from .distributor import Distributor, DistributorContext, owner_held
from .factor_updates import FactorStatistics
from .gradients import GradAccess
from .guard import NonFiniteGuard
from .inverse_steps import Inverter
from .layer_state import KFACLayer
from .options import KFACOptions
from .preconditioning import Preconditioning
from .registration import LayerRegistry
from .sharded import OwnerShardedAccess, fsdp2_setup, lean_access, precondition_owned
from .step_size import LossParts, QuadraticStepSize
from .summary import KFACSummary, format_bytes, summarize

__all__ = ["STATE_VERSION", "KFACLayer", "KFACPreconditioner"]

T = TypeVar("T")


class _Part(Generic[T]):
    """An attribute of the preconditioner that is a part's own (``guard.skipped_factor_steps``): read and set there."""

    def __init__(self, part: str) -> None:
        self.part = part

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> _Part[T]: ...

    @overload
    def __get__(self, obj: object, objtype: type | None = None) -> T: ...

    def __get__(self, obj: object, objtype: type | None = None) -> _Part[T] | T:
        return self if obj is None else cast(T, getattr(getattr(obj, self.part), self.name))

    def __set__(self, obj: object, value: T) -> None:
        setattr(getattr(obj, self.part), self.name, value)


class KFACPreconditioner:
    """K-FAC for the ``nn.Linear``, ``nn.Conv1d/2d/3d``, ``nn.Embedding`` and ``nn.MultiheadAttention`` layers of a
    model (docs/math.md, "Layers and rows"), usable with any optimizer.

    Args:
        model: the module whose supported layers get K-FAC.
        options: the K-FAC hyperparameters (:class:`~lightning_spdkfac.kfac.options.KFACOptions`:
            damping, factor_decay, kl_clip, lr, factor_update_steps, inv_update_steps, skip_layers,
            factor_dtype, inv_dtype, max_bad_steps, factor_approx, inverse_method); None: the defaults.
        grad_scaler: a ``torch.amp.GradScaler`` in use (fp16): G factors are unscaled with its scale.
            Call ``scaler.unscale_(optimizer)`` before :meth:`step`.
        distributor: where the cross-rank work runs (factor averaging, inverse placement); the
            default is one process. See :mod:`lightning_spdkfac.kfac.distributor`.
        grad_access: where the reduced gradients are read and written; the default is
            ``param.grad`` in place. See :mod:`lightning_spdkfac.kfac.gradients`.
        optimizer: the optimizer that will step, to resolve ``damping="auto"`` (the default) now; without it, the
            first :meth:`step` resolves it from the optimizer passed there (:mod:`~lightning_spdkfac.kfac.auto_damping`).
        **overrides: any ``KFACOptions`` field by name, applied on top of ``options``
            (``KFACPreconditioner(model, damping=1e-2)``).

    Non-finite values: a step with non-finite activations, output gradients, received factors or
    gradients skips the factor update (the running factors keep their last good value) and, where
    the gradients are non-finite, preconditioning (the optimizer's own overflow handling then sees
    them as they are); ``skipped_factor_steps`` and ``skipped_precondition_steps`` count them. After
    ``max_bad_steps`` such factor steps in a row, :meth:`step` raises a RuntimeError naming the layers
    and what was non-finite. The default, 100, leaves room for a dynamic fp16 loss scaler
    (GradScaler, DeepSpeed), which halves its scale on each overflow step and so recovers within
    about 25 consecutive ones even from 2^24, while stopping a run whose factors or loss went
    non-finite for good before it wastes an epoch.
    """

    def __init__(
        self,
        model: nn.Module,
        options: KFACOptions | None = None,
        *,
        grad_scaler: torch.amp.GradScaler | None = None,
        distributor: Distributor | None = None,
        grad_access: GradAccess | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **overrides: Any,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {val.show(model)}")
        o = KFACOptions.build(options, **overrides)
        # FSDP2 hook: a fully_shard model gets FSDP2GradAccess and the owner-based schedule (kfac/sharded.py)
        distributor, grad_access = fsdp2_setup(model, distributor, grad_access)
        self.core = core = Core.from_options(model, o, Distributor() if distributor is None else distributor,
                                             GradAccess() if grad_access is None else grad_access)
        # The parts, each owning its state; what they share is ``core``.
        self.guard = NonFiniteGuard(model, o.max_bad_steps)
        self.statistics = FactorStatistics(core, self.guard, grad_scaler)
        self.preconditioning = Preconditioning(core)
        self.inverter = Inverter(core, self.preconditioning.precondition_layer)
        self.registry = LayerRegistry(core, self.statistics.capture, self.statistics.forward_hook, self._layers_added)
        self.coverage = Coverage(core, self.statistics.capture, self.registry.hooked,
                                 lambda: self.preconditioning.stepping)
        self.registry.register(model)
        self.registry.split_params()
        context = DistributorContext(inv_dtype=core.inv_dtype, inverse_method=o.inverse_method,
                                     async_inverses=o.async_inverses, inv_update_steps=core.inv_update_steps,
                                     settings=self.settings_text(), timer=core.timer)
        core.distributor.setup([(ly.a_shape, ly.g_shape) for ly in core.layers.values()], context)
        core.owner_held = owner_held(core.distributor)
        core.owners = core.distributor.layer_owners
        # FSDP2 hook: rows gathered to each layer's owner and scattered back where that applies (kfac/sharded.py)
        core.grad_access = lean_access(list(core.layers.values()), core.owners, core.grad_access, o, core.distributor)
        self._check_memory()
        if o.capture == "auto":  # the first factor step follows every layer, to find weights functions also use
            self.capture.probe([ly for ly in core.layers.values() if not ly.helper.capture_only], self.registry.hooked)
        # step_size="quadratic"/"quadratic_momentum": the optimizer's update rescaled after its step (kfac/step_size.py).
        self.step_size: QuadraticStepSize | None = None
        if o.step_size is not None or o.adapt_damping:
            what = f"step_size={o.step_size!r}" if o.step_size is not None else "adapt_damping=True"
            if type(core.grad_access) is not GradAccess:
                raise ValueError(
                    f"{what} is not supported under SPDKFACDeepSpeedStrategy: ZeRO steps its own partitioned fp32 copy "
                    "of the parameters, which the rule's rescaled update and measurement would not reach; use "
                    "SPDKFACStrategy (DDP), one process, or step_size=None, adapt_damping=False")
            self.step_size = QuadraticStepSize(o.step_size, o.step_size_every, o.step_size_clip,
                                               o.step_size_damping, o.adapt_damping, self._set_damping)
        self.checkpoint = CheckpointState(core, self.registry, self.statistics, self.inverter, self.preconditioning,
                                          self.guard, self.step_size)
        # damping="auto": what it resolved to and why (None until resolved; kfac/auto_damping.py)
        self.damping_choice: str | None = None
        if optimizer is not None:
            self.choose_damping(optimizer)
        core.distributor.begin_step(core.steps)

    # What users, the callback and the summary read (and some set) on the preconditioner: each is a part's own.
    options = _Part[KFACOptions]("core")
    model = _Part[nn.Module]("core")
    layers = _Part[dict[str, KFACLayer]]("core")
    distributor = _Part[Distributor]("core")
    grad_access = _Part[GradAccess]("core")
    timer = _Part[Any]("core")  # Per-phase seconds of the last step in ``timer.last`` (lightning_spdkfac.telemetry).
    damping = _Part[val.HParam]("core")
    factor_decay = _Part[val.HParam]("core")
    kl_clip = _Part[val.HParam | None]("core")
    lr = _Part[val.HParam | None]("core")
    factor_update_steps = _Part[int]("core")
    inv_update_steps = _Part[int]("core")
    factor_dtype = _Part[torch.dtype]("core")
    inv_dtype = _Part[torch.dtype]("core")
    steps = _Part[int]("core")  # optimizer steps taken (calls of step())
    paused = _Part[bool]("core")
    unfactored = _Part[dict[str, str]]("core")
    final_micro_batch = _Part[bool]("statistics")
    grad_scaler = _Part[torch.amp.GradScaler | None]("statistics")
    capture = _Part[Any]("statistics")
    skipped = _Part[dict[str, str]]("registry")
    frozen_layers = _Part[dict[str, Any]]("registry")
    inverse_fallbacks = _Part[int]("inverter")
    last_step_inverted = _Part[bool]("inverter")
    skipped_precondition_steps = _Part[int]("preconditioning")
    max_bad_steps = _Part[int | None]("guard")
    skipped_factor_steps = _Part[int]("guard")
    consecutive_bad_steps = _Part[int]("guard")
    last_bad_step = _Part[dict[str, Any] | None]("guard")

    @property
    def inverse_method(self) -> str:
        return self.core.options.inverse_method

    @property
    def factor_approx(self) -> str:
        return self.core.options.factor_approx

    @property
    def collecting(self) -> bool:
        """Whether the hooks collect factor statistics for the coming step."""
        return self.core.collecting

    def state_dict(self) -> dict[str, Any]:
        return self.checkpoint.state_dict()

    state_dict.__doc__ = CheckpointState.state_dict.__doc__

    def load_state_dict(self, state: Any) -> None:
        self.checkpoint.load_state_dict(state)

    load_state_dict.__doc__ = CheckpointState.load_state_dict.__doc__

    def check_state_dict(self, state: Any) -> None:
        """Raise the ValueError :meth:`load_state_dict` would raise for ``state``; change nothing."""
        self.checkpoint.check_state_dict(state)

    def summary(self) -> KFACSummary:
        """What K-FAC preconditions and what it leaves to the optimizer, with the layout and the bytes of every
        block (``print(pre.summary())`` shows the table; :mod:`lightning_spdkfac.kfac.summary`)."""
        return summarize(self)

    def state_bytes(self) -> int:
        """Bytes of K-FAC state this rank holds now: running factors and inverses (eigen payloads) of its layers
        (every layer, except under ``schedule="dpkfac"``, where only the layers this rank owns)."""
        return sum(t.numel() * t.element_size() for ly in self.layers.values()
                   for t in (ly.A, ly.G, ly.A_inv, ly.G_inv) if t is not None)

    def settings_text(self) -> str:
        """The settings every rank of one run must share, as text: the options (a schedule by its name), the
        loss scaler's presence and the registered layers (name, sides, reduce).
        Distributed schedules compare it across ranks at every plan (comm/consistency.py)."""

        def show(value: Any) -> str:
            if callable(value):
                name = getattr(value, "__qualname__", type(value).__name__)
                return f"schedule {getattr(value, '__module__', '?')}.{name}"  # (not called: it may count calls)
            return repr(value)

        o = self.options
        fields = {
            "damping": show(o.damping), "factor_decay": show(o.factor_decay), "kl_clip": show(o.kl_clip),
            "lr": show(o.lr) if o.lr is not None else "the optimizer's", "factor_update_steps": o.factor_update_steps,
            "inv_update_steps": o.inv_update_steps, "factor_dtype": o.factor_dtype, "inv_dtype": o.inv_dtype,
            "max_bad_steps": o.max_bad_steps, "factor_approx": o.factor_approx, "inverse_method": o.inverse_method,
            "async_inverses": o.async_inverses, "grafting": o.grafting, "grad_scaler": self.grad_scaler is not None,
        }
        layers = [f"{ly.name}({describe(ly.a_shape)};{describe(ly.g_shape)}{', reduce' if ly.reduce else ''})"
                  for ly in self.layers.values()]
        return ", ".join(f"{k}={v}" for k, v in fields.items()) + "; layers: " + " ".join(layers)

    def remove_hooks(self) -> None:
        """Detach all hooks from the model (the preconditioner is unusable afterwards).

        Asynchronous inversions still in flight are waited for and dropped (what :meth:`state_dict` returned
        before this call is unaffected), and the distributor releases what it holds."""
        self.inverter.settle(keep=False)
        self.distributor.close()
        for layer in self.layers.values():
            for h in layer.handles:
                h.remove()
            layer.handles.clear()
        self.registry.remove_hooks()
        self.capture.remove()
        if getattr(self, "step_size", None) is not None:
            self.step_size.remove_hooks()  # type: ignore[union-attr]

    def _layers_added(self) -> None:
        """Layers frozen at setup were registered (they train now): the optimizer's groups are rebuilt with them, and
        the memory is checked again."""
        self.preconditioning.step_groups.clear()
        self._check_memory()

    def _check_memory(self) -> None:
        """Stop at setup, before any factor is allocated, when the peak K-FAC memory of an inverse step (the
        steady state and the step's workspace, kfac/summary.py) would exceed ``memory_limit``."""
        limit = self.options.memory_limit
        if limit is None:
            return
        s = self.summary()
        if s.peak_bytes > int(limit):
            w = s.workspace
            raise MemoryError(
                f"K-FAC would need {format_bytes(s.peak_bytes)} on this rank at the peak of an inverse step "
                f"({format_bytes(s.steady_bytes)} held between steps, plus {format_bytes(s.peak_bytes - s.steady_bytes)}"
                f" of workspace: inversions {format_bytes(w.inverses)}, preconditioning "
                f"{format_bytes(w.precondition)}), above memory_limit={format_bytes(int(limit))}; nothing was "
                "allocated. Raise memory_limit, lower max_factor_side (larger sides are then kept diagonal, and "
                "the largest factor sets the inversion's workspace), skip the largest layers with skip_layers, or "
                "use schedule='dpkfac' (each rank holds its own layers only). The K-FAC summary:\n" + str(s))

    def _prepare_step_size(self, optimizer: torch.optim.Optimizer | None, loss_parts: LossParts | None) -> None:
        assert self.step_size is not None
        if optimizer is None:
            raise ValueError(f"step_size={self.step_size.mode!r} / adapt_damping={self.step_size.adapt_damping} work on "
                             "the optimizer's update after it steps: call step(optimizer, loss_parts=...) with the "
                             "optimizer about to step, or set step_size=None and adapt_damping=False")
        damping = val.resolve("damping", self.damping, self.steps, val.NONNEGATIVE)
        self.step_size.prepare(self.model, optimizer, self.steps, damping, loss_parts,
                               self.grad_access.loss_scale(), self.distributor.average_scalars, self._hooks_paused)

    def choose_damping(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Resolve ``damping="auto"`` by ``optimizer`` (once; None: no optimizer, 3e-2). A damping the
        Levenberg-Marquardt rule restored from a checkpoint (``adapt_damping``) is kept."""
        if self.options.damping != "auto" or self.damping_choice is not None:
            return
        value, why = auto_damping.resolve(optimizer, self.options.update)
        if self.step_size is not None and self.step_size.damping is not None:
            value, why = self.step_size.damping, "adapted (adapt_damping), restored from the checkpoint"
        self.core.damping = value
        self.damping_choice = f"{value:g} ({why})"

    def _set_damping(self, value: float) -> None:
        """adapt_damping: the Levenberg-Marquardt rule's new damping, used from the next inversion on."""
        self.core.damping = value

    @contextmanager
    def _hooks_paused(self) -> Iterator[None]:
        """The model's forwards in here (the step size's measurement) are not collected."""
        core = self.core
        core.paused, paused = True, core.paused
        try:
            yield
        finally:
            core.paused = paused

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer | None = None, loss_parts: LossParts | None = None) -> None:
        """Precondition the gradients of the registered layers in place (call after backward).

        Args:
            optimizer: the optimizer about to step. Only the layers whose parameters it holds are
                preconditioned (with several optimizers, call ``step(opt)`` before each ``opt.step()``),
                and the KL clip weighs each layer by the learning rate of the param group holding its
                weight, read now (so schedulers and per-group learning rates are followed), unless
                ``lr`` was given. None: every layer, at ``lr`` (which must then be set when ``kl_clip``
                is).
            loss_parts: with ``step_size`` set, ``(forward, loss)``: ``forward()`` recomputes the model's outputs
                on this batch from the current parameters, ``loss(outputs)`` is the scalar the training step
                minimizes; needed on the steps that measure the quadratic model (every ``step_size_every``).
        """
        core = self.core
        self.choose_damping(optimizer)  # (damping="auto": once, at the first step)
        self.registry.register_unfrozen()  # (layers frozen at setup that train now, where no forward hook saw them first)
        self.preconditioning.select(optimizer)
        if self.step_size is not None:
            self._prepare_step_size(optimizer, loss_parts)
        self.inverter.settle()  # inverses launched by the last step (async_inverses), before the factors change
        k = core.steps
        core.grads = core.grad_access.open(core.grad_params)
        core.grads_finite = True
        if core.collecting:
            self.registry.check_layers()
            if core.local:
                with core.timer.phase("factor_update"):
                    self.statistics.update(k)
            else:
                self.statistics.update_distributed(k)
            self.coverage.check()  # (after the update: distributed, a layer run on other ranks has factors then)
            self.capture.end_probe()  # (capture="auto": the first factor step found the weights functions use)
            self.statistics.note_calls_per_micro_batch()
        lean = isinstance(core.grad_access, OwnerShardedAccess)  # FSDP2 hook: the owner-based path (kfac/sharded.py)
        if core.owners is not None and not lean:
            self.preconditioning.begin_share()
        self.inverter.update(k)
        with core.timer.phase("precondition"):
            precondition_owned(self.preconditioning, k) if lean else self.preconditioning.precondition(k)
        if not core.grads_finite:
            self.preconditioning.skipped_precondition_steps += 1
        core.grad_access.close(core.grads)
        core.grads = {}
        core.timer.end_step()
        self.statistics.drop_collected()
        core.steps += 1
        core.distributor.begin_step(core.steps)
