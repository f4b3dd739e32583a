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

This module holds the state, the hooks and ``step()``; the stages are mixins beside it:
registration.py (which layers, their hooks), factor_updates.py (statistics -> running factors),
inverse_steps.py (inverses, async_inverses), preconditioning.py (P, KL clip, write-back),
guard.py (non-finite values) and checkpoint.py (state_dict / load_state_dict).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Generic, TypeVar, cast, overload

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .. import validation as val
from ..factor_shapes import describe
from ..telemetry import StepTimer
from . import factors
from .capture import FunctionCapture
from .checkpoint import STATE_VERSION, CheckpointState
from .coverage import Coverage
from .distributor import Distributor, DistributorContext, OwnerHeld, owner_held
from .factor_updates import FactorUpdates
from .forward_check import ForwardMismatch
from .gradients import GradAccess
from .grafting import DEFAULT_BETA2, DEFAULT_EPS, AdamGraftState
from .guard import NonFiniteGuard, StepGrads
from .hook_tools import autocast_off, eager, in_backward
from .inverse_steps import InverseSteps, _InFlight
from .layer_state import KFACLayer
from .layers import LayerHelper
from .options import KFACOptions
from .param_groups import StepGroups
from .preconditioning import Preconditioning
from .registration import LayerRegistration
from .sharded import OwnerShardedAccess, fsdp2_setup, lean_access, precondition_owned
from .step_size import LossParts, QuadraticStepSize
from .summary import KFACSummary, summarize

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


