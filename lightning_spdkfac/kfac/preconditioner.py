"""KFACPreconditioner: the single-process K-FAC state machine.

Usage (plain PyTorch)::

    pre = KFACPreconditioner(model, lr=lambda step: opt.param_groups[0]["lr"])
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        pre.step()          # rewrites .grad of the registered layers in place
        opt.step()

One optimizer step is: hooks collect factor statistics during forward/backward (on factor steps)
-> ``step()`` turns them into this step's factors, checks they and the gradients are finite,
updates the running averages -> (on inverse steps) damped inverses -> preconditioned gradients
-> KL clip -> written back to ``.grad``. The math is in docs/math.md.
"""

from __future__ import annotations

import logging
import numbers
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from .. import validation as val
from ..telemetry import StepTimer
from .distributor import Distributor, FactorKey, Task
from .gradients import GradAccess
from .inverse import robust_inverses
from .layers import LayerHelper, make_helper

log = logging.getLogger(__name__)

STATE_VERSION = 2  # 2: adds 'layer_dims' (every registered layer and its factor sides)


@dataclass(eq=False)
class KFACLayer:
    """State of one registered layer: this step's accumulators, running factors, inverses."""

    name: str
    helper: LayerHelper
    index: int = 0  # registration order: the order every rank uses for collectives
    # Accumulators of the current optimizer step (sums over micro-batches and calls).
    xx: torch.Tensor | None = None  # sum_r x_r x_r^T (without the bias column)
    x_sum: torch.Tensor | None = None  # sum_r x_r (the bias row/column of A)
    rows: int = 0  # R, rows seen by A
    dd: torch.Tensor | None = None  # sum_r d_r d_r^T
    examples: int = 0  # N, examples seen (counted once per micro-batch, not per call)
    a_calls: int = 0
    g_calls: int = 0
    last_micro_batch: int = -1
    ran: bool = False  # forward ran in training mode since the last step
    # Training-mode forwards without grad since the last step: the first pass of reentrant activation
    # checkpointing, whose recomputation during backward then counts (see _make_forward_hook).
    nograd_calls: int = 0
    # Pipelining: calls in the current micro-batch, the count that makes a factor final
    # (learned from the previous step), and what was handed to the distributor.
    mb_a_calls: int = 0
    mb_g_calls: int = 0
    calls_per_micro_batch: int = 0
    submitted: dict = field(default_factory=dict)  # "A"/"G" -> calls counted at submission
    # Running averages and inverses.
    A: torch.Tensor | None = None
    G: torch.Tensor | None = None
    A_inv: torch.Tensor | None = None
    G_inv: torch.Tensor | None = None
    handles: list = field(default_factory=list)

    def reset_accumulators(self) -> None:
        self.rows = self.examples = self.a_calls = self.g_calls = 0
        self.mb_a_calls = self.mb_g_calls = 0
        self.last_micro_batch = -1
        self.ran = False
        self.nograd_calls = 0
        self.submitted.clear()

    def trainable(self) -> bool:
        """Whether all the layer's parameters require grad now (a frozen layer is left alone)."""
        return all(p.requires_grad for p in self.helper.params())

    def step_a(self) -> torch.Tensor:
        """This step's A_new as a new matrix (the distributed path sends it)."""
        n = self.helper.in_features
        if not self.helper.has_bias:
            return self.xx / self.rows
        A = torch.empty(n + 1, n + 1, dtype=self.xx.dtype, device=self.xx.device)
        torch.div(self.xx, self.rows, out=A[:n, :n])
        x_mean = self.x_sum / self.rows
        A[:n, n] = x_mean
        A[n, :n] = x_mean
        A[n, n] = 1.0
        return A

    def step_g(self, g_scale: float) -> torch.Tensor:
        """This step's G_new as a new matrix."""
        return self.dd * (self.examples * g_scale)

    def fold(self, A_new: torch.Tensor, G_new: torch.Tensor, decay: float) -> None:
        """Running averages from explicit step factors (the distributed path)."""
        if self.A is None or self.A.shape != A_new.shape or self.G.shape != G_new.shape or decay == 0.0:
            self.A, self.G = A_new.clone(), G_new.clone()
        else:
            self.A.lerp_(A_new, 1.0 - decay)
            self.G.lerp_(G_new, 1.0 - decay)
        self.flush_subnormals()

    def flush_subnormals(self) -> None:
        """Set running-factor entries below the dtype's smallest normal number to zero.

        An entry that stops receiving contributions (a unit that no longer fires) decays by
        ``factor_decay`` every step and after ~1700 steps at 0.95 becomes a subnormal float, which CPUs
        process one to two orders of magnitude slower; the inverses inherit them. Measured by
        benchmarks/soak.py: the K-FAC step grew from 4 ms to 44 ms over 6000 steps without this. Such an
        entry is below 1.2e-38 (fp32), so zero is exact to the factor's precision. One elementwise pass.
        """
        for t in (self.A, self.G):
            t.masked_fill_(t.abs() < torch.finfo(t.dtype).tiny, 0.0)

    def gram_diagonals(self) -> list[torch.Tensor]:
        """Sums of the diagonals of this step's Gram sums.

        Enough to detect any non-finite value: a NaN or inf in the rows lands on the diagonal,
        and by Cauchy-Schwarz a finite diagonal bounds every off-diagonal entry and the bias sum.
        """
        return [self.xx.diagonal().sum(), self.dd.diagonal().sum()]

    def update_factors(self, decay: float, g_scale: float) -> None:
        """Fold this step's factors into the running averages, in place (see docs/math.md).

        A_new = [[xx, x_sum], [x_sum^T, R]] / R and G_new = N * g_scale * dd. The accumulators
        are scaled in place (they are refilled next step), so no factor-sized temporary is made.
        """
        n = self.helper.in_features
        side = self.helper.a_dim
        first = self.A is None or self.A.shape[0] != side or self.G.shape != self.dd.shape
        if first:
            self.A = torch.empty(side, side, dtype=self.xx.dtype, device=self.xx.device)
            self.G = torch.empty_like(self.dd)
        weight = 1.0 if first else 1.0 - decay
        xx = self.xx.mul_(1.0 / self.rows)
        dd = self.dd.mul_(self.examples * g_scale)
        if self.helper.has_bias:
            x_mean = self.x_sum.mul_(1.0 / self.rows)
            parts = ((self.A[:n, :n], xx), (self.A[:n, n], x_mean), (self.A[n, :n], x_mean), (self.G, dd))
            self.A[n, n] = 1.0  # the mean of the constant 1s, in every step's factor
        else:
            parts = ((self.A, xx), (self.G, dd))
        for running, new in parts:
            if weight == 1.0:
                running.copy_(new)
            else:
                running.lerp_(new, weight)  # decay*F + (1-decay)*F_new in one pass
        self.flush_subnormals()


