"""Nothing left out silently: the registered layers whose weight got a gradient but whose block produced no factors,
each named once with the measured reason, and gradients K-FAC cannot read, refused by name.

Checked on every factor step from host-side facts only (the hooks' call counters, ``grad is None``, shapes): no tensor
is read, so no host sync is added. :class:`Coverage` is a part of
:class:`~lightning_spdkfac.kfac.KFACPreconditioner`; the summary lists what it found (kfac/summary.py).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn

from .capture import FunctionCapture
from .core import Core
from .gradients import SHARDED_HINT, GradAccess
from .hook_tools import eager, holds_compiled
from .layer_state import KFACLayer

# The measured reasons (the forward hook never ran; it ran but the output-gradient hook never did).
FUNCTION = ("used through a function (e.g. F.linear(x, module.weight)) or hooks bypassed by a graph compiled before "
            "K-FAC attached: its forward hook never ran although its weight got a gradient, and capture=False; call the "
            "module, pass capture='auto', or compile after K-FAC is set up")
COMPILED = ("hooks bypassed by a graph compiled before K-FAC attached (the model holds a torch.compile'd module, whose "
            "cached graph runs without K-FAC's hooks): compile after K-FAC is set up")
NO_OUTPUT_GRAD = ("its forward ran but its output got no gradient while its weight did: the output was detached or "
                  "replaced after the forward (e.g. masking that writes into a detached copy), or the weight is also "
                  "used outside the module call; let the output keep its gradient, or leave the layer to the optimizer "
                  "with skip_layers")
CAPTURING = ("used through a function (e.g. F.linear(x, module.weight)): its forward hook never ran although its weight "
             "got a gradient; K-FAC follows its weight through functions from the next factor step on (capture='auto')")
CAPTURE_MISSED = ("used through an operation K-FAC's function capture cannot follow (not F.linear, matmul, F.conv*d, "
                  "F.embedding or grouped_mm on the weight, its transpose or one expert's slice: e.g. a fused kernel, a "
                  "custom autograd Function, einsum), or through a function outside the forward of its module and the "
                  "modules above it (followed there only in a LightningModule's training_step under the KFAC callback "
                  "and inside `with pre.capture.scope():`): left to the optimizer unpreconditioned; call the module, "
                  "move the use into a forward or under pre.capture.scope(), or use skip_layers to silence this")
CAPTURE_COMPILED = ("used through a function inside a torch.compile'd region: function capture does not run under "
                    "torch.compile (a mode pushed at a graph break cannot be traced), so its uses there are not followed; "
                    "call the module there, or leave this block eager")

class Coverage:
    """A part of the preconditioner that names what K-FAC leaves out (``core.unfactored``, the summary's), from the
    hooks' counters, the step's gradients and the layers the stepping optimizer holds (``stepping``)."""

    def __init__(self, core: Core, capture: FunctionCapture, hooked: dict[str, list[nn.Module]],
                 stepping: Callable[[], dict[int, float] | None]) -> None:
        self.core = core
        self.capture = capture
        self._hooked = hooked  # layer name -> its modules whose forward hooks collect it (the registry's)
        self._stepping = stepping  # the layers the stepping optimizer holds, or None (kfac/preconditioning.py)

    def check(self) -> None:
        """On a factor step (before the factor update): name, once per layer and reason, every layer stepped now whose
        weight got a gradient but whose hooks did not both run; refuse gradients that every layer lacks though their
        hooks ran (a strategy keeping them elsewhere)."""
        core = self.core
        if core.paused:
            return
        compiled = None
        new: list[str] = []
        ran_without_grad, ran = [], 0
        stepping = self._stepping()
        for layer in core.layers.values():
            if (stepping is not None and layer.index not in stepping) or not layer.trainable():
                continue  # another optimizer's (or none's), or frozen: quiet
            if layer.refused is not None:  # refused after setup (kfac/forward_check.py): named when it was
                core.unfactored[layer.name] = layer.refused
                continue
            if not layer.grad_watched:  # registered while frozen (distributed, a loaded state): watched from now on
                watch_grad(layer)
                continue
            has_grad = core.grads.get(layer.helper.params()[0]) is not None
            if layer.a_calls and layer.g_calls:
                ran += 1
                if not has_grad:
                    ran_without_grad.append(layer.name)
                if layer.a_calls == layer.g_calls:
                    core.unfactored.pop(layer.name, None)
                    continue
                # (more forward than backward calls: one call's output got no gradient; named below if the weight got
                # one, since the block makes no factors from such a step)
            # A gradient autograd gave the weight this step (not one left over, or zeros of zero_grad(set_to_none=False))
            has_grad = has_grad and layer.grad_seen
            if not has_grad or (layer.a_calls == 0 and not core.local and layer.A is not None):
                continue  # not used this step (or, distributed, run on other ranks): quiet
            if layer.a_calls == 0:
                if compiled is None:
                    compiled = holds_compiled(core.model)
                reason = COMPILED if compiled else self._no_call_reason(layer)
            else:
                reason = NO_OUTPUT_GRAD
            core.unfactored[layer.name] = reason
            if (layer.name, reason) not in core.warned:
                core.warned.add((layer.name, reason))
                new.append(f"{layer.name!r} ({reason})")
        if new:
            warnings.warn("K-FAC: these layers' weights got gradients but their K-FAC blocks produced no factors, so "
                          "the optimizer gets them unpreconditioned: " + "; ".join(new), stacklevel=3)
        if ran and len(ran_without_grad) == ran and type(core.grad_access) is GradAccess:
            # FSDP2 hook: the parameters were replaced by fully_shard after setup (kfac/sharded.py)
            from .sharded import refuse_late_sharding

            refuse_late_sharding(core.model.parameters())
            raise RuntimeError(
                f"K-FAC: the hooks of {ran} layer(s) ran ({', '.join(repr(n) for n in ran_without_grad[:3])}"
                f"{', ...' if ran > 3 else ''}) but none of their parameters has a gradient (param.grad is None): the "
                f"strategy keeps the gradients elsewhere, so K-FAC would precondition nothing. {SHARDED_HINT}")

    def _no_call_reason(self, layer: KFACLayer) -> str:
        """Why a layer whose weight got a gradient had no call K-FAC read (in an eager model); under
        ``capture="auto"`` such a layer is followed through functions from now on."""
        capture = self.capture
        if layer.name in capture.layers and capture.blocked_by_compile:
            return CAPTURE_COMPILED
        if layer.name in capture.layers or layer.name in capture.refused:
            # followed (or found before), and still no call K-FAC could read: not followed again
            return capture.refused.setdefault(layer.name, CAPTURE_MISSED)
        if self.core.options.capture == "auto":
            capture.watch(layer, self._hooked.get(layer.name, []))
            return CAPTURING
        return FUNCTION

def watch_grad(layer: KFACLayer) -> None:
    """Put the hook that tells a gradient autograd gave the layer's weight this step (``layer.grad_seen``, a host flag:
    nothing is read) from one left over or set by hand; only on a weight that requires grad (torch refuses others)."""
    weight = layer.helper.params()[0]
    if layer.grad_watched or not weight.requires_grad:
        return

    def seen(_: torch.Tensor) -> None:
        layer.grad_seen = True

    layer.handles.append(weight.register_post_accumulate_grad_hook(eager(seen)))  # type: ignore[no-untyped-call]
    layer.grad_watched = True