class KFACPreconditioner(LayerRegistration, FactorUpdates, InverseSteps, Preconditioning, CheckpointState, Coverage):
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
        **overrides: Any,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {val.show(model)}")
        self.options = KFACOptions.build(options, **overrides)
        o = self.options
        # The non-finite guard, a part owning its counters (max_bad_steps, skipped_factor_steps, consecutive_bad_steps,
        # last_bad_step: the attributes of the same names here are its).
        self.guard = NonFiniteGuard(model, o.max_bad_steps)
        self.factor_update_steps = o.factor_update_steps
        self.inv_update_steps = o.inv_update_steps
        self.skip_layers = tuple(re.compile(p) for p in o.skip_layers)
        self.model = model
        self.damping = o.damping
        self.factor_decay = o.factor_decay
        self.kl_clip = o.kl_clip
        self.lr = o.lr
        self.factor_dtype: torch.dtype = o.factor_dtype  # type: ignore[assignment]
        self.inv_dtype: torch.dtype = o.inv_dtype  # type: ignore[assignment]
        # K-FAC-reduce: one factor row per example (aggregated over its positions), not per position;
        # resolved per layer at registration ("auto": by layer type).
        self.factor_approx = o.factor_approx
        # "eigen": A_inv / G_inv hold eigen payloads and the block is damped exactly (kfac/inverse.py).
        self.inverse_method = o.inverse_method
        self._eigen = o.inverse_method == "eigen"
        self.grad_scaler = grad_scaler
        # FSDP2 hook: a fully_shard model gets FSDP2GradAccess and the owner-based schedule (kfac/sharded.py)
        distributor, grad_access = fsdp2_setup(model, distributor, grad_access)
        self.distributor = Distributor() if distributor is None else distributor
        self.grad_access = GradAccess() if grad_access is None else grad_access
        # One process with the base distributor keeps the in-place fast path.
        self._local = self.distributor.is_local
        # Set False on micro-batches that do not end the optimizer step (gradient accumulation)
        # so that pipelined factor reductions wait for the last one.
        self.final_micro_batch = True
        # Set True while forwards are not trained through (Lightning's SWA BatchNorm pass: forwards, no
        # backward): the hooks collect nothing.
        self.paused = False
        # layer index -> (layer, P, grad matrix) of this step
        self._preconditioned: dict[int, tuple[KFACLayer, torch.Tensor | None, torch.Tensor]] = {}
        # The layers the optimizer given to step() steps (layer index -> its param group's lr), or None:
        # every layer, at ``lr``. ``_step_groups`` caches, per optimizer (by id; each entry holds its optimizer),
        # which group holds each layer: several optimizers stepping in turn do not rebuild it every step.
        self._stepping: dict[int, float] | None = None
        self._step_groups: dict[int, StepGroups] = {}
        self._g_scale_value: float | torch.Tensor | None = None
        # Per-phase seconds of the last step in ``timer.last`` (see lightning_spdkfac.telemetry).
        self.timer = StepTimer()

        self.steps = 0  # optimizer steps taken (calls of step())
        self.skipped_precondition_steps = 0  # steps left unpreconditioned: non-finite gradients
        self.inverse_fallbacks = 0  # factor inversions Cholesky could not do (see kfac.inverse)
        # Did the last step() recompute inverses (every inv_update_steps, or a layer's first)? Telemetry.
        self.last_step_inverted = False
        # parameter -> gradient tensor, while step() runs
        self._grads: dict[nn.Parameter, torch.Tensor | None] = {}
        self._grads_finite = True
        self._micro_batch = 0
        self._backward_seen = False
        self._warned: set[tuple[str, str]] = set()
        # Layers whose weight got a gradient but whose block produced no factors, with the measured reason (coverage.py)
        self.unfactored: dict[str, str] = {}
        self.layers: dict[str, KFACLayer] = {}
        self.skipped: dict[str, str] = {}
        # id -> (module, None for a registered module or the reason it was skipped): the supported modules
        # seen at registration, held so that their ids stay theirs (see _check_layers).
        self._known: dict[int, tuple[nn.Module, str | None]] = {}
        self.frozen_layers: dict[str, list[tuple[str, nn.Module, LayerHelper]]] = {}  # (registration.py)
        self._frozen_hook: RemovableHandle | None = None
        # Layers used through functions (kfac/capture.py): active only around the modules of watched weights.
        self.capture = FunctionCapture(model, self._on_call)
        self._hooked: dict[str, list[nn.Module]] = {}
        self._register(model)
        # Each once: the q, k and v blocks of an attention share its packed weight.
        self._grad_params = list(dict.fromkeys(p for ly in self.layers.values() for p in ly.helper.params()))
        kfac_ids = {id(p) for p in self._grad_params}
        self._other_params = [p for p in model.parameters() if id(p) not in kfac_ids]
        # Inversions running asynchronously (async_inverses), launched by an inverse step and swapped in at the
        # start of the next step(); None when nothing is in flight.
        self._in_flight: _InFlight | None = None
        # grafting="adam": each layer's second moment (by layer index); (beta2, eps) of the stepping optimizer.
        self._graft_states: dict[int, AdamGraftState] = {}
        self._graft_hparams = (DEFAULT_BETA2, DEFAULT_EPS)
        context = DistributorContext(inv_dtype=self.inv_dtype, inverse_method=self.inverse_method,
                                     async_inverses=o.async_inverses, inv_update_steps=self.inv_update_steps,
                                     settings=self.settings_text(), timer=self.timer)
        self.distributor.setup([(ly.a_shape, ly.g_shape) for ly in self.layers.values()], context)
        # Distributed preconditioning (schedule="dpkfac"): the distributor holding each layer on its owner, and the
        # owner rank of each layer; None: every rank holds all.
        self._owner_held: OwnerHeld | None = owner_held(self.distributor)
        self._owners: tuple[int, ...] | None = self.distributor.layer_owners
        # FSDP2 hook: rows gathered to each layer's owner and scattered back where that applies (kfac/sharded.py)
        self.grad_access = lean_access(list(self.layers.values()), self._owners, self.grad_access, o, self.distributor)
        # ... and, while a step exchanges the preconditioned gradients, each exchanged layer and its gradient.
        self._shared_grads: dict[int, tuple[KFACLayer, torch.Tensor]] = {}
        # Distributed preconditioning: received layers whose owner may have sent nothing (0-dim device flags, read on
        # no host: the gradient is kept where a flag is false, kfac/preconditioning.py).
        self._unsure: dict[int, torch.Tensor] = {}
        self._check_memory()
        if o.capture == "auto":  # the first factor step follows every layer, to find weights functions also use
            self.capture.probe([ly for ly in self.layers.values() if not ly.helper.capture_only], self._hooked)
        # step_size="quadratic"/"quadratic_momentum": the optimizer's update rescaled after its step (kfac/step_size.py).
        self.step_size: QuadraticStepSize | None = None
        if o.step_size is not None or o.adapt_damping:
            what = f"step_size={o.step_size!r}" if o.step_size is not None else "adapt_damping=True"
            if type(self.grad_access) is not GradAccess:
                raise ValueError(
                    f"{what} is not supported under SPDKFACDeepSpeedStrategy: ZeRO steps its own partitioned fp32 copy "
                    "of the parameters, which the rule's rescaled update and measurement would not reach; use "
                    "SPDKFACStrategy (DDP), one process, or step_size=None, adapt_damping=False")
            self.step_size = QuadraticStepSize(o.step_size, o.step_size_every, o.step_size_clip,
                                               o.step_size_damping, o.adapt_damping, self._set_damping)
        self._begin_step()

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
        self._settle_inverses(keep=False)
        self.distributor.close()
        for layer in self.layers.values():
            for h in layer.handles:
                h.remove()
            layer.handles.clear()
        if self._frozen_hook is not None:
            self._frozen_hook.remove()
            self._frozen_hook = None
        self.capture.remove()
        if getattr(self, "step_size", None) is not None:
            self.step_size.remove_hooks()  # type: ignore[union-attr]

    @property
    def collecting(self) -> bool:
        """Whether the hooks collect factor statistics for the coming step."""
        return self.steps % self.factor_update_steps == 0

    # ------------------------------------------------------------------ hooks
    def _make_forward_hook(self, layer: KFACLayer,
                           helper: LayerHelper) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        """The forward hook of one module of ``layer`` (``helper``: that module's rows)."""

        def forward_hook(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
            if not isinstance(output, torch.Tensor) or not inputs:
                return
            self._on_call(layer, helper, module.training, inputs[0], output)

        # Under torch.compile the hooks run as plain Python (a graph break at each K-FAC layer): traced,
        # K-FAC's bookkeeping would be compiled into graphs guarded on per-layer Python state, with its
        # in-place updates of persistent buffers replayed as side effects.
        return eager(forward_hook)

    def _on_call(self, layer: KFACLayer, helper: LayerHelper, training: bool, x: Any, output: torch.Tensor,
                 g_transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """One call of a layer: a module call (its forward hook) or a function given its weight (kfac/capture.py;
        ``g_transform`` maps the output's gradient to the rows' layout). ``training``: the module's mode."""
        capture = self.capture
        if not capture.active:  # (the usual case: no mode on to hide K-FAC's own products from)
            self._collect_call(layer, helper, training, x, output, g_transform)
            return
        was, capture.suspended = capture.suspended, True  # (a hook inside a captured forward: not calls)
        try:
            self._collect_call(layer, helper, training, x, output, g_transform)
        finally:
            capture.suspended = was

    def _collect_call(self, layer: KFACLayer, helper: LayerHelper, training: bool, x: Any, output: torch.Tensor,
                      g_transform: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        # Grad mode, not module.training, tells a forward that trains: a forward without grad (validation or
        # inference under no_grad / inference_mode, a pseudo-label or EMA-target pass, reentrant
        # checkpointing's first pass) gets no gradient, while a trainable layer in eval mode (inside a
        # frozen-BatchNorm backbone) does.
        if self.paused or not torch.is_grad_enabled() or not layer.trainable():  # frozen: not collected
            return
        if not self.collecting or not output.requires_grad or layer.refused is not None:
            return
        # A forward during backward is activation checkpointing's recomputation. Non-reentrant
        # (use_reentrant=False): the first forward was counted and its output's gradient is the one backward
        # uses; this output gets none. Reentrant: the first forward ran without grad; this output is the one
        # backward differentiates.
        recomputed = in_backward()
        if self._backward_seen and not recomputed:  # a forward after a backward starts a new micro-batch
            self._micro_batch += 1
            self._backward_seen = False
            for ly in self.layers.values():
                ly.mb_a_calls = ly.mb_g_calls = 0
        # Before either path below: a module in eval mode (a frozen-BatchNorm backbone) or recomputed is
        # collected too, and must be checked like one in train mode.
        if helper.needs_check:  # a module whose forward may not be what its attributes say (kfac/conv.py)
            try:
                helper.check_forward(layer.name, x, output)
            except ForwardMismatch as e:  # that layer is refused (named, left to the optimizer); the run goes on
                layer.refused = str(e)
                self.unfactored[layer.name] = layer.refused
                warnings.warn(layer.refused, stacklevel=2)
                return
        if recomputed or not training:
            # Counted when its output gets a gradient, and only then: that tells the two recomputations
            # apart, and an eval-mode forward with grad enabled that is not back-propagated (an
            # evaluation without no_grad) adds nothing. The input is held until then.
            hook = self._make_grad_hook(layer, helper, x, deferred=True, g_transform=g_transform)
            output.register_hook(hook)  # type: ignore[no-untyped-call]
            return
        output.register_hook(self._make_grad_hook(layer, helper, x, g_transform=g_transform))  # type: ignore[no-untyped-call]
        self._collect_a(layer, helper, x)

    def _collect_a(self, layer: KFACLayer, helper: LayerHelper, x: torch.Tensor) -> None:
        """Add one call's input to A; when this call makes this step's A final (pipelining), send it."""
        with self.timer.phase("factor_compute"):
            with autocast_off(x.device.type):
                self._accumulate_a(layer, helper, x)
            if not self._pipelining_final(layer, layer.mb_a_calls):
                return
            layer.submitted["A"] = layer.a_calls
            A_new = layer.step_a() if layer.rows else None  # empty input: no data from this rank, not 0/0
        self.distributor.factor_final(layer.index, "A", A_new)

    def _make_grad_hook(self, layer: KFACLayer, helper: LayerHelper, x: torch.Tensor, deferred: bool = False,
                        g_transform: Callable[[torch.Tensor], torch.Tensor] | None = None
                        ) -> Callable[[torch.Tensor], None]:
        """The output-gradient hook of one call; ``deferred``: the call's A is added here too, first."""
        batch = helper.examples(x, layer.reduce)
        micro_batch = self._micro_batch
        held = x.detach() if deferred else None

        def grad_hook(grad_output: torch.Tensor) -> None:
            self._backward_seen = True
            if g_transform is not None:
                grad_output = g_transform(grad_output)
            if held is not None:
                self._collect_a(layer, helper, held)
            with self.timer.phase("factor_compute"):
                with autocast_off(grad_output.device.type):
                    self._accumulate_g(layer, helper, grad_output, batch, micro_batch)
                final = self._pipelining_final(layer, layer.mb_g_calls)
                if final:
                    layer.submitted["G"] = layer.g_calls
                    # No rows this step (an empty input): no data from this rank, not 0/0.
                    G_new = layer.step_g(self._g_scale()) if layer.rows else None
            if final:
                self.distributor.factor_final(layer.index, "G", G_new)

        return eager(grad_hook)

    def _accumulate_a(self, layer: KFACLayer, helper: LayerHelper, x: torch.Tensor) -> None:
        a = helper.factor_rows(x.detach(), layer.reduce, self.factor_dtype)
        first = layer.a_calls == 0
        shape = layer.xx_shape()
        if first:
            if layer.xx is None or layer.xx.shape != shape or layer.xx.device != a.device:
                layer.xx = torch.empty(shape, dtype=self.factor_dtype, device=a.device)
            layer.x_sum = factors.column_sums(a, layer.a_shape) if layer.keeps_x_sum else None
        elif layer.keeps_x_sum:  # set by this step's first call
            assert layer.x_sum is not None
            layer.x_sum.add_(factors.column_sums(a, layer.a_shape))
        assert layer.xx is not None
        helper.add_gram(layer.xx, a, first, shape)
        if helper.counts_rows:  # an expert stack's call: rows per block
            if first or layer.group_rows is None:
                layer.group_rows = torch.zeros(layer.a_shape[0], dtype=torch.float32, device=a.device)
            helper.count_rows(layer.group_rows, a)
        layer.rows += a.shape[0]
        layer.a_calls += 1
        layer.mb_a_calls += 1

    def _accumulate_g(self, layer: KFACLayer, helper: LayerHelper, grad_output: torch.Tensor, batch: int,
                      micro_batch: int) -> None:
        if layer.reduce:
            d = helper.g_reduced(grad_output, self.factor_dtype)
        else:
            d = helper.g_rows(grad_output).to(self.factor_dtype)
        first = layer.g_calls == 0
        if first and (layer.dd is None or layer.dd.shape != layer.g_shape or layer.dd.device != d.device):
            layer.dd = torch.empty(layer.g_shape, dtype=self.factor_dtype, device=d.device)
        assert layer.dd is not None  # allocated by this step's first call
        helper.add_g_gram(layer.dd, d, first, layer.g_shape)
        if micro_batch != layer.last_micro_batch:  # several calls in one forward share examples
            layer.examples += batch
            layer.last_micro_batch = micro_batch
        layer.g_calls += 1
        layer.mb_g_calls += 1

    def _pipelining_final(self, layer: KFACLayer, mb_calls: int) -> bool:
        """Is this call the one that makes the layer's factor of this step final?"""
        return (
            self.distributor.pipelined
            and self.final_micro_batch
            and layer.calls_per_micro_batch > 0
            and mb_calls == layer.calls_per_micro_batch
        )

    def _g_scale(self) -> float | torch.Tensor:
        """1/S^2 for the loss scale S on output gradients, once per step. A GradScaler's scale stays on its device
        (a float64 0-dim tensor: ``get_scale()`` would read it to the host, from inside the backward hooks when
        factors are pipelined); other loss scales (DeepSpeed fp16) are host numbers already."""
        if self._g_scale_value is None:
            scaler = self.grad_scaler
            if scaler is not None and scaler.is_enabled():
                held = scaler._get_scale_async()  # the scale tensor; None before the first scale()
                if held is None:
                    self._g_scale_value = 1.0 / float(scaler.get_scale()) ** 2  # the initial scale, a number
                else:
                    self._g_scale_value = held.double().reciprocal().square()
            else:  # e.g. DeepSpeed fp16: the loss scale is applied to output gradients too
                self._g_scale_value = 1.0 / self.grad_access.loss_scale() ** 2
        return self._g_scale_value

    # ------------------------------------------------------------------ the step
    def _begin_step(self) -> None:
        """Tell the distributor that optimizer step ``steps`` begins (before its first forward)."""
        self.distributor.begin_step(self.steps)

    def _sharing(self) -> OwnerHeld:
        """The distributor as it holds layers on their owners (called where ``layer_owners`` is set)."""
        if self._owner_held is None:
            raise TypeError(f"{type(self.distributor).__name__} sets layer_owners but does not implement OwnerHeld "
                            "(lightning_spdkfac.kfac.distributor): distributed preconditioning needs its methods")
        return self._owner_held

    max_bad_steps = _Part[int | None]("guard")
    skipped_factor_steps = _Part[int]("guard")
    consecutive_bad_steps = _Part[int]("guard")
    last_bad_step = _Part[dict[str, Any] | None]("guard")

    def _check_finite_flags(self, extra: list[torch.Tensor], labels: list[tuple[KFACLayer, str, bool]],
                            agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
                            flags: Sequence[torch.Tensor] = ()) -> tuple[bool, list[bool]]:
        """Whether this step may update the factors, and the device ``flags`` read along (the guard's
        :meth:`~lightning_spdkfac.kfac.guard.NonFiniteGuard.check`); non-finite gradients leave the step
        unpreconditioned."""
        grads_ok, fine, read = self.guard.check(StepGrads(self.steps, self.layers, self._grads, self._other_params, self.grad_access),
                                                extra, labels, agree, flags)
        if not grads_ok:
            self._grads_finite = False
        return fine, read

    def _check_finite(self, extra: list[torch.Tensor], labels: list[tuple[KFACLayer, str, bool]],
                      agree: Callable[[torch.Tensor], torch.Tensor] | None = None) -> bool:
        """Whether this step may update the factors (:meth:`_check_finite_flags` without flags)."""
        return self._check_finite_flags(extra, labels, agree)[0]

    def _drop_collected(self) -> None:
        """Forget the factor statistics collected since the last step (each step's end, a loaded state)."""
        for layer in self.layers.values():
            layer.reset_accumulators()
        self._micro_batch = 0
        self._backward_seen = False
        self._g_scale_value = None

    def _warn_once(self, layer: str, key: str, message: str) -> None:
        if (layer, key) not in self._warned:
            self._warned.add((layer, key))
            warnings.warn(message, stacklevel=3)

    def _prepare_step_size(self, optimizer: torch.optim.Optimizer | None, loss_parts: LossParts | None) -> None:
        assert self.step_size is not None
        if optimizer is None:
            raise ValueError(f"step_size={self.step_size.mode!r} / adapt_damping={self.step_size.adapt_damping} work on "
                             "the optimizer's update after it steps: call step(optimizer, loss_parts=...) with the "
                             "optimizer about to step, or set step_size=None and adapt_damping=False")
        damping = val.resolve("damping", self.damping, self.steps, val.NONNEGATIVE)
        self.step_size.prepare(self.model, optimizer, self.steps, damping, loss_parts,
                               self.grad_access.loss_scale(), self.distributor.average_scalars, self._hooks_paused)

    def _set_damping(self, value: float) -> None:
        """adapt_damping: the Levenberg-Marquardt rule's new damping, used from the next inversion on."""
        self.damping = value

    @contextmanager
    def _hooks_paused(self) -> Iterator[None]:
        """The model's forwards in here (the step size's measurement) are not collected."""
        self.paused, paused = True, self.paused
        try:
            yield
        finally:
            self.paused = paused

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
        self._register_unfrozen()  # (layers frozen at setup that train now, where no forward hook saw them first)
        self._select(optimizer)
        if self.step_size is not None:
            self._prepare_step_size(optimizer, loss_parts)
        self._settle_inverses()  # inverses launched by the last step (async_inverses), before the factors change
        k = self.steps
        self._grads = self.grad_access.open(self._grad_params)
        self._grads_finite = True
        if self.collecting:
            self._check_layers()
            if self._local:
                with self.timer.phase("factor_update"):
                    self._update_factors(k)
            else:
                self._update_factors_distributed(k)
            self._check_coverage()  # (after the update: distributed, a layer run on other ranks has factors then)
            self.capture.end_probe()  # (capture="auto": the first factor step found the weights functions use)
            for layer in self.layers.values():
                # Calls of one micro-batch: the count that makes a factor final when pipelining.
                if layer.a_calls and layer.mb_a_calls == layer.mb_g_calls and not layer.helper.dynamic_calls:
                    layer.calls_per_micro_batch = layer.mb_a_calls
        lean = isinstance(self.grad_access, OwnerShardedAccess)  # FSDP2 hook: the owner-based path (kfac/sharded.py)
        if self._owners is not None and not lean:
            self._begin_share()
        self._update_inverses(k)
        with self.timer.phase("precondition"):
            precondition_owned(self, k) if lean else self._precondition(k)
        if not self._grads_finite:
            self.skipped_precondition_steps += 1
        self.grad_access.close(self._grads)
        self._grads = {}
        self.timer.end_step()
        self._drop_collected()
        self.steps += 1
        self._begin_step()
