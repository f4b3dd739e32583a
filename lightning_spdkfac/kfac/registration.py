"""Layer registration of the preconditioner: which modules get K-FAC, and the checks that keep it so.

:class:`LayerRegistry` is a part of :class:`~lightning_spdkfac.kfac.KFACPreconditioner`: at setup it walks the
model, skips (and warns about) the layers K-FAC cannot or must not take, gives every registered layer its
:class:`~lightning_spdkfac.kfac.layer_state.KFACLayer` and forward hooks, holds layers frozen at setup aside until
they train, and on factor steps refuses a trainable layer that joined the model after setup.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .attention import module_layers
from .capture import FunctionCapture
from .core import Core
from .coverage import watch_grad
from .gradients import GradAccess
from .hook_tools import eager
from .layer_state import KFACLayer
from .layers import (
    LayerHelper,
    linear_and_conv_modules,
    make_helper,
    shared_parameter_groups,
    unsupported_reason,
)
from .summary import FROZEN_PART


class LayerRegistry:
    """A part of the preconditioner that owns which modules get K-FAC: the registered layers (``core.layers``) with
    their hooks, the skipped ones with their reasons, the layers held aside while frozen, and K-FAC's parameters."""

    def __init__(self, core: Core, capture: FunctionCapture,
                 forward_hook: Callable[[KFACLayer, LayerHelper], Callable[[nn.Module, tuple[Any, ...], Any], None]],
                 on_change: Callable[[], None]) -> None:
        self.core = core
        self.capture = capture
        self._forward_hook = forward_hook  # the factor statistics' hook of one module of a layer
        self._on_change = on_change  # layers were added after setup (the memory check, the optimizer's groups)
        self.skipped: dict[str, str] = {}
        # id -> (module, None for a registered module or the reason it was skipped): the supported modules seen at
        # registration, held so that their ids stay theirs (see check_layers).
        self._known: dict[int, tuple[nn.Module, str | None]] = {}
        # Layers frozen at setup (one process): first module name -> its group, registered once all its parameters train.
        self.frozen_layers: dict[str, list[tuple[str, nn.Module, LayerHelper]]] = {}
        self._frozen_hook: RemovableHandle | None = None
        self.hooked: dict[str, list[nn.Module]] = {}  # layer name -> its modules whose forward hooks collect it

    def register(self, model: nn.Module) -> None:
        """Walk ``model`` once, at setup: register, skip (naming why) or hold aside every supported layer."""
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
                if any(p.search(name) or p.search(cls) for p in self.core.skip_layers):
                    self._skip(name, hooked, "matched skip_layers")
                    continue
                too_large = getattr(helper, "too_large", None)
                why_large = too_large(self.core.options.max_factor_side) if too_large is not None else None
                if why_large is not None:
                    self._skip(name, hooked, why_large)
                    refused.append(name)
                    continue
                # A layer frozen now is held aside until it trains (_hold_frozen); one frozen after setup is left
                # alone step by step (trainable()).
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
            if self.core.local and not _group_trainable(group):
                # Frozen at setup (a LoRA base layer, a backbone frozen for a warm-up): not registered (no hooks, no
                # memory, not counted), and registered when it trains (_register_unfrozen). Distributed, the layers
                # are fixed at setup: registered, and left alone while frozen (trainable()).
                self._hold_frozen(group)
                continue
            self._add_layer(group)
        if not self.core.layers and not self.frozen_layers:
            found = ", ".join(sorted(set(seen_types)))
            detail = "; ".join(f"{n or '<root>'}: {r}" for n, r in self.skipped.items())
            raise ValueError(
                "KFACPreconditioner found no supported layer (nn.Linear, nn.Conv1d/2d/3d, nn.MultiheadAttention) in "
                "model; "
                f"module types found: {found}" + (f"; skipped: {detail}" if detail else "")
            )

    def _add_layer(self, group: list[tuple[str, nn.Module, LayerHelper]]) -> KFACLayer:
        """One K-FAC block for modules that share all their parameters (one module: the usual case), named after the
        first; each module's calls add to its factors with that module's own geometry, like the calls of one layer
        called several times per forward."""
        name, _, helper = group[0]
        reduce = helper.reducible and (
            self.core.options.factor_approx == "reduce" or (self.core.options.factor_approx == "auto" and helper.auto_reduce))
        a_shape, g_shape = helper.factor_shapes(self.core.options.max_factor_side)
        layer = KFACLayer(name=name, helper=helper, index=len(self.core.layers), reduce=reduce, a_shape=a_shape,
                          g_shape=g_shape)
        hooked = []
        for _, module, module_helper in group:
            self._known[id(module)] = (module, None)
            if module_helper.capture_only:  # its calls are functions inside its module's forward (kfac/experts.py)
                record = getattr(module_helper, "record_tokens", None)
                if record is not None:
                    layer.handles.append(module.register_forward_pre_hook(eager(record), with_kwargs=True))
                continue
            layer.handles.append(module.register_forward_hook(self._forward_hook(layer, module_helper)))
            hooked.append(module)
        if helper.capture_only or self.core.options.capture is True:
            self.capture.watch(layer, hooked)
        self.hooked[layer.name] = hooked
        watch_grad(layer)
        self.core.layers[name] = layer
        return layer

    def _hold_frozen(self, group: list[tuple[str, nn.Module, LayerHelper]]) -> None:
        """Keep a group frozen at setup aside until all its parameters train; a trainable part (a bias beside a
        frozen weight) is named once: K-FAC preconditions a layer's parameters together."""
        self.frozen_layers[group[0][0]] = group
        for _, module, _ in group:
            self._known[id(module)] = (module, None)
        if any(p.requires_grad for _, _, h in group for p in h.params()):
            warnings.warn(f"K-FAC leaves layer {group[0][0]!r} to the optimizer while {FROZEN_PART}", stacklevel=4)
        if self._frozen_hook is None:  # registration as soon as the model runs with them trainable
            self._frozen_hook = self.core.model.register_forward_pre_hook(eager(self._forward_pre_hook))

    def _forward_pre_hook(self, module: nn.Module, inputs: Any) -> None:
        if torch.is_grad_enabled() and not self.core.paused:
            self.register_unfrozen()

    def register_unfrozen(self) -> None:
        """Register the layers frozen at setup that train now (all their parameters require grad): before the model
        runs (a hook on it; the KFAC callback at each batch) or, at the latest, at the next step()."""
        if self.frozen_layers:
            self.register_frozen({name for name, group in self.frozen_layers.items() if _group_trainable(group)})

    def register_frozen(self, names: set[str]) -> None:
        """Register the layers of ``names`` held aside as frozen at setup (others: ignored)."""
        now = [name for name in self.frozen_layers if name in names]
        if not now:
            return
        for name in now:
            self._add_layer(self.frozen_layers.pop(name))
        self.split_params()
        if not self.frozen_layers and self._frozen_hook is not None:
            self._frozen_hook.remove()
            self._frozen_hook = None
        self._on_change()

    def split_params(self) -> None:
        """K-FAC's parameters (each once: the q, k and v blocks of an attention share its packed weight) and the
        others, in ``core``."""
        core = self.core
        core.grad_params = list(dict.fromkeys(p for ly in core.layers.values() for p in ly.helper.params()))
        kfac_ids = {id(p) for p in core.grad_params}
        core.other_params = [p for p in core.model.parameters() if id(p) not in kfac_ids]

    def remove_hooks(self) -> None:
        """Detach the hook that waits for layers frozen at setup (the layers' own hooks are theirs)."""
        if self._frozen_hook is not None:
            self._frozen_hook.remove()
            self._frozen_hook = None

    def _skip(self, name: str, module: nn.Module, reason: str) -> None:
        self.skipped[name] = reason
        self._known[id(module)] = (module, reason)

    def check_layers(self) -> None:
        """Supported layers that got trainable after registration, or joined the model after it.

        A layer added to the model (or put in place of a registered one: ``model.fc = nn.Linear(...)``) after
        the preconditioner was built has no hooks, so its gradient would reach the optimizer
        unpreconditioned while its predecessor keeps its factors: one RuntimeError naming it. Only layers
        that train count: some parameter requires grad and has a gradient (wherever the gradients are not
        ``param.grad``, requiring grad is enough). One pass over the model's modules, called on factor steps.
        """
        plain_grads = type(self.core.grad_access) is GradAccess
        added = []
        for module in linear_and_conv_modules(self.core.model):
            if id(module) in self._known:
                continue
            if not any(p.requires_grad and (p.grad is not None or not plain_grads)
                       for p in module.parameters(recurse=False)):
                continue
            if make_helper(module)[0] is not None:
                added.append(module)
        if added:
            names = [n for n, m in self.core.model.named_modules() if any(m is a for a in added)]
            raise RuntimeError(
                f"K-FAC: layer(s) {', '.join(repr(n) for n in names)} joined the model after the KFACPreconditioner "
                "was built (added, or put in place of a registered layer), so K-FAC has no hooks on them and their "
                "gradients would reach the optimizer unpreconditioned. Build the preconditioner once the model is "
                "final (with the KFAC callback: create the layers in the LightningModule's __init__ and do not "
                "replace them during fit), or freeze these layers if they are not trained"
            )



def _group_trainable(group: list[tuple[str, nn.Module, LayerHelper]]) -> bool:
    """Whether every parameter K-FAC would precondition for these modules requires grad."""
    return all(p.requires_grad for _, _, helper in group for p in helper.params())