def _sum32(t: torch.Tensor) -> torch.Tensor:
    """Sum of a tensor, accumulated and returned in at least float32 (an fp16 sum can overflow)."""
    return t.sum() if t.dtype == torch.float64 else t.sum(dtype=torch.float32)


def _describe_bad(bad: dict[str, list[str]]) -> str:
    """``{"net.0": ["activations (A factor)"]}`` -> ``"layer 'net.0': activations (A factor)"``."""
    parts = [f"{name if name.startswith('parameter ') else f'layer {name!r}'}: {', '.join(what)}"
             for name, what in bad.items()]
    return "; ".join(parts) or "no single tensor identified"


# What the preconditioner did instead of Cholesky, per fallback level of kfac.inverse.
# Counters saved with the state (each optional when loading: older states lack some).
_COUNTERS = ("skipped_factor_steps", "skipped_precondition_steps", "consecutive_bad_steps", "inverse_fallbacks")

_FALLBACK_ACTION = {
    "eigh": "using a clamped eigendecomposition (consider a larger damping)",
    "damping": "the clamped eigendecomposition failed too, so this factor was inverted with damping "
               "{damping:g} (raise damping)",
    "identity": "no damped inverse was finite, so this factor uses a scaled identity I / (trace/n + damping), "
                "which drops its curvature (raise damping; check the factor for non-finite values)",
}


def _in_backward() -> bool:
    """Whether autograd is running a backward pass now (activation checkpointing recomputes there)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


def _eager(fn: Callable) -> Callable:
    """``fn`` excluded from torch.compile tracing (run as plain Python; a graph break under compile)."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return fn if disable is None else disable(fn, recursive=True)


