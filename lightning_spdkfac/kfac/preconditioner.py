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
"""

from __future__ import annotations

import re
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .. import validation as val
from ..factor_shapes import describe
from ..telemetry import StepTimer, capped_threads
from . import factors
from .attention import module_layers
from .checkpoint import STATE_VERSION, CheckpointState
from .distributor import Distributor, FactorKey, PendingInverses, Task
from .gradients import GradAccess
from .grafting import DEFAULT_BETA2, DEFAULT_EPS, AdamGraftState, graft
from .guard import NonFiniteGuard
from .hook_tools import autocast_off, eager, in_backward
from .inverse import (
    EIGEN_FALLBACK_ACTION,
    FALLBACK_ACTION,
    Fallback,
    eigen_precondition,
    pi_split,
    robust_eigens,
    robust_inverses,
)
from .layer_state import KFACLayer
from .layers import (
    LayerHelper,
    linear_and_conv_modules,
    make_helper,
    shared_parameter_groups,
    unsupported_reason,
)
from .options import KFACOptions
from .param_groups import StepGroups, step_groups
from .step_size import LossParts, QuadraticStepSize
from .summary import KFACSummary, format_bytes, summarize

__all__ = ["STATE_VERSION", "KFACLayer", "KFACPreconditioner"]


@dataclass
class _InFlight:
    """Asynchronous inversions launched on an inverse step, until the next step() swaps them in."""

    pending: PendingInverses
    layers: dict[int, KFACLayer]  # by index: the layers being inverted
    damping: float  # the block damping they were computed with (eigen applies it when preconditioning)
    # Fallback reports the worker made, replayed on the caller's thread at the swap (warnings and counters
    # are not touched from the worker).
    reports: list[Callable[[], None]] = field(default_factory=list)
    compute_seconds: float = 0.0  # inversion time on the worker (inverse_async)


class KFACPreconditioner(NonFiniteGuard, CheckpointState):
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
        self.max_bad_steps = o.max_bad_steps
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
        self._preconditioned: dict[int, tuple[KFACLayer, torch.Tensor, torch.Tensor]] = {}
        # The layers the optimizer given to step() steps (layer index -> its param group's lr), or None:
        # every layer, at ``lr``. ``_step_groups`` caches, per optimizer (by id; each entry holds its optimizer),
        # which group holds each layer: several optimizers stepping in turn do not rebuild it every step.
        self._stepping: dict[int, float] | None = None
        self._step_groups: dict[int, StepGroups] = {}
        self._g_scale_value: float | None = None
        # Per-phase seconds of the last step in ``timer.last`` (see lightning_spdkfac.telemetry).
        self.timer = StepTimer()
        self.distributor.timer = self.timer

        self.steps = 0  # optimizer steps taken (calls of step())
        self.skipped_factor_steps = 0  # factor updates skipped for non-finite values
        self.skipped_precondition_steps = 0  # steps left unpreconditioned: non-finite gradients
        self.consecutive_bad_steps = 0  # factor steps skipped in a row (max_bad_steps bounds it)
        # {"step": k, "bad": {where: [what, ...]}} of the last one
        self.last_bad_step: dict[str, Any] | None = None
        self.inverse_fallbacks = 0  # factor inversions Cholesky could not do (see kfac.inverse)
        # Did the last step() recompute inverses (every inv_update_steps, or a layer's first)? Telemetry.
        self.last_step_inverted = False
        # parameter -> gradient tensor, while step() runs
        self._grads: dict[nn.Parameter, torch.Tensor | None] = {}
        self._grads_finite = True
        self._micro_batch = 0
        self._backward_seen = False
        self._warned: set[tuple[str, str]] = set()
        self.layers: dict[str, KFACLayer] = {}
        self.skipped: dict[str, str] = {}
        # id -> (module, None for a registered module or the reason it was skipped): the supported modules
        # seen at registration, held so that their ids stay theirs (see _check_layers).
        self._known: dict[int, tuple[nn.Module, str | None]] = {}
        self._register(model)
        # Each once: the q, k and v blocks of an attention share its packed weight.
        self._grad_params = list(dict.fromkeys(p for ly in self.layers.values() for p in ly.helper.params()))
        kfac_ids = {id(p) for p in self._grad_params}
        self._other_params = [p for p in model.parameters() if id(p) not in kfac_ids]
        self.distributor.inv_dtype = self.inv_dtype
        self.distributor.inverse_method = self.inverse_method
        self.distributor.async_inverses = o.async_inverses
        self.distributor.inv_update_steps = self.inv_update_steps
        # Inversions running asynchronously (async_inverses), launched by an inverse step and swapped in at the
        # start of the next step(); None when nothing is in flight.
        self._in_flight: _InFlight | None = None
        # grafting="adam": each layer's second moment (by layer index); (beta2, eps) of the stepping optimizer.
        self._graft_states: dict[int, AdamGraftState] = {}
        self._graft_hparams = (DEFAULT_BETA2, DEFAULT_EPS)
        self.distributor.kfac_settings = self.settings_text()
        self.distributor.setup([(ly.a_shape, ly.g_shape) for ly in self.layers.values()])
        # Distributed preconditioning (schedule="dpkfac"): the owner rank of each layer; None: every rank holds all.
        self._owners: tuple[int, ...] | None = self.distributor.layer_owners
        # ... and, while a step exchanges the preconditioned gradients, each exchanged layer and its gradient.
        self._shared_grads: dict[int, tuple[KFACLayer, torch.Tensor]] = {}
        self._check_memory()
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

    # ------------------------------------------------------------------ registration
    def _register(self, model: nn.Module) -> None:
        seen_types = []
        candidates: list[tuple[str, nn.Module, LayerHelper]] = []
        of_type: list[str] = []  # layers skipped for their type: named in one warning
        for module_name, module in model.named_modules():
            seen_types.append(type(module).__name__)
            cls = type(module).__name__
            refused: list[str] = []  # this module's refused layers (an attention: itself and its out_proj)
            for name, hooked, helper, reason in module_layers(module_name, module):
                if name in self.skipped:  # (the out_proj of a refused attention)
                    continue
                if helper is None:
                    assert reason is not None  # module_layers lists a module without a helper with its reason
                    self._skip(name, hooked, reason)
                    refused.append(name)
                    continue
                if any(p.search(name) or p.search(cls) for p in self.skip_layers):
                    self._skip(name, hooked, "matched skip_layers")
                    continue
                # A layer frozen now is registered too: frozen layers are left alone step by step (trainable()), and
                # one frozen at setup may be unfrozen later (BackboneFinetuning, a warm-up): it then gets K-FAC like
                # the others. (Distributed, its factor slots travel, empty, while it is frozen: exclude a layer that
                # stays frozen for the whole run with skip_layers.)
                candidates.append((name, hooked, helper))
            if refused and unsupported_reason(module) is not None:
                of_type.append(f"{module_name!r} ({cls}: {self.skipped[module_name]})")
            elif refused:
                names = ", ".join(repr(n) for n in refused)
                warnings.warn(f"K-FAC skips layer{'s' if len(refused) > 1 else ''} {names}: "
                              f"{self.skipped[refused[0]]}", stacklevel=3)
        if of_type:
            warnings.warn("K-FAC does not support these layers and leaves them to the optimizer unpreconditioned: "
                          + "; ".join(of_type), stacklevel=3)
        for group, why in shared_parameter_groups(model, candidates):
            if why is not None:
                names = ", ".join(repr(n) for n, _, _ in group)
                warnings.warn(f"K-FAC skips layer{'s' if len(group) > 1 else ''} {names}: {why}", stacklevel=3)
                for name, module, _ in group:
                    self._skip(name, module, why)
                continue
            # One K-FAC block for modules that share all their parameters (one module: the usual case),
            # named after the first; each module's calls add to its factors with that module's own
            # geometry, like the calls of one layer called several times per forward.
            name, _, helper = group[0]
            reduce = helper.reducible and (
                self.factor_approx == "reduce" or (self.factor_approx == "auto" and helper.auto_reduce))
            a_shape, g_shape = helper.factor_shapes(self.options.max_factor_side)
            layer = KFACLayer(name=name, helper=helper, index=len(self.layers), reduce=reduce, a_shape=a_shape,
                              g_shape=g_shape)
            for _, module, module_helper in group:
                layer.handles.append(module.register_forward_hook(self._make_forward_hook(layer, module_helper)))
                self._known[id(module)] = (module, None)
            self.layers[name] = layer
        if not self.layers:
            found = ", ".join(sorted(set(seen_types)))
            detail = "; ".join(f"{n or '<root>'}: {r}" for n, r in self.skipped.items())
            raise ValueError(
                "KFACPreconditioner found no supported layer (nn.Linear, nn.Conv1d/2d/3d, nn.MultiheadAttention) in "
                "model; "
                f"module types found: {found}" + (f"; skipped: {detail}" if detail else "")
            )

    def summary(self) -> KFACSummary:
        """What K-FAC preconditions and what it leaves to the optimizer, with the layout and the bytes of every
        block (``print(pre.summary())`` shows the table; :mod:`lightning_spdkfac.kfac.summary`)."""
        return summarize(self)

    def _check_memory(self) -> None:
        """Stop at setup, before any factor is allocated, when the K-FAC memory would exceed ``memory_limit``."""
        limit = self.options.memory_limit
        if limit is None:
            return
        s = self.summary()
        if s.total_bytes > int(limit):
            raise MemoryError(
                f"K-FAC would need {format_bytes(s.total_bytes)} on this rank, above memory_limit="
                f"{format_bytes(int(limit))}; nothing was allocated. Raise memory_limit, lower max_factor_side "
                "(larger sides are then kept diagonal), skip the largest layers with skip_layers, or use "
                "schedule='dpkfac' (each rank holds its own layers only). The K-FAC summary:\n" + str(s))

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

    def _skip(self, name: str, module: nn.Module, reason: str) -> None:
        self.skipped[name] = reason
        self._known[id(module)] = (module, reason)

    def _check_layers(self) -> None:
        """Supported layers that got trainable after registration, or joined the model after it.

        A layer added to the model (or put in place of a registered one: ``model.fc = nn.Linear(...)``) after
        the preconditioner was built has no hooks, so its gradient would reach the optimizer
        unpreconditioned while its predecessor keeps its factors: one RuntimeError naming it. Only layers
        that train count: some parameter requires grad and has a gradient (wherever the gradients are not
        ``param.grad``, requiring grad is enough). One pass over the model's modules, called on factor steps.
        """
        plain_grads = type(self.grad_access) is GradAccess
        added = []
        for module in linear_and_conv_modules(self.model):
            if id(module) in self._known:
                continue
            if not any(p.requires_grad and (p.grad is not None or not plain_grads)
                       for p in module.parameters(recurse=False)):
                continue
            if make_helper(module)[0] is not None:
                added.append(module)
        if added:
            names = [n for n, m in self.model.named_modules() if any(m is a for a in added)]
            raise RuntimeError(
                f"K-FAC: layer(s) {', '.join(repr(n) for n in names)} joined the model after the KFACPreconditioner "
                "was built (added, or put in place of a registered layer), so K-FAC has no hooks on them and their "
                "gradients would reach the optimizer unpreconditioned. Build the preconditioner once the model is "
                "final (with the KFAC callback: create the layers in the LightningModule's __init__ and do not "
                "replace them during fit), or freeze these layers if they are not trained"
            )

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
            # Grad mode, not module.training, tells a forward that trains: a forward without grad (validation or
            # inference under no_grad / inference_mode, a pseudo-label or EMA-target pass, reentrant
            # checkpointing's first pass) gets no gradient, while a trainable layer in eval mode (inside a
            # frozen-BatchNorm backbone) does.
            if self.paused or not torch.is_grad_enabled() or not layer.trainable():  # frozen: not collected
                return
            if not self.collecting or not isinstance(output, torch.Tensor) or not output.requires_grad:
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
            x = inputs[0]
            # Before either path below: a module in eval mode (a frozen-BatchNorm backbone) or recomputed is
            # collected too, and must be checked like one in train mode.
            if helper.needs_check:  # a module whose forward may not be what its attributes say (kfac/conv.py)
                helper.check_forward(layer.name, x, output)
            if recomputed or not module.training:
                # Counted when its output gets a gradient, and only then: that tells the two recomputations
                # apart, and an eval-mode forward with grad enabled that is not back-propagated (an
                # evaluation without no_grad) adds nothing. The input is held until then.
                output.register_hook(self._make_grad_hook(layer, helper, x, deferred=True))  # type: ignore[no-untyped-call]
                return
            output.register_hook(self._make_grad_hook(layer, helper, x))  # type: ignore[no-untyped-call]
            self._collect_a(layer, helper, x)

        # Under torch.compile the hooks run as plain Python (a graph break at each K-FAC layer): traced,
        # K-FAC's bookkeeping would be compiled into graphs guarded on per-layer Python state, with its
        # in-place updates of persistent buffers replayed as side effects.
        return eager(forward_hook)

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

    def _make_grad_hook(self, layer: KFACLayer, helper: LayerHelper, x: torch.Tensor,
                        deferred: bool = False) -> Callable[[torch.Tensor], None]:
        """The output-gradient hook of one call; ``deferred``: the call's A is added here too, first."""
        batch = helper.examples(x, layer.reduce)
        micro_batch = self._micro_batch
        held = x.detach() if deferred else None

        def grad_hook(grad_output: torch.Tensor) -> None:
            self._backward_seen = True
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
        factors.gram(layer.dd, d, layer.g_shape, first)
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

    def _g_scale(self) -> float:
        """1/S^2 for the loss scale S on output gradients; read once per step (it may sync with the GPU)."""
        if self._g_scale_value is None:
            scaler = self.grad_scaler
            if scaler is not None and scaler.is_enabled():
                scale = float(scaler.get_scale())
            else:  # e.g. DeepSpeed fp16: the loss scale is applied to output gradients too
                scale = self.grad_access.loss_scale()
            self._g_scale_value = 1.0 / scale**2
        return self._g_scale_value

    # ------------------------------------------------------------------ the step
    def _begin_step(self) -> None:
        """Tell the distributor that optimizer step ``steps`` begins (before its first forward)."""
        self.distributor.kfac_step = self.steps
        self.distributor.begin_step()

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

    def _collected_layers(self) -> list[KFACLayer]:
        """The layers whose statistics of this step make a factor update: as many backward as forward
        calls, over at least one row. A layer that saw only empty inputs (0 rows: an expert no example
        was routed to, an empty batch) contributes nothing this step, quietly, like a layer that did not
        run; a call-count mismatch warns once per layer (a key of its own: an empty step hides nothing)."""
        ready = []
        for layer in self.layers.values():
            if layer.a_calls == 0 and layer.g_calls == 0:
                continue
            if layer.a_calls == layer.g_calls and layer.rows == 0:
                continue
            if layer.a_calls != layer.g_calls:
                self._warn_once(
                    layer.name,
                    "calls",
                    f"K-FAC layer {layer.name!r}: {layer.a_calls} forward call(s) but {layer.g_calls} "
                    "backward call(s) in one step (a forward whose output got no gradient?); "
                    "its factors are not updated on such steps",
                )
                continue
            ready.append(layer)
        return ready

    def _update_factors(self, k: int) -> None:
        ready = self._collected_layers()
        if not ready:
            return
        g_scale = self._g_scale()
        diagonals = [d for layer in ready for d in layer.gram_diagonals()]
        labels = [(layer, which, False) for layer in ready for which in ("A", "G")]
        if not self._check_finite(diagonals, labels):
            return
        decay = val.resolve("factor_decay", self.factor_decay, k, val.DECAY)
        for layer in ready:
            layer.update_factors(decay, g_scale)

    def _update_factors_distributed(self, k: int) -> None:
        """Step factors averaged over ranks by the distributor, then the running averages."""
        g_scale = self._g_scale()
        complete = set(self._collected_layers())
        local: dict[FactorKey, torch.Tensor | None] = {}
        for layer in self.layers.values():
            for which, submitted in layer.submitted.items():
                now = layer.a_calls if which == "A" else layer.g_calls
                if now != submitted:
                    raise RuntimeError(
                        f"K-FAC layer {layer.name!r}: its {which} factor was sent after {submitted} call(s), "
                        f"but the step ended after {now}; pipelined factor reduction needs the same number "
                        "of calls of a layer in every step (turn pipelining off for this model)"
                    )
            if "A" not in layer.submitted:
                local[(layer.index, "A")] = layer.step_a() if layer in complete else None
            if "G" not in layer.submitted:
                local[(layer.index, "G")] = layer.step_g(g_scale) if layer in complete else None
        reduced = self.distributor.reduce_factors(local)
        with self.timer.phase("factor_update"):
            self._fold_reduced(reduced, k)

    def _fold_reduced(self, reduced: dict[FactorKey, torch.Tensor | None], k: int) -> None:
        ready = []
        for layer in self.layers.values():
            A, G = reduced[(layer.index, "A")], reduced[(layer.index, "G")]
            if A is not None and G is not None:
                ready.append((layer, A, G))
        if not ready and self._owners is None:
            return
        # Reduced factors and DDP-averaged gradients are identical on every rank: so is this test. Under
        # distributed preconditioning a rank receives its own layers' factors only; the verdict is agreed on
        # (every rank, every factor step, even one that received nothing), so every rank skips together.
        diagonals = [factors.trace_sum(m) for _, A, G in ready for m in (A, G)]
        labels = [(layer, which, True) for layer, _, _ in ready for which in ("A", "G")]
        agree = self.distributor.agree if self._owners is not None else None  # type: ignore[attr-defined]
        if not self._check_finite(diagonals, labels, agree) or not ready:
            return
        decay = val.resolve("factor_decay", self.factor_decay, k, val.DECAY)
        for layer, A, G in ready:
            layer.fold(A, G, decay)

    def _update_inverses(self, k: int) -> None:
        due = k % self.inv_update_steps == 0
        todo = [ly for ly in self.layers.values() if ly.A is not None and (due or ly.A_inv is None)]
        self.last_step_inverted = bool(todo)
        if not todo:
            return
        damping = val.resolve("damping", self.damping, k, val.NONNEGATIVE)
        if self.distributor.use_async_inverses():
            # A layer's first inverses are computed now (there is nothing to precondition with yet); the others
            # are recomputed off this thread while this step preconditions with the ones held.
            now = [ly for ly in todo if ly.A_inv is None]
            later = [ly for ly in todo if ly.A_inv is not None]
            if later:
                self._launch_inverses(k, damping, later)
            todo = now
            if not todo:
                return
        by_index = {ly.index: ly for ly in todo}
        invert = (self._eigen_fn(k, by_index, self._report_now) if self._eigen
                  else self._cholesky_fn(k, damping, todo, by_index, self._report_now))
        for ly in todo:
            ly.inv_damping = damping  # eigen applies it when preconditioning, until the next inverse step

        arrived: set[tuple[int, str]] = set()

        def on_ready(index: int, which: str, inverse: torch.Tensor) -> None:
            layer = by_index[index]
            setattr(layer, f"{which}_inv", inverse)
            arrived.add((index, which))
            if (index, "A") in arrived and (index, "G") in arrived:
                # Both inverses are here: precondition this layer now, while others still arrive.
                with self.timer.phase("precondition"):
                    self._precondition_layer(layer)

        tasks = [(ly.index, which, getattr(ly, which)) for ly in todo for which in ("A", "G")]
        self.distributor.invert(tasks, invert, on_ready)

    def _report_now(self, report: Callable[[], None]) -> None:
        report()

    @contextmanager
    def _inverse_timing(self, flight: _InFlight | None) -> Iterator[None]:
        """The inversion phase: on this thread a timer phase (``inverse_compute``); on the worker the thread
        cap and a plain clock into ``flight`` (the timer belongs to the caller's thread)."""
        if flight is None:
            with self.timer.phase("inverse_compute"):
                yield
            return
        with capped_threads(self.timer.thread_cap):
            t0 = time.perf_counter()
            try:
                yield
            finally:
                flight.compute_seconds += time.perf_counter() - t0

    def _launch_inverses(self, k: int, damping: float, layers: list[KFACLayer]) -> None:
        """Start the inversions of ``layers`` on the distributor's worker (async_inverses); see _settle_inverses."""
        by_index = {ly.index: ly for ly in layers}
        flight = _InFlight(pending=None, layers=by_index, damping=damping)  # type: ignore[arg-type]
        invert = (self._eigen_fn(k, by_index, flight.reports.append, flight) if self._eigen
                  else self._cholesky_fn(k, damping, layers, by_index, flight.reports.append, flight))
        # The worker reads these factors; they are not modified before the next step() settles it.
        tasks = [(ly.index, which, getattr(ly, which)) for ly in layers for which in ("A", "G")]
        flight.pending = self.distributor.invert_async(tasks, invert)
        self._in_flight = flight

    def _settle_inverses(self, keep: bool = True) -> None:
        """Swap in the inverses of the asynchronous inversions in flight (waiting for what is not done), or,
        with ``keep=False``, wait for them and drop them. Their worker's errors are raised here, with ``keep``;
        either way nothing is left in flight and the inverses held stay consistent (all of one inverse step's
        layers swapped in, or none)."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return
        t0 = time.perf_counter()
        try:
            results = flight.pending.wait()
        except BaseException:
            if keep:
                raise
            return
        finally:
            self.timer.add("inverse_wait", time.perf_counter() - t0)
        if not keep:
            return
        self.timer.add("inverse_async", flight.compute_seconds)
        for report in flight.reports:
            report()
        for index, which, inverse in results:
            setattr(flight.layers[index], f"{which}_inv", inverse)
        for layer in flight.layers.values():
            layer.inv_damping = flight.damping

    def _cholesky_fn(self, k: int, damping: float, todo: list[KFACLayer], by_index: dict[int, KFACLayer],
                     report: Callable[[Callable[[], None]], None],
                     flight: _InFlight | None = None) -> Callable[[list[Task]], list[torch.Tensor]]:
        """The distributor's ``invert_fn`` for inverse_method="cholesky": damped inverses, pi-balanced split.
        ``report`` takes each fallback report (run now, or kept for the swap of ``flight``'s inverses)."""
        split = self._factor_dampings(todo, damping)  # (on this thread: the factors are read before any launch)

        def invert(tasks: list[Task]) -> list[torch.Tensor]:
            dampings = [split[(index, which)] for index, which, _ in tasks]
            with self._inverse_timing(flight):
                inverses, fallbacks = robust_inverses([t[2] for t in tasks], dampings, self.inv_dtype)
            if fallbacks:
                report(lambda: self._report_fallbacks(fallbacks, tasks, by_index, "inverse", lambda fb, which: (
                    f"Cholesky of the damped {which} factor failed at step {k} (damping {damping:g}, "
                    f"{float(dampings[fb.index]):.3g} on this factor): {fb.reason}; "
                    + FALLBACK_ACTION[fb.level].format(damping=fb.damping))))
            return inverses

        return invert

    def _eigen_fn(self, k: int, by_index: dict[int, KFACLayer], report: Callable[[Callable[[], None]], None],
                  flight: _InFlight | None = None) -> Callable[[list[Task]], list[torch.Tensor]]:
        """The distributor's ``invert_fn`` for inverse_method="eigen": eigen payloads (kfac/inverse.py)."""

        def invert(tasks: list[Task]) -> list[torch.Tensor]:
            with self._inverse_timing(flight):
                payloads, fallbacks = robust_eigens([t[2] for t in tasks], self.inv_dtype)
            if fallbacks:
                report(lambda: self._report_fallbacks(fallbacks, tasks, by_index, "eigen", lambda fb, which: (
                    f"the eigendecomposition of the {which} factor failed at step {k} (inv_dtype "
                    f"{self.inv_dtype}): {fb.reason}; " + EIGEN_FALLBACK_ACTION[fb.level])))
            return payloads

        return invert

    def _report_fallbacks(self, fallbacks: list[Fallback], tasks: list[Task], by_index: dict[int, KFACLayer],
                          kind: str, describe: Callable[[Fallback, str], str]) -> None:
        """Count the inversions that fell back and warn once per layer and level (kfac/inverse.py)."""
        self.inverse_fallbacks += len(fallbacks)
        for fb in fallbacks:
            index, which, _ = tasks[fb.index]
            name = by_index[index].name
            self._warn_once(name, f"{kind}-{fb.level}", f"K-FAC layer {name!r}: " + describe(fb, which))

    @staticmethod
    def _factor_dampings(layers: list[KFACLayer], damping: float) -> dict[tuple[int, str], torch.Tensor]:
        """(layer index, "A"/"G") -> the damping added to that factor: the pi-balanced split of ``damping``.

        Every rank holds the same reduced factors, so every rank computes the same split; no host sync.
        """
        out: dict[tuple[int, str], torch.Tensor] = {}
        for ly in layers:
            assert ly.A is not None and ly.G is not None  # set together
            out[(ly.index, "A")], out[(ly.index, "G")] = pi_split(ly.A, ly.G, damping)
        return out

    def _precondition_layer(self, layer: KFACLayer) -> None:
        """P = G_inv [dW, db] A_inv (or its eigen form) for one layer, kept until the KL clip of the step is known."""
        # Not whether this rank ran the layer, which is local (data-dependent control flow): the gradient,
        # the inverses and the optimizer's groups are the same on every rank; deciding on them keeps every
        # rank preconditioning the same layers, and the KL clip the same sum.
        if layer.index in self._preconditioned or layer.A_inv is None or not self._grads_finite:
            return
        g = self._step_grad(layer)
        if g is None:
            return
        assert layer.G_inv is not None  # the inverses are set together (both arrive before this is called)
        # The last dim: n for an n x n inverse, an (n+1) x n eigen payload and a diagonal one alike.
        if layer.A_inv.shape[-1] != g.shape[-1] or layer.G_inv.shape[-1] != g.shape[-2]:
            return  # the layer changed shape since its factors were taken
        gi = g.to(self.inv_dtype)
        if self._eigen:
            assert layer.inv_damping is not None  # set with the payloads
            p = eigen_precondition(gi, layer.A_inv, layer.G_inv, layer.inv_damping)
        else:
            p = factors.apply_inverses(layer.G_inv, gi, layer.A_inv)
        self._preconditioned[layer.index] = (layer, p, gi)
        if self._owners is not None:  # its broadcast starts now, while the next layer is worked on
            self.distributor.offer(layer.index, p)  # type: ignore[attr-defined]

    def _step_grad(self, layer: KFACLayer) -> torch.Tensor | None:
        """The layer's gradient matrix if this step may precondition it, else None; decided on what every rank
        sees alike (the optimizer's groups, requires_grad, the reduced gradient)."""
        if self._stepping is not None and layer.index not in self._stepping:
            return None  # another optimizer (or none) steps this layer
        if not layer.trainable():  # frozen after its forward: its (stale or absent) gradient is left as is
            return None
        return layer.helper.grad_matrix(self._grads)

    def _begin_share(self) -> None:
        """Distributed preconditioning: name the layers whose P this step exchanges (those _step_grad admits, so
        every P an owner computes is in the round), keeping their gradients for _gather_preconditioned."""
        self._shared_grads = {}
        for layer in self.layers.values():
            g = self._step_grad(layer)
            if g is not None:
                self._shared_grads[layer.index] = (layer, g)
        self.distributor.begin_share(list(self._shared_grads))  # type: ignore[attr-defined]

    def _gather_preconditioned(self) -> None:
        """Distributed preconditioning: every exchanged layer's P from its owner (the owner's own tensor here)."""
        shared = self.distributor.finish_share()  # type: ignore[attr-defined]
        for index, p in shared.items():
            if p is not None and index not in self._preconditioned:
                layer, g = self._shared_grads[index]
                self._preconditioned[index] = (layer, p, g.to(self.inv_dtype))
        self._shared_grads = {}

    def _precondition(self, k: int) -> None:
        for layer in self.layers.values():
            self._precondition_layer(layer)
        if self._owners is not None:
            self._gather_preconditioned()
        done, self._preconditioned = self._preconditioned, {}
        if not done:
            return
        # Layer order, not arrival order: the KL sum must add up in the same order on every rank
        # (arrival order depends on which inverses a rank owns), or the replicas drift apart.
        todo, precs, grads = zip(*(done[i] for i in sorted(done)))
        if self.options.grafting is not None:
            states = ([self._graft_states.setdefault(ly.index, AdamGraftState()) for ly in todo]
                      if self.options.grafting == "adam" else None)
            beta2, eps = self._graft_hparams
            precs = tuple(graft(self.options.grafting, precs, grads, states, beta2, eps))
        scale = None
        if self.kl_clip is not None:
            scale = self._kl_scale(k, todo, precs, grads)
        for layer, p in zip(todo, precs):
            layer.helper.write_grad(p, scale, self._grads)

    def _kl_scale(self, k: int, layers: tuple[KFACLayer, ...], precs: tuple[torch.Tensor, ...],
                  grads: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """nu = min(1, sqrt(kl_clip / sum_l lr_l^2 p_l.g_l)), each layer at its own learning rate; no host sync.

        In float64: an extreme learning rate (1e20) squared overflows float32 to inf, which would
        clip the update to zero instead of bounding it.
        """
        assert self.kl_clip is not None  # (called only with the clip on)
        kl_clip = val.resolve("kl_clip", self.kl_clip, k, val.POSITIVE)
        dots = torch.stack([torch.vdot(p.flatten(), g.flatten()) for p, g in zip(precs, grads)]).double()
        # Gradients still carrying a loss scale S give S^2 times the true p.g.
        unscale = 1.0 / self.grad_access.loss_scale() ** 2
        if self.lr is not None or self._stepping is None:
            assert self.lr is not None  # step() refused a step with neither
            lr = val.resolve("lr", self.lr, k, val.NONNEGATIVE)
            vg = dots.sum().abs() * (lr * lr * unscale)
        else:
            lrs = self._stepping
            weights = torch.tensor([lrs[ly.index] ** 2 * unscale for ly in layers], dtype=torch.float64,
                                   device=dots.device)
            vg = (dots * weights).sum().abs()
        # vg == 0 (lr 0, zero gradients) gives inf -> 1.
        return torch.sqrt(kl_clip / vg).clamp(max=1.0).to(precs[0].dtype)

    def _select(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Which layers this step preconditions, at which learning rates (``_stepping``)."""
        if optimizer is None:
            if self.kl_clip is not None and self.lr is None:
                raise ValueError(
                    "KFACPreconditioner: the KL clip needs the learning rate of each step; call "
                    "step(optimizer) with the optimizer about to step (each layer then uses its param group's "
                    "lr), or pass lr= (a number or a callable of the step), or kl_clip=None")
            self._stepping = None
            self._graft_hparams = (DEFAULT_BETA2, DEFAULT_EPS)
            return
        if self.options.grafting == "adam":  # Adam's beta2 and eps, when the optimizer has them
            group0 = optimizer.param_groups[0] if getattr(optimizer, "param_groups", None) else {}
            betas, eps = group0.get("betas"), group0.get("eps")
            self._graft_hparams = ((float(betas[1]), float(eps)) if isinstance(betas, (tuple, list)) and eps is not None
                                   else (DEFAULT_BETA2, DEFAULT_EPS))
        groups = self._step_groups.get(id(optimizer))
        if groups is None or not groups.current(optimizer):
            layers = [(ly.index, ly.name, ly.helper.params()) for ly in self.layers.values()]
            groups = self._step_groups[id(optimizer)] = step_groups(optimizer, layers)
        self._stepping = groups.lrs()

    def _prepare_step_size(self, optimizer: torch.optim.Optimizer | None, loss_parts: LossParts | None) -> None:
        assert self.step_size is not None
        if optimizer is None:
            raise ValueError(f"step_size={self.step_size.mode!r} / adapt_damping={self.step_size.adapt_damping} work on "
                             "the optimizer's update after it steps: call step(optimizer, loss_parts=...) with the "
                             "optimizer about to step, or set step_size=None and adapt_damping=False")
        damping = val.resolve("damping", self.damping, self.steps, val.NONNEGATIVE)
        self.step_size.prepare(self.model, optimizer, self.steps, damping, loss_parts,
                               self.grad_access.loss_scale(), self.distributor.world_size, self._hooks_paused)

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
            for layer in self.layers.values():
                # Calls of one micro-batch: the count that makes a factor final when pipelining.
                if layer.a_calls and layer.mb_a_calls == layer.mb_g_calls:
                    layer.calls_per_micro_batch = layer.mb_a_calls
        if self._owners is not None:
            self._begin_share()
        self._update_inverses(k)
        with self.timer.phase("precondition"):
            self._precondition(k)
        if not self._grads_finite:
            self.skipped_precondition_steps += 1
        self.grad_access.close(self._grads)
        self._grads = {}
        self.timer.end_step()
        self._drop_collected()
        self.steps += 1
        self._begin_step()
