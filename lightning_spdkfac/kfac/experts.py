"""Mixture-of-experts blocks and other layers that exist only as functions of a bare weight.

``transformers`` 5 stores the experts of a layer as 3-D parameters (``MixtralExperts.gate_up_proj`` of shape
``(E, 2I, H)``, ``down_proj`` ``(E, H, I)``; ``is_transposed`` stacks store ``(E, in, out)``) and applies expert
``e`` as ``F.linear(tokens_of_e, self.gate_up_proj[e])`` (``experts_implementation="eager"``) or all of them as one
``grouped_mm`` with per-expert offsets (the default where the kernel exists). Every current family (Mixtral,
Qwen-MoE, OLMoE, DeepSeek, GPT-OSS) is built this way, and its router holds a bare ``weight`` used through
``F.linear``.

K-FAC gives each expert its own Kronecker block, batched as grouped factors ``(E, in, in)`` and ``(E, out, out)``
(the layout of grouped convolutions, so reduction, fusion, placement, inversion, dpkfac, checkpoints and the
summary treat a stack like any grouped layer):

* expert ``e``'s A is the mean of ``x x^T`` over the tokens routed to it, its G is ``N sum d d^T`` over their
  output gradients, with ``N`` the tokens entering the block: the Fisher block of ``W_e`` weighs each token by
  its routing (a token not routed to ``e`` contributes zero), which puts the routing frequency ``N_e / N`` into G;
* an expert that got no token in a factor step keeps its factors (its step factors are its running ones: the
  decayed average is unchanged); before its first token, a prior from the experts that got tokens;
* the calls are collected by function capture (kfac/capture.py), active only during the block's forward;
  their number varies per step, so a stack's factors are reduced at the step (not pipelined).

:func:`register_experts` is the registry entry for other MoE implementations: a module type and the names of its
3-D expert parameters, with their layout. Modules whose class name ends in ``Experts`` and that hold 3-D
parameters are recognized without registration (their ``is_transposed`` attribute, as ``transformers`` sets it,
tells the layout); so are routers (class name containing ``Router``) holding a 2-D ``weight``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import nn

from ..factor_shapes import FactorShape
from .layer_base import LayerHelper
from .layers import LinearHelper

__all__ = ["ExpertsHelper", "FunctionalLinearHelper", "experts_layers", "register_experts"]

# module type (or qualified name) -> {parameter name: transposed (stored (E, in, out))}
_EXPERTS: dict[type | str, dict[str, bool]] = {}


def register_experts(module_type: type[nn.Module] | str, params: Mapping[str, str]) -> None:
    """Give K-FAC a mixture-of-experts module type whose experts are 3-D parameters applied per expert through
    ``F.linear`` / ``matmul`` (one expert's slice) or ``grouped_mm`` (all, with per-expert offsets).

    Args:
        module_type: the class, or its qualified name ``"package.module.ClassName"``.
        params: parameter name -> its layout: ``"out_in"`` (``(E, out, in)``, applied as ``F.linear(x, p[e])``)
            or ``"in_out"`` (``(E, in, out)``, applied as ``x @ p[e]``).
    """
    if isinstance(module_type, str) and "." not in module_type:
        raise ValueError(f"module_type: a name must be qualified ('package.module.ClassName'), got {module_type!r}")
    if not isinstance(module_type, str) and not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"module_type must be an nn.Module subclass or its qualified name, got {module_type!r}")
    layouts = {}
    for name, layout in dict(params).items():
        if layout not in ("out_in", "in_out"):
            raise ValueError(f"params[{name!r}] must be 'out_in' or 'in_out' (the layout of the (E, ., .) "
                             f"parameter), got {layout!r}")
        layouts[name] = layout == "in_out"
    if not layouts:
        raise ValueError("params must name at least one 3-D expert parameter")
    _EXPERTS[module_type] = layouts


def _registered(module: nn.Module) -> dict[str, bool] | None:
    for cls in type(module).__mro__:
        if cls in _EXPERTS:
            return _EXPERTS[cls]
        named = _EXPERTS.get(f"{cls.__module__}.{cls.__qualname__}")
        if named is not None:
            return named
    return None


def experts_layers(module: nn.Module) -> list[tuple[str, LayerHelper | None, str | None]]:
    """The expert stacks and bare-weight routers of ``module``: ``(parameter name, helper, None)`` or
    ``(parameter name, None, why)``; empty for any other module."""
    layouts = _registered(module)
    if layouts is None and type(module).__name__.endswith("Experts"):
        transposed = bool(getattr(module, "is_transposed", False))
        layouts = {n: transposed for n, p in module.named_parameters(recurse=False) if p.dim() == 3}
    if layouts:
        found: list[tuple[str, LayerHelper | None, str | None]] = []
        for name, transposed in layouts.items():
            p = module._parameters.get(name)
            if p is None or p.dim() != 3:
                found.append((name, None, f"registered as an expert stack but {name!r} is not a 3-D parameter of "
                                          "the module"))
                continue
            found.append((name, ExpertsHelper(module, name, transposed), None))
        return found
    if "router" in type(module).__name__.lower():
        w = module._parameters.get("weight")
        if w is not None and w.dim() == 2:
            return [("weight", FunctionalLinearHelper(module), None)]
    return []


class FunctionalLinearHelper(LinearHelper):
    """A module holding a bare 2-D ``weight`` (``out x in``) applied as ``F.linear(x, weight)`` inside its forward (a
    mixture-of-experts router): the rows of a linear layer, collected by function capture only."""

    capture_only = True
    reference_map = "F.linear(x, weight)"

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        self.has_bias = False

    @property
    def in_features(self) -> int:
        return int(self._weight().shape[1])

    @property
    def out_features(self) -> int:
        return int(self._weight().shape[0])


class ExpertsHelper(LayerHelper):
    """One 3-D expert parameter ``(E, out, in)`` (or ``(E, in, out)``, ``transposed``) of a module: ``E`` grouped
    blocks. Its calls come from function capture (:meth:`expert_call`, :meth:`grouped_call`)."""

    capture_only = True
    dynamic_calls = True  # the experts called vary per step: reduced at the step, not pipelined
    reducible = False  # every token is an example (K-FAC-expand)

    def __init__(self, module: nn.Module, name: str, transposed: bool) -> None:
        super().__init__(module)
        self.name = name
        self.transposed = transposed
        self.has_bias = False
        p = self._weight()
        self.groups = int(p.shape[0])
        self._in = int(p.shape[1] if transposed else p.shape[2])
        self._out = int(p.shape[2] if transposed else p.shape[1])
        self.tokens = 0  # tokens entering the block in its current forward (N: set by the block's pre-hook)

    def _weight(self) -> nn.Parameter:
        return cast(nn.Parameter, self.module._parameters[self.name])

    @property
    def in_features(self) -> int:
        return self._in

    @property
    def out_features(self) -> int:
        return self._out

    def factor_shapes(self, max_side: int) -> tuple[FactorShape, FactorShape]:
        return (self.groups, self._in, self._in), (self.groups, self._out, self._out)

    def too_large(self, max_side: int) -> str | None:
        """Why the stack is left to the optimizer (a side above ``max_factor_side``: dense per-expert blocks only)."""
        side = max(self._in, self._out)
        if side > max_side:
            return (f"an expert stack of {self.groups} experts whose factor side {side} is above max_factor_side="
                    f"{max_side} (experts are kept as dense per-expert blocks); raise max_factor_side to "
                    "precondition it")
        return None

    def _as_matrix(self, part: torch.Tensor) -> torch.Tensor:
        return part.transpose(-1, -2) if self.transposed else part

    def _from_matrix(self, block: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
        return block.transpose(-1, -2) if self.transposed else block

    def record_tokens(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The block's forward pre-hook: ``N``, the tokens of its first tensor input."""
        x = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
        if isinstance(x, torch.Tensor) and x.dim() >= 1:
            self.tokens = x.numel() // x.shape[-1] if x.dim() >= 2 else x.shape[0]

    def expert_call(self, e: int) -> LayerHelper:
        return _ExpertCall(self, e)

    def grouped_call(self, offs: torch.Tensor) -> LayerHelper:
        return _GroupedCall(self, offs)


class _Call(LayerHelper):
    """One captured call of an expert stack: the stack's geometry, its own rows and which blocks they add to."""

    reducible = False
    counts_rows = True
    dynamic_calls = True

    def __init__(self, stack: ExpertsHelper) -> None:
        self.module = stack.module
        self.stack = stack
        self.has_bias = False
        self.groups = stack.groups

    @property
    def in_features(self) -> int:
        return self.stack.in_features

    @property
    def out_features(self) -> int:
        return self.stack.out_features

    def examples(self, x: torch.Tensor, reduce: bool) -> int:
        return self.stack.tokens or x.numel() // max(x.shape[-1], 1)

    def factor_rows(self, x: torch.Tensor, reduce: bool, dtype: torch.dtype) -> torch.Tensor:
        return x.reshape(-1, x.shape[-1]).to(dtype)

    def g_rows(self, grad_output: torch.Tensor) -> torch.Tensor:
        return grad_output.reshape(-1, grad_output.shape[-1])


class _ExpertCall(_Call):
    """``F.linear(tokens, stack[e])`` (or ``tokens @ stack[e]``): expert ``e``'s rows."""

    def __init__(self, stack: ExpertsHelper, e: int) -> None:
        super().__init__(stack)
        self.e = e

    def add_gram(self, xx: torch.Tensor, a: torch.Tensor, first: bool, shape: FactorShape) -> None:
        if first:
            xx.zero_()
        xx[self.e].addmm_(a.T, a)

    def add_g_gram(self, dd: torch.Tensor, d: torch.Tensor, first: bool, shape: FactorShape) -> None:
        if first:
            dd.zero_()
        dd[self.e].addmm_(d.T, d)

    def count_rows(self, counts: torch.Tensor, a: torch.Tensor) -> None:
        counts[self.e] += a.shape[0]


class _GroupedCall(_Call):
    """``grouped_mm(tokens sorted by expert, stack, offs)``: rows ``offs[e-1]:offs[e]`` are expert ``e``'s (rows
    past ``offs[-1]`` belong to none). Summed per expert on the device (no host read of the offsets)."""

    def __init__(self, stack: ExpertsHelper, offs: torch.Tensor) -> None:
        super().__init__(stack)
        self.offs = offs

    def _segments(self, rows: torch.Tensor) -> torch.Tensor:
        """Each row's expert (``E`` for a row past the last offset), on the device."""
        r = torch.arange(rows.shape[0], device=rows.device, dtype=self.offs.dtype)
        return torch.searchsorted(self.offs, r, right=True)

    def _grams(self, rows: torch.Tensor) -> torch.Tensor:
        """``(E, n, n)``: per expert, the Gram sum of its rows."""
        E, n = self.groups, rows.shape[1]
        grouped = getattr(torch.nn.functional, "grouped_mm", None)
        if grouped is not None:
            # grouped_mm with offsets along K gives one Gram matrix per expert; its kernels want 16-byte strides,
            # so the columns are padded with zeros to a multiple of that (sliced off after).
            step = max(1, 16 // rows.element_size())
            pad = (-n) % step
            r = torch.nn.functional.pad(rows, (0, pad)) if pad else rows
            try:
                g: torch.Tensor = grouped(r.T, r, offs=self.offs.to(torch.int32))
                return g[:, :n, :n] if pad else g
            except (RuntimeError, NotImplementedError):
                pass  # (a dtype or device without the kernel: the masked product below)
        seg = self._segments(rows)
        onehot = (seg.unsqueeze(0) == torch.arange(E, device=rows.device).unsqueeze(1)).to(rows.dtype)  # E x R
        weighted = onehot.unsqueeze(-1) * rows.unsqueeze(0)  # E x R x n
        return torch.bmm(weighted.transpose(1, 2), rows.unsqueeze(0).expand(E, -1, -1))

    def add_gram(self, xx: torch.Tensor, a: torch.Tensor, first: bool, shape: FactorShape) -> None:
        g = self._grams(a)
        if first:
            xx.copy_(g)
        else:
            xx.add_(g)

    def add_g_gram(self, dd: torch.Tensor, d: torch.Tensor, first: bool, shape: FactorShape) -> None:
        self.add_gram(dd, d, first, shape)

    def count_rows(self, counts: torch.Tensor, a: torch.Tensor) -> None:
        offs = self.offs.to(counts.dtype)
        counts.add_(torch.diff(offs, prepend=offs.new_zeros(1)))


def fill_empty_groups(new: torch.Tensor, running: torch.Tensor | None, counts: torch.Tensor) -> None:
    """In place: the blocks of ``new`` (``E x n x n``) whose expert got no row (``counts == 0``) become the running
    factor's (the decayed average then keeps it), or, before it exists, the mean of the blocks that got rows."""
    empty = (counts == 0).view(-1, 1, 1)
    if running is not None and running.shape == new.shape:
        ref = running
    else:
        seen = (~empty).to(new.dtype)
        ref = (new * seen).sum(0, keepdim=True) / seen.sum().clamp(min=1)
    torch.where(empty, ref, new, out=new)