def _autocast_off(device_type: str):
    """Autocast disabled for factor statistics (fp32 factors under bf16/fp16 autocast)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return nullcontext()


class KFACPreconditioner:
    """K-FAC for ``nn.Linear`` and ``nn.Conv2d`` layers of a model, usable with any optimizer.

    Args:
        model: the module whose supported layers get K-FAC.
        damping: added to the diagonal of each factor before inversion (>= 0); number or schedule.
        factor_decay: running-average decay of the factors, in [0, 1); 0 uses the current batch alone.
        kl_clip: KL-clip bound (> 0), or None to turn clipping off.
        lr: the learning rate the KL clip assumes: a number or a callable of the step
            (for example one that reads ``optimizer.param_groups[0]["lr"]``).
        factor_update_steps: factors are updated every this many steps.
        inv_update_steps: inverses are recomputed every this many steps.
        skip_layers: regular expressions; a module whose name or class name matches one is skipped.
        factor_dtype: dtype of the stored factors (float32 by default, also under bf16/fp16 autocast).
        inv_dtype: dtype of the inversion and of the preconditioning matmuls (float32 or float64).
        grad_scaler: a ``torch.amp.GradScaler`` in use (fp16): G factors are unscaled with its scale.
            Call ``scaler.unscale_(optimizer)`` before :meth:`step`.
        distributor: where the cross-rank work runs (factor averaging, inverse placement); the
            default is one process. See :mod:`lightning_spdkfac.kfac.distributor`.
        grad_access: where the reduced gradients are read and written; the default is
            ``param.grad`` in place. See :mod:`lightning_spdkfac.kfac.gradients`.
        max_bad_steps: after this many consecutive factor steps skipped for non-finite values
            (activations, output gradients, received factors or gradients), :meth:`step` raises
            a RuntimeError naming the layers and what was non-finite; None never raises. A step
            with non-finite values skips the factor update (the running factors keep their last
            good value) and, where the gradients are non-finite, preconditioning (the optimizer's
            own overflow handling then sees them as they are); ``skipped_factor_steps`` and
            ``skipped_precondition_steps`` count them. The default, 100, leaves room for a dynamic
            fp16 loss scaler (GradScaler, DeepSpeed), which halves its scale on each overflow step
            and so recovers within about 25 consecutive ones even from 2^24, while stopping a run
            whose factors or loss went non-finite for good before it wastes an epoch.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        damping: val.HParam = 1e-3,
        factor_decay: val.HParam = 0.95,
        kl_clip: val.HParam | None = 1e-3,
        lr: val.HParam = 0.1,
        factor_update_steps: int = 1,
        inv_update_steps: int = 10,
        skip_layers: str | Iterable[str] = (),
        factor_dtype: torch.dtype = torch.float32,
        inv_dtype: torch.dtype = torch.float32,
        grad_scaler: torch.amp.GradScaler | None = None,
        distributor: Distributor | None = None,
        grad_access: GradAccess | None = None,
        max_bad_steps: int | None = 100,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if max_bad_steps is not None:
            bad_type = isinstance(max_bad_steps, bool) or not isinstance(max_bad_steps, int)
            if bad_type or max_bad_steps < 1:
                raise (TypeError if bad_type else ValueError)(
                    "max_bad_steps must be None (never raise) or a positive integer (consecutive factor steps "
                    f"with non-finite values before K-FAC raises), got {type(max_bad_steps).__name__} "
                    f"{max_bad_steps!r}"
                )
        self.max_bad_steps = max_bad_steps
        val.check_schedule("damping", damping, val.NONNEGATIVE)
        val.check_schedule("factor_decay", factor_decay, val.DECAY)
        if kl_clip is not None:
            val.check_schedule("kl_clip", kl_clip, val.POSITIVE, " (use kl_clip=None to turn clipping off)")
        val.check_schedule("lr", lr, val.NONNEGATIVE)
        self.factor_update_steps = val.check_positive_int("factor_update_steps", factor_update_steps)
        self.inv_update_steps = val.check_positive_int("inv_update_steps", inv_update_steps)
        if self.inv_update_steps % self.factor_update_steps != 0:
            warnings.warn(
                f"inv_update_steps={inv_update_steps} is not a multiple of factor_update_steps="
                f"{factor_update_steps}: some inverses will be computed from factors a few steps old",
                stacklevel=2,
            )
        for name, dt in (("factor_dtype", factor_dtype), ("inv_dtype", inv_dtype)):
            if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
                raise TypeError(f"{name} must be a floating torch.dtype, got {dt!r}")
        if inv_dtype not in (torch.float32, torch.float64):
            raise ValueError(f"inv_dtype must be torch.float32 or torch.float64, got {inv_dtype}")
        if isinstance(skip_layers, str):
            skip_layers = (skip_layers,)
        try:
            self.skip_layers = tuple(re.compile(p) for p in skip_layers)
        except (TypeError, re.error) as e:
            raise ValueError(f"skip_layers must be regular expressions, got {skip_layers!r}: {e}") from None

        self.model = model
        self.damping = damping
        self.factor_decay = factor_decay
        self.kl_clip = kl_clip
        self.lr = lr
        self.factor_dtype = factor_dtype
        self.inv_dtype = inv_dtype
        self.grad_scaler = grad_scaler
        self.distributor = Distributor() if distributor is None else distributor
        self.grad_access = GradAccess() if grad_access is None else grad_access
        # One process with the base distributor keeps the in-place fast path.
        self._local = type(self.distributor) is Distributor
        # Set False on micro-batches that do not end the optimizer step (gradient accumulation)
        # so that pipelined factor reductions wait for the last one.
        self.final_micro_batch = True
        self._preconditioned: dict[int, tuple] = {}
        self._g_scale_value: float | None = None  # layer index -> (layer, P, grad matrix) of this step
        # Per-phase seconds of the last step in ``timer.last`` (see lightning_spdkfac.telemetry).
        self.timer = StepTimer()
        self.distributor.timer = self.timer

        self.steps = 0  # optimizer steps taken (calls of step())
        self.skipped_factor_steps = 0  # factor updates skipped for non-finite values
        self.skipped_precondition_steps = 0  # steps left unpreconditioned: non-finite gradients
        self.consecutive_bad_steps = 0  # factor steps skipped in a row (max_bad_steps bounds it)
        self.last_bad_step: dict | None = None  # {"step": k, "bad": {where: [what, ...]}} of the last one
        self.inverse_fallbacks = 0  # factor inversions Cholesky could not do (see kfac.inverse)
        self._grads: dict = {}  # parameter -> gradient tensor, while step() runs
        self._grads_finite = True
        self._micro_batch = 0
        self._backward_seen = False
        self._warned: set[tuple[str, str]] = set()
        self.layers: dict[str, KFACLayer] = {}
        self.skipped: dict[str, str] = {}
        self._register(model)
        self._grad_params = [p for ly in self.layers.values() for p in ly.helper.params()]
        kfac_ids = {id(p) for p in self._grad_params}
        self._other_params = [p for p in model.parameters() if id(p) not in kfac_ids]
        self.distributor.inv_dtype = self.inv_dtype
        self.distributor.setup([(ly.helper.a_dim, ly.helper.g_dim) for ly in self.layers.values()])
        self.distributor.begin_step()

    # ------------------------------------------------------------------ registration
    def _register(self, model: nn.Module) -> None:
        seen_types = []
        for name, module in model.named_modules():
            seen_types.append(type(module).__name__)
            helper, reason = make_helper(module)
            if helper is None:
                if reason is not None:
                    self.skipped[name] = reason
                    warnings.warn(f"K-FAC skips layer {name!r}: {reason}", stacklevel=3)
                continue
            cls = type(module).__name__
            if any(p.search(name) or p.search(cls) for p in self.skip_layers):
                self.skipped[name] = "matched skip_layers"
                continue
            if not all(p.requires_grad for p in module.parameters(recurse=False)):
                self.skipped[name] = "parameters do not all require grad"
                continue
            layer = KFACLayer(name=name, helper=helper, index=len(self.layers))
            layer.handles.append(module.register_forward_hook(self._make_forward_hook(layer)))
            self.layers[name] = layer
        if not self.layers:
            found = ", ".join(sorted(set(seen_types)))
            detail = "; ".join(f"{n or '<root>'}: {r}" for n, r in self.skipped.items())
            raise ValueError(
                "KFACPreconditioner found no supported layer (nn.Linear, nn.Conv2d) in model; "
                f"module types found: {found}" + (f"; skipped: {detail}" if detail else "")
            )

    def remove_hooks(self) -> None:
        """Detach all hooks from the model (the preconditioner is unusable afterwards)."""
        for layer in self.layers.values():
            for h in layer.handles:
                h.remove()
            layer.handles.clear()

    @property
    def collecting(self) -> bool:
        """Whether the hooks collect factor statistics for the coming step."""
        return self.steps % self.factor_update_steps == 0

    # ------------------------------------------------------------------ hooks
    def _make_forward_hook(self, layer: KFACLayer) -> Callable:
        def forward_hook(module, inputs, output):
            if not module.training:
                return
            if not torch.is_grad_enabled():
                layer.nograd_calls += 1
                return
            recomputed = _in_backward()
            if recomputed:
                # Activation checkpointing recomputes this forward during backward. Non-reentrant
                # (use_reentrant=False): the first forward already counted the call and hooked its
                # output, whose gradient is the one backward uses; counting it again would double A.
                # Reentrant: the first forward ran without grad; this call is the one backward uses.
                if layer.nograd_calls == 0:
                    return
                layer.nograd_calls -= 1
            if not layer.trainable():  # frozen (requires_grad=False): not collected, not preconditioned
                return
            layer.ran = True
            if not self.collecting or not isinstance(output, torch.Tensor) or not output.requires_grad:
                return
            if self._backward_seen and not recomputed:  # a forward after a backward starts a new micro-batch
                self._micro_batch += 1
                self._backward_seen = False
                for ly in self.layers.values():
                    ly.mb_a_calls = ly.mb_g_calls = 0
            x = inputs[0]
            with self.timer.phase("factor_compute"):
                with _autocast_off(x.device.type):
                    self._accumulate_a(layer, x)
                final = self._pipelining_final(layer, layer.mb_a_calls)
                if final:
                    layer.submitted["A"] = layer.a_calls
                    A_new = layer.step_a()
            output.register_hook(self._make_grad_hook(layer, x))
            if final:
                self.distributor.factor_final(layer.index, "A", A_new)

        # Under torch.compile the hooks run as plain Python (a graph break at each K-FAC layer): traced,
        # K-FAC's bookkeeping would be compiled into graphs guarded on per-layer Python state, with its
        # in-place updates of persistent buffers replayed as side effects.
        return _eager(forward_hook)

    def _make_grad_hook(self, layer: KFACLayer, x: torch.Tensor) -> Callable:
        batch = layer.helper.batch_size(x)
        micro_batch = self._micro_batch

        def grad_hook(grad_output):
            self._backward_seen = True
            with self.timer.phase("factor_compute"):
                with _autocast_off(grad_output.device.type):
                    self._accumulate_g(layer, grad_output, batch, micro_batch)
                final = self._pipelining_final(layer, layer.mb_g_calls)
                if final:
                    layer.submitted["G"] = layer.g_calls
                    G_new = layer.step_g(self._g_scale())
            if final:
                self.distributor.factor_final(layer.index, "G", G_new)

        return _eager(grad_hook)

    def _accumulate_a(self, layer: KFACLayer, x: torch.Tensor) -> None:
        a = layer.helper.a_rows(x.detach()).to(self.factor_dtype)
        if layer.a_calls == 0:
            if layer.xx is None or layer.xx.shape[0] != a.shape[1] or layer.xx.device != a.device:
                layer.xx = torch.empty(a.shape[1], a.shape[1], dtype=self.factor_dtype, device=a.device)
            torch.mm(a.T, a, out=layer.xx)
            layer.x_sum = a.sum(0) if layer.helper.has_bias else None
        else:
            layer.xx.addmm_(a.T, a)
            if layer.helper.has_bias:
                layer.x_sum.add_(a.sum(0))
        layer.rows += a.shape[0]
        layer.a_calls += 1
        layer.mb_a_calls += 1

    def _accumulate_g(self, layer: KFACLayer, grad_output: torch.Tensor, batch: int, micro_batch: int) -> None:
        d = layer.helper.g_rows(grad_output).to(self.factor_dtype)
        if layer.g_calls == 0:
            if layer.dd is None or layer.dd.shape[0] != d.shape[1] or layer.dd.device != d.device:
                layer.dd = torch.empty(d.shape[1], d.shape[1], dtype=self.factor_dtype, device=d.device)
            torch.mm(d.T, d, out=layer.dd)
        else:
            layer.dd.addmm_(d.T, d)
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
    def _warn_once(self, layer: str, key: str, message: str) -> None:
        if (layer, key) not in self._warned:
            self._warned.add((layer, key))
            warnings.warn(message, stacklevel=3)

    def _collected_layers(self) -> list[KFACLayer]:
        ready = []
        for layer in self.layers.values():
            if layer.a_calls == 0 and layer.g_calls == 0:
                continue
            if layer.a_calls != layer.g_calls or layer.rows == 0:
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

    def _grad_sums(self) -> list[torch.Tensor]:
        """One scalar per gradient, non-finite exactly where the gradient holds an inf or NaN."""
        sums = [_sum32(g) for g in self._grads.values() if g is not None]
        sums += [_sum32(p.grad) for p in self._other_params if p.grad is not None]
        return sums

    def _finite(self, extra: list[torch.Tensor]) -> tuple[bool, bool]:
        """One host sync: (are all gradients finite, are all the ``extra`` scalars finite)."""
        sums = self._grad_sums()
        n = len(sums)
        if not sums and not extra:
            return True, True
        ok = torch.isfinite(torch.stack([s.float() for s in sums + list(extra)]))
        grads_ok, extra_ok = torch.stack([ok[:n].all(), ok[n:].all()]).tolist()
        return grads_ok, extra_ok

    def _check_finite(self, extra: list[torch.Tensor], labels: list[tuple[KFACLayer, str, bool]]) -> bool:
        """Whether this step may update the factors; notes non-finite gradients for the step.

        ``labels[i]`` is ``(layer, "A" or "G", received)`` for ``extra[i]``, used only on a bad step
        to say where the non-finite values are. Raises after ``max_bad_steps`` bad steps in a row.
        """
        grads_ok, extra_ok = self._finite(extra)
        if not grads_ok:
            # The optimizer's own overflow handling (GradScaler, DeepSpeed) sees the gradients as
            # they are: preconditioning would only spread the inf/NaN over every entry.
            self._grads_finite = False
        if grads_ok and extra_ok:
            self.consecutive_bad_steps = 0
            return True
        self.skipped_factor_steps += 1
        self.consecutive_bad_steps += 1
        bad = self._blame(extra, labels)  # off the healthy path: one more host sync
        self.last_bad_step = {"step": self.steps, "bad": bad}
        where = _describe_bad(bad)
        only_grads = all(what == ["gradient"] for what in bad.values())
        # A gradient overflow alone is routine under a dynamic fp16 loss scale: info, not warning.
        log.log(
            logging.INFO if only_grads else logging.WARNING,
            "K-FAC step %d: non-finite values (%s); factor update skipped%s (%d in a row, %d in all)",
            self.steps, where, "" if grads_ok else " and gradients left unpreconditioned",
            self.consecutive_bad_steps, self.skipped_factor_steps,
        )
        if self.max_bad_steps is not None and self.consecutive_bad_steps >= self.max_bad_steps:
            raise RuntimeError(
                f"K-FAC: {self.consecutive_bad_steps} consecutive factor steps had non-finite values "
                f"(max_bad_steps={self.max_bad_steps}), so their factor updates were skipped; at step "
                f"{self.steps}: {where}. Training has diverged or the data holds NaN/Inf: lower the "
                "learning rate, raise damping, use loss scaling (a GradScaler / fp16 loss scale) or bf16, "
                "and check the input data; max_bad_steps=None disables this error"
            )
        return False

    def _blame(self, extra: list[torch.Tensor], labels: list[tuple[KFACLayer, str, bool]]) -> dict[str, list[str]]:
        """Where the non-finite values of a bad step are: {layer or parameter: [what, ...]}.

        Layers in registration order (their factors, then their gradient), then other parameters.
        """
        places: list[tuple[str, object]] = [(layer.name, (which, received, layer)) for layer, which, received in labels]
        scalars: list[torch.Tensor] = list(extra)
        for layer in self.layers.values():
            for p in layer.helper.params():
                g = self._grads.get(p)
                if g is not None:
                    places.append((layer.name, "gradient"))
                    scalars.append(_sum32(g))
        names = {id(p): n for n, p in self.model.named_parameters()}
        for p in self._other_params:
            if p.grad is not None:
                places.append((f"parameter {names.get(id(p), '?')!r}", "gradient"))
                scalars.append(_sum32(p.grad))
        ok = torch.isfinite(torch.stack([s.float() for s in scalars])).tolist() if scalars else []
        found: dict[str, list[str]] = {}
        for (name, what), fine in zip(places, ok):
            if fine:
                continue
            if isinstance(what, tuple):
                what = self._factor_blame(*what)
            if what not in found.setdefault(name, []):
                found[name].append(what)
        order = {name: i for i, name in enumerate(self.layers)}
        return dict(sorted(found.items(), key=lambda kv: order.get(kv[0], len(order))))

    @staticmethod
    def _factor_blame(which: str, received: bool, layer: KFACLayer) -> str:
        kind = "activations (A factor)" if which == "A" else "output gradients (G factor)"
        if not received:
            return kind
        # A reduced factor: non-finite here already, or only after the reduction over ranks?
        local, calls = (layer.xx, layer.a_calls) if which == "A" else (layer.dd, layer.g_calls)
        if calls and local is not None and not bool(torch.isfinite(local.diagonal().sum())):
            return f"{kind} on this rank"
        return f"received {which} factor (non-finite after the reduction over ranks)"

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
        if not ready:
            return
        # Reduced factors and DDP-averaged gradients are identical on every rank: so is this test.
        diagonals = [m.diagonal().sum() for _, A, G in ready for m in (A, G)]
        labels = [(layer, which, True) for layer, _, _ in ready for which in ("A", "G")]
        if not self._check_finite(diagonals, labels):
            return
        decay = val.resolve("factor_decay", self.factor_decay, k, val.DECAY)
        for layer, A, G in ready:
            layer.fold(A, G, decay)

    def _update_inverses(self, k: int) -> None:
        due = k % self.inv_update_steps == 0
        todo = [ly for ly in self.layers.values() if ly.A is not None and (due or ly.A_inv is None)]
        if not todo:
            return
        damping = val.resolve("damping", self.damping, k, val.NONNEGATIVE)
        by_index = {ly.index: ly for ly in todo}

        def invert(tasks: list[Task]) -> list[torch.Tensor]:
            with self.timer.phase("inverse_compute"):
                inverses, fallbacks = robust_inverses([t[2] for t in tasks], damping, self.inv_dtype)
            self.inverse_fallbacks += len(fallbacks)
            for fb in fallbacks:
                index, which, _ = tasks[fb.index]
                name = by_index[index].name
                self._warn_once(
                    name,
                    f"inverse-{fb.level}",
                    f"K-FAC layer {name!r}: Cholesky of the damped {which} factor failed at step {k} "
                    f"(damping {damping:g}): {fb.reason}; " + _FALLBACK_ACTION[fb.level].format(damping=fb.damping),
                )
            return inverses

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

    def _precondition_layer(self, layer: KFACLayer) -> None:
        """P = G_inv [dW, db] A_inv for one layer, kept until the KL clip of the step is known."""
        if layer.index in self._preconditioned or not layer.ran or layer.A_inv is None or not self._grads_finite:
            return
        if not layer.trainable():  # frozen after its forward: its (stale or absent) gradient is left as is
            return
        g = layer.helper.grad_matrix(self._grads)
        if g is None:
            return
        if layer.A_inv.shape[0] != g.shape[1] or layer.G_inv.shape[0] != g.shape[0]:
            return  # the layer changed shape since its factors were taken
        gi = g.to(self.inv_dtype)
        self._preconditioned[layer.index] = (layer, layer.G_inv @ gi @ layer.A_inv, gi)

    def _precondition(self, k: int) -> None:
        for layer in self.layers.values():
            self._precondition_layer(layer)
        done, self._preconditioned = self._preconditioned, {}
        if not done:
            return
        # Layer order, not arrival order: the KL sum must add up in the same order on every rank
        # (arrival order depends on which inverses a rank owns), or the replicas drift apart.
        todo, precs, grads = zip(*(done[i] for i in sorted(done)))
        scale = None
        if self.kl_clip is not None:
            kl_clip = val.resolve("kl_clip", self.kl_clip, k, val.POSITIVE)
            lr = val.resolve("lr", self.lr, k, val.NONNEGATIVE)
            vg = torch.stack([torch.vdot(p.flatten(), g.flatten()) for p, g in zip(precs, grads)]).sum()
            # Gradients still carrying a loss scale S give S^2 times the true vg.
            vg = vg.abs() * (lr * lr / self.grad_access.loss_scale() ** 2)
            # nu = min(1, sqrt(kl_clip / |vg|)); vg == 0 gives inf -> 1. No host sync.
            scale = torch.sqrt(kl_clip / vg).clamp(max=1.0)
        for layer, p in zip(todo, precs):
            layer.helper.write_grad(p, scale, self._grads)

    @torch.no_grad()
    def step(self) -> None:
        """Precondition the gradients of the registered layers in place (call after backward)."""
        k = self.steps
        self._grads = self.grad_access.open(self._grad_params)
        self._grads_finite = True
        if self.collecting:
            if self._local:
                with self.timer.phase("factor_update"):
                    self._update_factors(k)
            else:
                self._update_factors_distributed(k)
            for layer in self.layers.values():
                # Calls of one micro-batch: the count that makes a factor final when pipelining.
                if layer.a_calls and layer.mb_a_calls == layer.mb_g_calls:
                    layer.calls_per_micro_batch = layer.mb_a_calls
        self._update_inverses(k)
        with self.timer.phase("precondition"):
            self._precondition(k)
        if not self._grads_finite:
            self.skipped_precondition_steps += 1
        self.grad_access.close(self._grads)
        self._grads = {}
        self.timer.end_step()
        for layer in self.layers.values():
            layer.reset_accumulators()
        self._micro_batch = 0
        self._backward_seen = False
        self._g_scale_value = None
        self.steps += 1
        self.distributor.begin_step()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Everything the next step needs: counters, running factors and current inverses.

        ``layer_dims`` names every registered layer with its factor sides ``[A, G]``, layers without
        factors yet included, so that :meth:`load_state_dict` recognizes a state of another model.
        """
        layers = {}
        for name, ly in self.layers.items():
            if ly.A is None:
                continue
            layers[name] = {"A": ly.A, "G": ly.G, "A_inv": ly.A_inv, "G_inv": ly.G_inv}
        return {
            "version": STATE_VERSION,
            "steps": self.steps,
            "skipped_factor_steps": self.skipped_factor_steps,
            # optional counters (older states lack them): a resumed run continues the same counts, and
            # max_bad_steps sees a bad streak that spans the checkpoint
            "skipped_precondition_steps": self.skipped_precondition_steps,
            "consecutive_bad_steps": self.consecutive_bad_steps,
            "inverse_fallbacks": self.inverse_fallbacks,
            "layer_dims": {name: [ly.helper.a_dim, ly.helper.g_dim] for name, ly in self.layers.items()},
            "layers": layers,
        }

    def check_state_dict(self, state: Mapping) -> None:
        """Raise the ValueError :meth:`load_state_dict` would raise for ``state``; change nothing."""
        self._verify_state(state)

    def load_state_dict(self, state: Mapping) -> None:
        """Restore :meth:`state_dict`.

        Everything is verified before anything changes: a state of another model (layers missing or
        unexpected, other factor shapes) or a corrupt one (missing keys, wrong types, non-tensor
        entries, tensors of the wrong shape or dtype, non-finite values, a version from a newer
        release) raises one ValueError listing every problem, and the preconditioner is left exactly
        as it was. Registered layers without factors in the state start without factors.
        """
        factors = self._verify_state(state)
        loaded = {}  # converted first: nothing is assigned unless every tensor converted
        for name, (A, G, A_inv, G_inv) in factors.items():
            dev = self.layers[name].helper.module.weight.device
            loaded[name] = (
                A.to(device=dev, dtype=self.factor_dtype).clone(),
                G.to(device=dev, dtype=self.factor_dtype).clone(),
                None if A_inv is None else A_inv.to(device=dev, dtype=self.inv_dtype).clone(),
                None if G_inv is None else G_inv.to(device=dev, dtype=self.inv_dtype).clone(),
            )
        for name, layer in self.layers.items():
            layer.A, layer.G, layer.A_inv, layer.G_inv = loaded.get(name, (None, None, None, None))
        self.steps = int(state["steps"])
        for key in _COUNTERS:
            setattr(self, key, int(state.get(key, 0)))

    def _verify_state(self, state: Mapping) -> dict[str, tuple]:
        """The factors of ``state`` by layer name, or a ValueError listing every problem found."""
        if not isinstance(state, Mapping):
            raise ValueError(f"not a KFACPreconditioner state dict: got a {type(state).__name__}. " + _SKIP_HINT)
        missing_keys = [k for k in ("version", "steps", "layers") if k not in state]
        if missing_keys:
            raise ValueError(
                f"not a KFACPreconditioner state dict (missing {', '.join(map(repr, missing_keys))}; "
                f"keys found: {', '.join(map(repr, list(state)[:10])) or 'none'}). " + _SKIP_HINT
            )
        corrupt: list[str] = []
        mismatch: list[str] = []
        version = state["version"]
        if not _is_count(version) or version < 1:
            corrupt.append(f"'version' must be a positive integer, got {version!r}")
        elif version > STATE_VERSION:
            raise ValueError(
                f"K-FAC state version {version} was written by a newer lightning-spdkfac; this one reads "
                f"versions up to {STATE_VERSION}: upgrade lightning-spdkfac. " + _SKIP_HINT
            )
        for key in ("steps",) + _COUNTERS:
            if key in state and not _is_count(state[key]):
                corrupt.append(f"{key!r} must be a non-negative integer, got {state[key]!r}")

        # Which layers the state was saved for: 'layer_dims' (version 2), else the layers with factors.
        dims = None
        if "layer_dims" in state:
            dims = _layer_dims(state["layer_dims"], corrupt)
        elif _is_count(version) and version >= 2:
            corrupt.append("missing 'layer_dims' (every version-2 state has it)")
        layers = state["layers"]
        if not isinstance(layers, Mapping):
            corrupt.append(f"'layers' must be a dict of layer name -> factors, got a {type(layers).__name__}")
            layers = {}
        saved_names = list(dims) if dims is not None else [n for n in layers if isinstance(n, str)]
        for name in saved_names:
            if name not in self.layers:
                why = f" (skipped here: {self.skipped[name]})" if name in self.skipped else ""
                mismatch.append(f"unexpected layer {name!r}: in the state, not a K-FAC layer of this model{why}")
        if dims is not None:
            for name in self.layers:
                if name not in dims:
                    mismatch.append(f"missing layer {name!r}: a K-FAC layer of this model, absent from the state")

        factors: dict[str, tuple] = {}
        for name, entry in layers.items():
            sides = _layer_factors(name, entry, corrupt)
            if sides is None:
                continue
            if not isinstance(name, str):
                continue  # reported by _layer_factors
            if dims is not None and name not in dims:
                corrupt.append(f"layer {name!r} has factors but is not listed in 'layer_dims'")
                continue
            if dims is not None and dims[name] != sides[0]:
                corrupt.append(f"layer {name!r}: factor sides {sides[0]} disagree with 'layer_dims' {dims[name]}")
                continue
            layer = self.layers.get(name)
            if layer is None:
                continue  # listed above as unexpected
            want = (layer.helper.a_dim, layer.helper.g_dim)
            if sides[0] != want:
                (a, g), (wa, wg) = sides[0], want
                mismatch.append(f"{name!r}: factor shapes ({a}, {a}), ({g}, {g}); this model needs "
                                f"({wa}, {wa}), ({wg}, {wg})")
                continue
            factors[name] = sides[1]
        if dims is not None:  # layers saved before they had factors: their sides must match too
            for name, (a, g) in dims.items():
                layer = self.layers.get(name)
                if layer is None or name in layers:
                    continue
                wa, wg = layer.helper.a_dim, layer.helper.g_dim
                if (a, g) != (wa, wg):
                    mismatch.append(f"{name!r}: factor shapes ({a}, {a}), ({g}, {g}) (no factors yet); "
                                    f"this model needs ({wa}, {wa}), ({wg}, {wg})")
        if mismatch or corrupt:
            what = " and ".join(w for w, p in (("does not match this model", mismatch), ("is corrupt", corrupt)) if p)
            lines = mismatch + corrupt
            raise ValueError(
                f"K-FAC state {what} ({len(lines)} problem{'s' if len(lines) > 1 else ''}); nothing was "
                "loaded:\n  " + "\n  ".join(lines) + "\n" + _SKIP_HINT
            )
        return factors


_SKIP_HINT = (
    "To start K-FAC fresh instead (the rest of a Lightning checkpoint still loads), pass "
    "KFAC(load_state=\"skip\") to the Lightning callback, or do not call load_state_dict in plain PyTorch."
)


def _is_count(value) -> bool:
    """A non-negative integer (not a bool)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


