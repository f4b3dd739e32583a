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

import re
import warnings
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from ..telemetry import StepTimer
from . import hparams as hp
from .distributor import Distributor, FactorKey, Task
from .gradients import GradAccess
from .inverse import damped_inverses
from .layers import LayerHelper, make_helper

STATE_VERSION = 1


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
        self.submitted.clear()

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
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        damping: hp.Schedule = 1e-3,
        factor_decay: hp.Schedule = 0.95,
        kl_clip: hp.Schedule | None = 1e-3,
        lr: hp.Schedule = 0.1,
        factor_update_steps: int = 1,
        inv_update_steps: int = 10,
        skip_layers: str | Iterable[str] = (),
        factor_dtype: torch.dtype = torch.float32,
        inv_dtype: torch.dtype = torch.float32,
        grad_scaler: torch.amp.GradScaler | None = None,
        distributor: Distributor | None = None,
        grad_access: GradAccess | None = None,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        hp.check_schedule("damping", damping, hp.NONNEGATIVE)
        hp.check_schedule("factor_decay", factor_decay, hp.DECAY)
        if kl_clip is not None:
            hp.check_schedule("kl_clip", kl_clip, hp.POSITIVE, " (use kl_clip=None to turn clipping off)")
        hp.check_schedule("lr", lr, hp.NONNEGATIVE)
        self.factor_update_steps = hp.check_positive_int("factor_update_steps", factor_update_steps)
        self.inv_update_steps = hp.check_positive_int("inv_update_steps", inv_update_steps)
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
            if not module.training or not torch.is_grad_enabled():
                return
            layer.ran = True
            if not self.collecting or not isinstance(output, torch.Tensor) or not output.requires_grad:
                return
            if self._backward_seen:  # a forward after a backward starts a new micro-batch
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

        return forward_hook

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

        return grad_hook

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

    def _finite(self, extra: list[torch.Tensor]) -> tuple[bool, bool]:
        """One host sync: (are all gradients finite, are all the ``extra`` scalars finite)."""
        sums = [g.sum() for g in self._grads.values() if g is not None]
        sums += [p.grad.sum() for p in self._other_params if p.grad is not None]
        n = len(sums)
        if not sums and not extra:
            return True, True
        ok = torch.isfinite(torch.stack([s.float() for s in sums + list(extra)]))
        grads_ok, extra_ok = torch.stack([ok[:n].all(), ok[n:].all()]).tolist()
        return grads_ok, extra_ok

    def _check_finite(self, extra: list[torch.Tensor]) -> bool:
        """Whether this step may update the factors; notes non-finite gradients for the step."""
        grads_ok, extra_ok = self._finite(extra)
        if not grads_ok:
            # The optimizer's own overflow handling (GradScaler, DeepSpeed) sees the gradients as
            # they are: preconditioning would only spread the inf/NaN over every entry.
            self._grads_finite = False
        if grads_ok and extra_ok:
            return True
        self.skipped_factor_steps += 1
        return False

    def _update_factors(self, k: int) -> None:
        ready = self._collected_layers()
        if not ready:
            return
        g_scale = self._g_scale()
        if not self._check_finite([d for layer in ready for d in layer.gram_diagonals()]):
            return
        decay = hp.resolve("factor_decay", self.factor_decay, k, hp.DECAY)
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
        if not self._check_finite(diagonals):
            return
        decay = hp.resolve("factor_decay", self.factor_decay, k, hp.DECAY)
        for layer, A, G in ready:
            layer.fold(A, G, decay)

    def _update_inverses(self, k: int) -> None:
        due = k % self.inv_update_steps == 0
        todo = [ly for ly in self.layers.values() if ly.A is not None and (due or ly.A_inv is None)]
        if not todo:
            return
        damping = hp.resolve("damping", self.damping, k, hp.NONNEGATIVE)
        by_index = {ly.index: ly for ly in todo}

        def invert(tasks: list[Task]) -> list[torch.Tensor]:
            with self.timer.phase("inverse_compute"):
                inverses, failed = damped_inverses([t[2] for t in tasks], damping, self.inv_dtype)
            for i in failed:
                index, which, _ = tasks[i]
                name = by_index[index].name
                self._warn_once(
                    name,
                    "eigh",
                    f"K-FAC layer {name!r}: Cholesky of the damped {which} factor failed at step {k}; "
                    "using a clamped eigendecomposition (consider a larger damping)",
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
            kl_clip = hp.resolve("kl_clip", self.kl_clip, k, hp.POSITIVE)
            lr = hp.resolve("lr", self.lr, k, hp.NONNEGATIVE)
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
        """Everything the next step needs: counters, running factors and current inverses."""
        layers = {}
        for name, ly in self.layers.items():
            if ly.A is None:
                continue
            layers[name] = {"A": ly.A, "G": ly.G, "A_inv": ly.A_inv, "G_inv": ly.G_inv}
        return {
            "version": STATE_VERSION,
            "steps": self.steps,
            "skipped_factor_steps": self.skipped_factor_steps,
            "layers": layers,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; refuses, without changing anything, a state of another model."""
        if not isinstance(state, dict) or "layers" not in state or "steps" not in state:
            raise ValueError("not a KFACPreconditioner state dict (missing 'steps' or 'layers')")
        problems = []
        for name, s in state["layers"].items():
            layer = self.layers.get(name)
            if layer is None:
                problems.append(f"{name!r}: not a K-FAC layer of this model")
                continue
            want = (layer.helper.a_dim, layer.helper.g_dim)
            got = (tuple(s["A"].shape), tuple(s["G"].shape))
            if got != ((want[0], want[0]), (want[1], want[1])):
                problems.append(f"{name!r}: factor shapes {got[0]}, {got[1]}; this model needs "
                                f"({want[0]}, {want[0]}), ({want[1]}, {want[1]})")
        if problems:
            raise ValueError("K-FAC state does not match this model:\n  " + "\n  ".join(problems))
        for layer in self.layers.values():
            s = state["layers"].get(layer.name)
            dev = layer.helper.module.weight.device
            if s is None:
                layer.A = layer.G = layer.A_inv = layer.G_inv = None
                continue
            layer.A = s["A"].to(device=dev, dtype=self.factor_dtype).clone()
            layer.G = s["G"].to(device=dev, dtype=self.factor_dtype).clone()
            inv = (s["A_inv"], s["G_inv"])
            layer.A_inv, layer.G_inv = (
                (None, None) if inv[0] is None else
                tuple(t.to(device=dev, dtype=self.inv_dtype).clone() for t in inv)
            )
        self.steps = int(state["steps"])
        self.skipped_factor_steps = int(state.get("skipped_factor_steps", 0))
