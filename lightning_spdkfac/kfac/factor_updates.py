"""The factor statistics of the preconditioner: the hooks that collect them during forward and backward (sent to the
distributor as soon as a factor is final, when factors are pipelined), and the factor update of a step, where they
become this step's factors, are checked for non-finite values and are folded into the running averages (locally, or
averaged over ranks by the distributor).

:class:`FactorStatistics` is a part of :class:`~lightning_spdkfac.kfac.KFACPreconditioner` that owns the state of the
statistics between steps (the micro-batch count, the loss scale of the step, the function capture).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .. import validation as val
from . import factors
from .capture import FunctionCapture
from .core import Core
from .distributor import FactorKey, ReducedFactors
from .forward_check import ForwardMismatch
from .guard import NonFiniteGuard, StepGrads
from .hook_tools import autocast_off, eager, in_backward
from .layer_state import KFACLayer
from .layers import LayerHelper


class FactorStatistics:
    """A part of the preconditioner that owns the collection of factor statistics (the hooks' state between steps)
    and turns them into factors at the step."""

    def __init__(self, core: Core, guard: NonFiniteGuard, grad_scaler: torch.amp.GradScaler | None) -> None:
        self.core = core
        self.guard = guard
        self.grad_scaler = grad_scaler
        # Set False on micro-batches that do not end the optimizer step (gradient accumulation) so that pipelined
        # factor reductions wait for the last one.
        self.final_micro_batch = True
        self._micro_batch = 0
        self._backward_seen = False
        self._g_scale_value: float | torch.Tensor | None = None
        # Layers used through functions (kfac/capture.py): active only around the modules of watched weights.
        self.capture = FunctionCapture(core.model, self._on_call)

    # ------------------------------------------------------------------ hooks
    def forward_hook(self, layer: KFACLayer,
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
        if self.core.paused or not torch.is_grad_enabled() or not layer.trainable():  # frozen: not collected
            return
        if not self.core.collecting or not output.requires_grad or layer.refused is not None:
            return
        # A forward during backward is activation checkpointing's recomputation. Non-reentrant
        # (use_reentrant=False): the first forward was counted and its output's gradient is the one backward
        # uses; this output gets none. Reentrant: the first forward ran without grad; this output is the one
        # backward differentiates.
        recomputed = in_backward()
        if self._backward_seen and not recomputed:  # a forward after a backward starts a new micro-batch
            self._micro_batch += 1
            self._backward_seen = False
            for ly in self.core.layers.values():
                ly.mb_a_calls = ly.mb_g_calls = 0
        # Before either path below: a module in eval mode (a frozen-BatchNorm backbone) or recomputed is
        # collected too, and must be checked like one in train mode.
        if helper.needs_check:  # a module whose forward may not be what its attributes say (kfac/conv.py)
            try:
                helper.check_forward(layer.name, x, output)
            except ForwardMismatch as e:  # that layer is refused (named, left to the optimizer); the run goes on
                layer.refused = str(e)
                self.core.unfactored[layer.name] = layer.refused
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
        with self.core.timer.phase("factor_compute"):
            with autocast_off(x.device.type):
                self._accumulate_a(layer, helper, x)
            if not self._pipelining_final(layer, layer.mb_a_calls):
                return
            layer.submitted["A"] = layer.a_calls
            A_new = layer.step_a() if layer.rows else None  # empty input: no data from this rank, not 0/0
        self.core.distributor.factor_final(layer.index, "A", A_new)

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
            with self.core.timer.phase("factor_compute"):
                with autocast_off(grad_output.device.type):
                    self._accumulate_g(layer, helper, grad_output, batch, micro_batch)
                final = self._pipelining_final(layer, layer.mb_g_calls)
                if final:
                    layer.submitted["G"] = layer.g_calls
                    # No rows this step (an empty input): no data from this rank, not 0/0.
                    G_new = layer.step_g(self._g_scale()) if layer.rows else None
            if final:
                self.core.distributor.factor_final(layer.index, "G", G_new)

        return eager(grad_hook)

    def _rows_dtype(self, layer: KFACLayer, helper: LayerHelper, t: torch.Tensor, side: str) -> torch.dtype:
        """The dtype of a call's factor rows: 16-bit ones kept as they are where the Gram sum takes them into float32
        exactly (factors.half_rows: CUDA tensor cores) and the helper sums them with the generic Gram (not an expert
        stack's or an embedding's own); otherwise factor_dtype."""
        dtype = self.core.factor_dtype
        if layer.reduce or not factors.half_rows(t, dtype, layer.a_shape if side == "A" else layer.g_shape):
            return dtype
        kind = type(helper)
        generic = (kind.factor_rows is LayerHelper.factor_rows and kind.add_gram is LayerHelper.add_gram
                   if side == "A" else kind.add_g_gram is LayerHelper.add_g_gram)
        return t.dtype if generic else dtype

    def _accumulate_a(self, layer: KFACLayer, helper: LayerHelper, x: torch.Tensor) -> None:
        a = helper.factor_rows(x.detach(), layer.reduce, self._rows_dtype(layer, helper, x, "A"))
        first = layer.a_calls == 0
        shape = layer.xx_shape()
        if first:
            if layer.xx is None or layer.xx.shape != shape or layer.xx.device != a.device:
                layer.xx = torch.empty(shape, dtype=self.core.factor_dtype, device=a.device)
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
            d = helper.g_reduced(grad_output, self.core.factor_dtype)
        else:
            d = helper.g_rows(grad_output).to(self._rows_dtype(layer, helper, grad_output, "G"))
        first = layer.g_calls == 0
        if first and (layer.dd is None or layer.dd.shape != layer.g_shape or layer.dd.device != d.device):
            layer.dd = torch.empty(layer.g_shape, dtype=self.core.factor_dtype, device=d.device)
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
            self.core.distributor.pipelined
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
                self._g_scale_value = 1.0 / self.core.grad_access.loss_scale() ** 2
        return self._g_scale_value

    def _collected_layers(self) -> list[KFACLayer]:
        """The layers whose statistics of this step make a factor update: as many backward as forward
        calls, over at least one row. A layer that saw only empty inputs (0 rows: an expert no example
        was routed to, an empty batch) contributes nothing this step, quietly, like a layer that did not
        run; a call-count mismatch warns once per layer (a key of its own: an empty step hides nothing)."""
        ready = []
        for layer in self.core.layers.values():
            if layer.a_calls == 0 and layer.g_calls == 0:
                continue
            if layer.a_calls == layer.g_calls and layer.rows == 0:
                continue
            if layer.a_calls != layer.g_calls:
                if layer.a_calls > layer.g_calls and self.core.grads.get(layer.helper.params()[0]) is not None:
                    continue  # its weight got a gradient anyway: named by the coverage check, with its reason
                self.core.warn_once(
                    layer.name,
                    "calls",
                    f"K-FAC layer {layer.name!r}: {layer.a_calls} forward call(s) but {layer.g_calls} "
                    "backward call(s) in one step (a forward whose output got no gradient?); "
                    "its factors are not updated on such steps",
                )
                continue
            ready.append(layer)
        return ready

    def update(self, k: int) -> None:
        ready = self._collected_layers()
        if not ready:
            return
        g_scale = self._g_scale()
        diagonals = [d for layer in ready for d in layer.gram_diagonals()]
        labels = [(layer, which, False) for layer in ready for which in ("A", "G")]
        if not self.check_finite(diagonals, labels):
            return
        decay = val.resolve("factor_decay", self.core.factor_decay, k, val.DECAY)
        for layer in ready:
            layer.update_factors(decay, g_scale)

    def update_distributed(self, k: int) -> None:
        """Step factors averaged over ranks by the distributor, then the running averages."""
        g_scale = self._g_scale()
        complete = set(self._collected_layers())
        local: dict[FactorKey, torch.Tensor | None] = {}
        for layer in self.core.layers.values():
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
        reduced = self.core.distributor.reduce_factors(local)
        with self.core.timer.phase("factor_update"):
            self._fold_reduced(reduced, k)

    def _fold_reduced(self, reduced: dict[FactorKey, torch.Tensor | None], k: int) -> None:
        ready = []
        for layer in self.core.layers.values():
            A, G = reduced[(layer.index, "A")], reduced[(layer.index, "G")]
            if A is not None and G is not None:
                ready.append((layer, A, G))
        if not ready and self.core.owners is None:
            return
        # Reduced factors and DDP-averaged gradients are identical on every rank: so is this test. Under
        # distributed preconditioning a rank receives its own layers' factors only; the verdict is agreed on
        # (every rank, every factor step, even one that received nothing), so every rank skips together.
        diagonals = [factors.trace_sum(m) for _, A, G in ready for m in (A, G)]
        labels = [(layer, which, True) for layer, _, _ in ready for which in ("A", "G")]
        agree = self.core.sharing().agree_tensor if self.core.owners is not None else None
        # Whether any rank had data for each factor (a reduction that left it on the device) is read with the
        # finiteness verdict: one host read for the whole factor step.
        present = reduced.present if isinstance(reduced, ReducedFactors) else None
        flags = [present[(layer.index, w)] for layer, _, _ in ready for w in ("A", "G")] if present else []
        fine, here = self.check_finite_flags(diagonals, labels, agree, flags)
        if flags:
            ready = [r for k, r in enumerate(ready) if here[2 * k] and here[2 * k + 1]]
        if not fine or not ready:
            return
        decay = val.resolve("factor_decay", self.core.factor_decay, k, val.DECAY)
        for layer, A, G in ready:
            layer.fold(A, G, decay)

    def check_finite_flags(self, extra: list[torch.Tensor], labels: list[tuple[KFACLayer, str, bool]],
                           agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
                           flags: Sequence[torch.Tensor] = ()) -> tuple[bool, list[bool]]:
        """Whether this step may update the factors, and the device ``flags`` read along (the guard's
        :meth:`~lightning_spdkfac.kfac.guard.NonFiniteGuard.check`); non-finite gradients leave the step
        unpreconditioned (``core.grads_finite``)."""
        core = self.core
        grads_ok, fine, read = self.guard.check(StepGrads(core.steps, core.layers, core.grads, core.other_params,
                                                          core.grad_access), extra, labels, agree, flags)
        if not grads_ok:
            core.grads_finite = False
        return fine, read

    def check_finite(self, extra: list[torch.Tensor], labels: list[tuple[KFACLayer, str, bool]],
                     agree: Callable[[torch.Tensor], torch.Tensor] | None = None) -> bool:
        """Whether this step may update the factors (:meth:`check_finite_flags` without flags)."""
        return self.check_finite_flags(extra, labels, agree)[0]

    def drop_collected(self) -> None:
        """Forget the factor statistics collected since the last step (each step's end, a loaded state)."""
        for layer in self.core.layers.values():
            layer.reset_accumulators()
        self._micro_batch = 0
        self._backward_seen = False
        self._g_scale_value = None

    def note_calls_per_micro_batch(self) -> None:
        """After a factor step: each layer's calls of one micro-batch, the count that makes a factor final when
        pipelining."""
        for layer in self.core.layers.values():
            if layer.a_calls and layer.mb_a_calls == layer.mb_g_calls and not layer.helper.dynamic_calls:
                layer.calls_per_micro_batch = layer.mb_a_calls
