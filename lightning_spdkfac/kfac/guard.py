"""The non-finite guard of the preconditioner: detection, blame, and the bounded bad streak.

A step whose activations, output gradients, received factors or gradients hold inf or NaN updates no
factor (and, for non-finite gradients, is not preconditioned); :class:`NonFiniteGuard` decides that with
one host sync, names the culprits only on bad steps, logs, counts, and raises after ``max_bad_steps``
such steps in a row. It is a part of :class:`~lightning_spdkfac.kfac.KFACPreconditioner` that owns its state (the
counters and the last bad step), given what it checks as arguments.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from .gradients import GradAccess
from .layer_state import KFACLayer, _sum32
from .sharded import grad_sums, guard_grad

log = logging.getLogger(__name__)


class StepGrads(NamedTuple):
    """What a check looks at: the optimizer step, the layers, the step's gradients of K-FAC's parameters and the
    parameters K-FAC leaves to the optimizer."""

    step: int
    layers: dict[str, KFACLayer]
    grads: dict[nn.Parameter, torch.Tensor | None]
    other_params: list[nn.Parameter]
    # the strategy's gradient access: under FSDP2's owner-based path every rank checks its DTensor shards (sharded.py)
    grad_access: GradAccess | None = None


class NonFiniteGuard:
    """A part of the preconditioner that owns the bad-step bookkeeping: the counters, the last bad step's blame and
    the bound on a bad streak. What a check looks at (the step, its gradients, the layers) comes as arguments."""

    def __init__(self, model: nn.Module, max_bad_steps: int | None) -> None:
        self.model = model  # (its parameter names, for the blame)
        self.max_bad_steps = max_bad_steps
        self.skipped_factor_steps = 0  # factor updates skipped for non-finite values
        self.consecutive_bad_steps = 0  # factor steps skipped in a row (max_bad_steps bounds it)
        # {"step": k, "bad": {where: [what, ...]}} of the last one
        self.last_bad_step: dict[str, Any] | None = None

    @staticmethod
    def _grad_sums(grads: StepGrads) -> list[torch.Tensor]:
        """One scalar per gradient, non-finite exactly where the gradient holds an inf or NaN."""
        # FSDP2 hook: under the owner-based path every rank checks the same shards, summed over the mesh (sharded.py)
        layer_grads = [guard_grad(grads.grad_access, grads.grads, p) for p in grads.grads] if grads.grad_access \
            else list(grads.grads.values())
        sums = grad_sums([g for g in layer_grads if g is not None], _sum32)
        sums += grad_sums([p.grad for p in grads.other_params if p.grad is not None], _sum32)
        return sums

    def _finite(self, grads: StepGrads, extra: list[torch.Tensor],
                agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
                flags: Sequence[torch.Tensor] = ()) -> tuple[bool, bool, bool, list[bool]]:
        """One host read: (are all gradients finite, are all the ``extra`` scalars finite here, and over every
        rank with ``agree``, and the boolean device ``flags`` read along)."""
        sums = self._grad_sums(grads)
        n = len(sums)
        if not sums and not extra and agree is None and not flags:
            return True, True, True, []
        scalars = [s.float() for s in sums + list(extra)]
        ok = torch.isfinite(torch.stack(scalars)) if scalars else torch.ones(0, dtype=torch.bool)
        local = ok[n:].all()
        verdicts = [ok[:n].all(), local, agree(local) if agree is not None else local]
        read = torch.cat([torch.stack(verdicts), torch.stack(list(flags)).reshape(-1)]) if flags else torch.stack(
            verdicts)
        values = read.tolist()  # the one host read of a factor step
        return bool(values[0]), bool(values[1]), bool(values[2]), [bool(v) for v in values[3:]]

    def check(self, grads: StepGrads, extra: list[torch.Tensor], labels: list[tuple[KFACLayer, str, bool]],
              agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
              flags: Sequence[torch.Tensor] = ()) -> tuple[bool, bool, list[bool]]:
        """(are the step's gradients finite, may this step update the factors, the device ``flags`` read in the same
        host read).

        ``labels[i]`` is ``(layer, "A" or "G", received)`` for ``extra[i]``, used only on a bad step
        to say where the non-finite values are. Raises after ``max_bad_steps`` bad steps in a row.
        ``agree`` (distributed preconditioning, where each rank sees its own layers' factors only) makes the
        verdict on ``extra`` that of every rank (on the device: the AND over ranks of a boolean), so that every rank
        skips the step together. Non-finite gradients leave the step unpreconditioned (the caller's part): the
        optimizer's own overflow handling (GradScaler, DeepSpeed) sees the gradients as they are, while
        preconditioning would only spread the inf/NaN over every entry.
        """
        grads_ok, local_ok, extra_ok, read = self._finite(grads, extra, agree, flags)
        if grads_ok and extra_ok:
            self.consecutive_bad_steps = 0
            return grads_ok, True, read
        self.skipped_factor_steps += 1
        self.consecutive_bad_steps += 1
        bad = self._blame(grads, extra, labels)  # off the healthy path: one more host sync
        self.last_bad_step = {"step": grads.step, "bad": bad}
        where = _describe_bad(bad)
        if local_ok and not bad:
            where = "the factors of layers other ranks own (their logs name them)"
        only_grads = extra_ok and all(what == ["gradient"] for what in bad.values())
        # A gradient overflow alone is routine under a dynamic fp16 loss scale: info, not warning.
        log.log(
            logging.INFO if only_grads else logging.WARNING,
            "K-FAC step %d: non-finite values (%s); factor update skipped%s (%d in a row, %d in all)",
            grads.step, where, "" if grads_ok else " and gradients left unpreconditioned",
            self.consecutive_bad_steps, self.skipped_factor_steps,
        )
        if self.max_bad_steps is not None and self.consecutive_bad_steps >= self.max_bad_steps:
            raise RuntimeError(
                f"K-FAC: {self.consecutive_bad_steps} consecutive factor steps had non-finite values "
                f"(max_bad_steps={self.max_bad_steps}), so their factor updates were skipped; at step "
                f"{grads.step}: {where}. Training has diverged or the data holds NaN/Inf: lower the "
                "learning rate, raise damping, use loss scaling (a GradScaler / fp16 loss scale) or bf16, "
                "and check the input data; max_bad_steps=None disables this error"
            )
        return grads_ok, False, read

    def _blame(self, grads: StepGrads, extra: list[torch.Tensor],
               labels: list[tuple[KFACLayer, str, bool]]) -> dict[str, list[str]]:
        """Where the non-finite values of a bad step are: {layer or parameter: [what, ...]}.

        Layers in registration order (their factors, then their gradient), then other parameters.
        """
        # (layer or parameter, "gradient" or the (which, received, layer) of a factor)
        places: list[tuple[str, str | tuple[str, bool, KFACLayer]]] = [
            (layer.name, (which, received, layer)) for layer, which, received in labels]
        scalars: list[torch.Tensor] = list(extra)
        layer_grads = []
        for layer in grads.layers.values():
            for p in layer.helper.params():
                g = guard_grad(grads.grad_access, grads.grads, p) if grads.grad_access else grads.grads.get(p)
                if g is not None:
                    places.append((layer.name, "gradient"))
                    layer_grads.append(g)
        scalars += grad_sums(layer_grads, _sum32)
        names = {id(p): n for n, p in self.model.named_parameters()}
        others = [p for p in grads.other_params if p.grad is not None]
        places += [(f"parameter {names.get(id(p), '?')!r}", "gradient") for p in others]
        scalars += grad_sums([p.grad for p in others if p.grad is not None], _sum32)  # FSDP2 hook (kfac/sharded.py)
        ok = torch.isfinite(torch.stack([s.float() for s in scalars])).tolist() if scalars else []
        found: dict[str, list[str]] = {}
        for (name, what), fine in zip(places, ok):
            if fine:
                continue
            if isinstance(what, tuple):
                what = self._factor_blame(*what)
            if what not in found.setdefault(name, []):
                found[name].append(what)
        order = {name: i for i, name in enumerate(grads.layers)}
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


def _describe_bad(bad: dict[str, list[str]]) -> str:
    """``{"net.0": ["activations (A factor)"]}`` -> ``"layer 'net.0': activations (A factor)"``."""
    parts = [f"{name if name.startswith('parameter ') else f'layer {name!r}'}: {', '.join(what)}"
             for name, what in bad.items()]
    return "; ".join(parts) or "no single tensor identified"