def _layer_dims(dims, corrupt: list[str]) -> dict[str, tuple[int, int]] | None:
    """``layer_dims`` as {name: (A side, G side)}; None (and a problem noted) if malformed."""
    if not isinstance(dims, Mapping):
        corrupt.append(f"'layer_dims' must be a dict of layer name -> [A side, G side], got a {type(dims).__name__}")
        return None
    out = {}
    for name, d in dims.items():
        if (
            not isinstance(name, str) or not isinstance(d, (list, tuple)) or len(d) != 2
            or not all(_is_count(v) and v > 0 for v in d)
        ):
            corrupt.append(f"'layer_dims' entry {name!r}: expected [A side, G side] (positive integers), got {d!r}")
            return None
        out[name] = (int(d[0]), int(d[1]))
    return out


def _layer_factors(name, entry, corrupt: list[str]):
    """((A side, G side), (A, G, A_inv, G_inv)) of one saved layer, or None with the problems noted."""
    if not isinstance(name, str):
        corrupt.append(f"layer names must be strings, got {name!r}")
        return None
    keys = ("A", "G", "A_inv", "G_inv")
    if not isinstance(entry, Mapping) or set(entry) != set(keys):
        got = sorted(map(str, entry)) if isinstance(entry, Mapping) else type(entry).__name__
        corrupt.append(f"layer {name!r}: expected a dict with keys {list(keys)}, got {got}")
        return None
    ok = True
    for key in keys:
        t = entry[key]
        if t is None and key.endswith("_inv"):
            continue
        if not isinstance(t, torch.Tensor):
            corrupt.append(f"layer {name!r}: {key} must be a tensor, got a {type(t).__name__}")
            ok = False
        elif not t.is_floating_point():
            corrupt.append(f"layer {name!r}: {key} must be a floating-point tensor, got dtype {t.dtype}")
            ok = False
        elif t.dim() != 2 or t.shape[0] != t.shape[1] or t.shape[0] == 0:
            corrupt.append(f"layer {name!r}: {key} must be a square matrix, got shape {tuple(t.shape)}")
            ok = False
        elif not bool(torch.isfinite(t).all()):
            corrupt.append(f"layer {name!r}: {key} has non-finite values (inf or NaN)")
            ok = False
    if not ok:
        return None
    A, G, A_inv, G_inv = (entry[k] for k in keys)
    if (A_inv is None) != (G_inv is None):
        corrupt.append(f"layer {name!r}: A_inv and G_inv must both be tensors or both None")
        return None
    if A_inv is not None and (A_inv.shape != A.shape or G_inv.shape != G.shape):
        corrupt.append(f"layer {name!r}: inverse shapes {tuple(A_inv.shape)}, {tuple(G_inv.shape)} differ from "
                       f"factor shapes {tuple(A.shape)}, {tuple(G.shape)}")
        return None
    return (A.shape[0], G.shape[0]), (A, G, A_inv, G_inv)
