"""The factor update of a step: the statistics the hooks collected become this step's factors, checked for
non-finite values and folded into the running averages (locally, or averaged over ranks by the distributor).

:class:`FactorUpdates` is a part of :class:`~lightning_spdkfac.kfac.KFACPreconditioner`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from .. import validation as val
from ..telemetry import StepTimer
from . import factors
from .distributor import Distributor, FactorKey, OwnerHeld, ReducedFactors
from .layer_state import KFACLayer


class FactorUpdates:
    """``_update_factors`` / ``_update_factors_distributed`` of the preconditioner (a mixin: the attributes are
    its)."""

    layers: dict[str, KFACLayer]
    factor_decay: val.HParam
    distributor: Distributor
    timer: StepTimer
    _owners: tuple[int, ...] | None
    _grads: dict[torch.nn.Parameter, torch.Tensor | None]

    if TYPE_CHECKING:  # the preconditioner's (declared for the type checker only: nothing here at run time)

        def _warn_once(self, layer: str, key: str, message: str) -> None: ...

        def _sharing(self) -> OwnerHeld: ...

        def _g_scale(self) -> float | torch.Tensor: ...

        def _check_finite(self, extra: list[torch.Tensor], labels: list[tuple[KFACLayer, str, bool]],
                          agree: Callable[[torch.Tensor], torch.Tensor] | None = None) -> bool: ...

        def _check_finite_flags(self, extra: list[torch.Tensor], labels: list[tuple[KFACLayer, str, bool]],
                                agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
                                flags: Sequence[torch.Tensor] = ()) -> tuple[bool, list[bool]]: ...

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
                if layer.a_calls > layer.g_calls and self._grads.get(layer.helper.params()[0]) is not None:
                    continue  # its weight got a gradient anyway: named by the coverage check, with its reason
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
        agree = self._sharing().agree_tensor if self._owners is not None else None
        # Whether any rank had data for each factor (a reduction that left it on the device) is read with the
        # finiteness verdict: one host read for the whole factor step.
        present = reduced.present if isinstance(reduced, ReducedFactors) else None
        flags = [present[(layer.index, w)] for layer, _, _ in ready for w in ("A", "G")] if present else []
        fine, here = self._check_finite_flags(diagonals, labels, agree, flags)
        if flags:
            ready = [r for k, r in enumerate(ready) if here[2 * k] and here[2 * k + 1]]
        if not fine or not ready:
            return
        decay = val.resolve("factor_decay", self.factor_decay, k, val.DECAY)
        for layer, A, G in ready:
            layer.fold(A, G, decay)
