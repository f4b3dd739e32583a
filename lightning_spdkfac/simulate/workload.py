"""What one iteration of a model asks of each GPU: K-FAC layers, their factor sizes and compute times.

:func:`profile_layers` reads a real ``nn.Module``: it runs one forward pass (on the meta device when the
model lives there, so no memory is allocated) with hooks on the layers that K-FAC handles, found by the
runtime's own :func:`~lightning_spdkfac.kfac.layers.make_helper`, and records per layer the factor sides and
layouts (dense ``(n, n)``, diagonal ``(n,)``, grouped ``(b, n, n)``: :mod:`lightning_spdkfac.factor_shapes`, as
the runtime's ``helper.factor_shapes(max_factor_side)`` gives them), the number of factor rows one sample
contributes and the forward FLOPs.

:class:`Workload` turns those counts into seconds, either from device rates (:meth:`Workload.from_rates`)
or by spreading measured single-phase totals over the layers (:meth:`Workload.calibrated`): forward and
backward time by forward FLOPs (backward twice forward), factor computation by ``rows * n**2`` of each
dense factor (``rows * n`` for a diagonal one, ``rows * b * n**2`` for a grouped one). Inversion times are a property of the device and live in the cluster's ``InverseCost``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from .. import validation as val
from ..factor_shapes import FactorShape, blocks, check_shape, is_diagonal, side
from ..kfac.layers import make_helper

__all__ = ["DEFAULT_MAX_FACTOR_SIDE", "LayerSpec", "LayerTimes", "Workload", "profile_layers"]

DEFAULT_MAX_FACTOR_SIDE = 4608
"""The largest factor side kept dense when a model is profiled: the runtime's default ``max_factor_side``
(``KFACOptions``); a larger side is a diagonal factor."""


def _factor_flops(rows: int, n: int, shape: FactorShape) -> float:
    """FLOPs to form one factor's contribution of ``rows`` rows: ``2 rows n^2`` dense (the formula as it always
    was), ``2 rows n`` diagonal (squares of the rows' entries), ``2 rows b n^2`` grouped (one block per group)."""
    if len(shape) == 2:
        return 2.0 * rows * n**2
    if is_diagonal(shape):
        return 2.0 * rows * n
    return 2.0 * rows * blocks(shape) * n**2


@dataclass(frozen=True)
class LayerSpec:
    """One K-FAC layer as the simulator sees it (per sample of the batch).

    Attributes:
        name: module name in the model.
        a_side, g_side: sides of the A and G factors (of each block for a grouped factor, the length of a
            diagonal one).
        rows: factor rows one sample contributes (output positions of a conv, tokens of a linear).
        forward_flops: forward FLOPs of the layer for one sample (2 per multiply-add).
        params: number of parameters (weight and bias).
        a_shape, g_shape: the factors' layouts (:mod:`lightning_spdkfac.factor_shapes`): ``(n, n)`` dense,
            ``(n,)`` diagonal, ``(b, n, n)`` grouped; their side must be ``a_side`` / ``g_side``. Left out (``()``),
            the factor is dense, ``(a_side, a_side)`` (the paper's models, and every spec before layouts existed).
            Everything the simulator costs per factor (messages, inversions, memory, factor FLOPs) follows them.
    """

    name: str
    a_side: int
    g_side: int
    rows: int
    forward_flops: float
    params: int
    a_shape: FactorShape = ()
    g_shape: FactorShape = ()

    def __post_init__(self) -> None:
        for which in ("a", "g"):
            n = val.check_int(f"{which}_side", getattr(self, f"{which}_side"), low=0)
            given = getattr(self, f"{which}_shape")
            shape = (n, n) if given == () else check_shape(f"{which}_shape", given, low=0)
            if side(shape) != n:
                raise ValueError(f"{which}_shape {given!r} does not have the side {which}_side={n} (its last "
                                 f"dimension) of layer {self.name!r}")
            object.__setattr__(self, f"{which}_shape", shape)

    @property
    def a_flops(self) -> float:
        """FLOPs to form this layer's A factor contribution of one sample (``rows * a**2`` multiply-adds for a
        dense factor; ``rows * a`` diagonal, ``rows * b * a**2`` grouped)."""
        return _factor_flops(self.rows, self.a_side, self.a_shape)

    @property
    def g_flops(self) -> float:
        return _factor_flops(self.rows, self.g_side, self.g_shape)


def _model_device(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    return torch.device("cpu")


def profile_layers(model: nn.Module, input_shape: Sequence[int], *, dtype: torch.dtype = torch.float32,
                   max_factor_side: int | None = DEFAULT_MAX_FACTOR_SIDE) -> list[LayerSpec]:
    """K-FAC layers of ``model`` in forward (first-call) order, from one forward pass of one sample.

    Each layer's factor layouts are the runtime's, ``helper.factor_shapes(max_factor_side)`` (the option of
    ``KFACOptions``, default 4608): a side above it is diagonal, an embedding's A always is, a grouped
    convolution's factors are ``(groups, n, n)``. ``None`` keeps every side dense whatever its size (the paper's
    models, which ran dense: ResNet-50's largest A is 4608).

    ``input_shape`` is the shape of one sample without the batch dimension (e.g. ``(3, 224, 224)``).
    The pass runs where the model's parameters are: on ``meta`` it costs no memory or FLOPs; otherwise it
    runs one real sample under ``torch.no_grad()``. A layer called several times per forward (weight
    sharing) adds up its rows and FLOPs over the calls.
    """
    val.check_instance("model", model, nn.Module, "a torch.nn.Module")
    shape = tuple(val.check_ints("input_shape", input_shape, low=1))
    val.check_instance("dtype", dtype, torch.dtype, "a torch.dtype")
    max_side = sys.maxsize if max_factor_side is None else val.check_int("max_factor_side", max_factor_side, low=1)
    if not shape:
        raise ValueError("input_shape must hold at least one dimension (the sample's shape, without the batch)")
    found: dict[str, dict] = {}
    order: list[str] = []
    handles = []

    def hook_for(name: str, helper: Any) -> Callable[..., None]:
        def hook(mod: nn.Module, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
            x = inputs[0]
            if isinstance(mod, nn.modules.conv._ConvNd):
                rows = math.prod(output.shape[2:])
            elif isinstance(mod, nn.Embedding):
                rows = x.numel()
            else:
                rows = x.numel() // x.shape[-1]
            if isinstance(mod, nn.Embedding):  # a lookup, no multiply: count the elements it writes
                flops = float(rows * helper.out_features)
            else:  # (a grouped conv's features are per group: its groups blocks each do that much)
                flops = 2.0 * rows * helper.in_features * helper.out_features * helper.groups
            if name not in found:
                order.append(name)
                found[name] = {"rows": 0, "flops": 0.0}
            found[name]["rows"] += rows
            found[name]["flops"] += flops
        return hook

    helpers = {}
    for name, module in model.named_modules():
        helper, _ = make_helper(module)
        if helper is None:
            continue
        helpers[name] = helper
        handles.append(module.register_forward_hook(hook_for(name, helper)))
    was_training = model.training
    try:
        model.eval()  # one sample: batch norm in training mode would refuse a batch of 1
        with torch.no_grad():
            model(torch.zeros((1, *shape), device=_model_device(model), dtype=dtype))
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    out = []
    for name in order:
        h = helpers[name]
        params = sum(p.numel() for p in h.params())
        a_shape, g_shape = h.factor_shapes(max_side)
        out.append(LayerSpec(name=name, a_side=h.a_dim, g_side=h.g_dim, rows=found[name]["rows"],
                             forward_flops=found[name]["flops"], params=params, a_shape=a_shape, g_shape=g_shape))
    return out


@dataclass(frozen=True)
class LayerTimes:
    """Seconds one GPU spends on one layer in one iteration (per-GPU batch included)."""

    forward: float
    backward: float
    a_factor: float
    g_factor: float


@dataclass(frozen=True)
class Workload:
    """A model's K-FAC layers with the per-GPU seconds of every piece of work of one iteration.

    Attributes:
        name: label for tables.
        layers: the layer specs, forward order.
        times: per-layer seconds, aligned with ``layers``.
        batch_size: per-GPU batch the times are for.
        grad_comm: if set, the seconds of the gradient all-reduce (a measured total); otherwise the
            simulator models it from the parameter count and the cluster's all-reduce model.
        precondition: seconds of preconditioning every layer's gradient (0 where it is not measured).
        other_params: parameters outside K-FAC layers (batch-norm etc.), all-reduced with the gradients.
    """

    name: str
    layers: tuple[LayerSpec, ...]
    times: tuple[LayerTimes, ...]
    batch_size: int
    grad_comm: float | None = None
    precondition: float = 0.0
    other_params: int = 0

    def __post_init__(self) -> None:
        val.check_instance("name", self.name, str)
        for i, s in enumerate(val.check_sequence("layers", self.layers, "LayerSpecs")):
            val.check_instance(f"layers[{i}]", s, LayerSpec)
        for i, t in enumerate(val.check_sequence("times", self.times, "LayerTimes")):
            val.check_instance(f"times[{i}]", t, LayerTimes)
        val.check_same_length("layers", self.layers, "times", self.times)
        val.check_int("batch_size", self.batch_size, low=1)
        val.check_int("other_params", self.other_params, low=0)
        if self.grad_comm is not None:
            val.check_real("grad_comm", self.grad_comm, val.Bound(low=0.0))
        val.check_real("precondition", self.precondition, val.Bound(low=0.0))

    @property
    def params(self) -> int:
        return sum(s.params for s in self.layers) + self.other_params

    @property
    def ff_bp(self) -> float:
        return sum(t.forward + t.backward for t in self.times)

    @property
    def factor_comp(self) -> float:
        return sum(t.a_factor + t.g_factor for t in self.times)

    def with_batch(self, batch_size: int) -> Workload:
        """The same model at another per-GPU batch: compute times scale linearly with the batch."""
        b = val.check_int("batch_size", batch_size, low=1)
        f = b / self.batch_size
        times = tuple(LayerTimes(t.forward * f, t.backward * f, t.a_factor * f, t.g_factor * f) for t in self.times)
        return replace(self, times=times, batch_size=b)

    @classmethod
    def from_rates(cls, name: str, layers: Sequence[LayerSpec], batch_size: int, *, flops_per_s: float,
                   factor_flops_per_s: float | None = None, other_params: int = 0) -> Workload:
        """Times from device rates: forward ``forward_flops / flops_per_s`` per sample, backward twice
        that, factors ``flops / factor_flops_per_s`` (defaults to ``flops_per_s``)."""
        rate = val.check_real("flops_per_s", flops_per_s, val.Bound(low=0.0, low_open=True))
        frate = rate if factor_flops_per_s is None else val.check_real("factor_flops_per_s", factor_flops_per_s, val.Bound(low=0.0, low_open=True))
        b = val.check_int("batch_size", batch_size, low=1)
        times = tuple(LayerTimes(b * s.forward_flops / rate, 2 * b * s.forward_flops / rate,
                                 b * s.a_flops / frate, b * s.g_flops / frate) for s in layers)
        return cls(name=name, layers=tuple(layers), times=times, batch_size=b, other_params=other_params)

    @classmethod
    def calibrated(cls, name: str, layers: Sequence[LayerSpec], batch_size: int, *, ff_bp: float,
                   factor_comp: float, grad_comm: float | None = None, other_params: int = 0) -> Workload:
        """Times that add up to measured totals: ``ff_bp`` (forward + backward) spread over layers by
        forward FLOPs, one third forward and two thirds backward; ``factor_comp`` spread over the
        factors by their FLOPs (``rows * n**2`` for a dense factor: :attr:`LayerSpec.a_flops`)."""
        ls = tuple(layers)
        if not ls:
            raise ValueError("layers is empty: the model has no K-FAC layer to simulate")
        ffbp = val.check_real("ff_bp", ff_bp, val.Bound(low=0.0))
        fcomp = val.check_real("factor_comp", factor_comp, val.Bound(low=0.0))
        fl = sum(s.forward_flops for s in ls)
        ff = sum(s.a_flops + s.g_flops for s in ls)
        times = tuple(
            LayerTimes(ffbp * s.forward_flops / fl / 3, 2 * ffbp * s.forward_flops / fl / 3,
                       fcomp * s.a_flops / ff, fcomp * s.g_flops / ff)
            for s in ls
        )
        return cls(name=name, layers=ls, times=times, batch_size=val.check_int("batch_size", batch_size, low=1),
                   grad_comm=grad_comm, other_params=other_params)
