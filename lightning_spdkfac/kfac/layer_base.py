"""The base of every layer helper: how a module's input and output gradient become Kronecker-factor rows, how its
gradient reads as one matrix, and which layout (dense, diagonal, grouped) its factors take.

A helper knows, for one module type, how to turn the layer input into the rows ``a_r`` of the A factor and the
output gradient into the rows ``d_r`` of the G factor (one per position: K-FAC-expand; or one per example,
aggregated over its positions: K-FAC-reduce), how to read the gradient of the weight (and bias) as one
``out x in`` matrix (``b x out x in`` for a grouped layer), and how to write a preconditioned matrix back. Nothing
here keeps state across steps or touches torch.distributed. New module types are registered with
:func:`lightning_spdkfac.kfac.layers.register_layer_type`; docs/math.md has the definitions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import nn

from ..factor_shapes import FactorShape
from . import factors
from .forward_check import verify_output as _verify_output


class LayerHelper:
    """Math of one supported module. Subclasses fill in the row extraction."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.has_bias = getattr(module, "bias", None) is not None

    # The parameters, read from the module at each use. torch's stubs type ``weight`` as a Tensor and
    # leave ``nn.Linear.bias`` to ``Module.__getattr__``; both are the module's Parameters.
    def _weight(self) -> nn.Parameter:
        return cast(nn.Parameter, self.module.weight)

    def _bias(self) -> nn.Parameter:
        """The bias (only where ``has_bias``)."""
        return cast(nn.Parameter, self.module.bias)

    # -- shapes -----------------------------------------------------------------------
    @property
    def a_dim(self) -> int:
        """Side of the A factor (inputs per output, plus one for the bias)."""
        return self.in_features + int(self.has_bias)

    @property
    def g_dim(self) -> int:
        """Side of the G factor (outputs)."""
        return self.out_features

    @property
    def in_features(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def out_features(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def factor_shapes(self, max_side: int) -> tuple[FactorShape, FactorShape]:
        """The shapes of (A, G) under the size policy: a dense side above ``max_side`` is kept diagonal. A grouped
        layer's blocks stay dense whatever their side (a group's side is small: a convolution's channels per group
        times its kernel), so that both factors have the same blocks."""
        if self.groups > 1:
            return (self.groups, self.a_dim, self.a_dim), (self.groups, self.g_dim, self.g_dim)

        def shape(n: int, diagonal: bool) -> FactorShape:
            return (n,) if diagonal or n > max_side else (n, n)

        return shape(self.a_dim, self.a_diagonal), shape(self.g_dim, self.g_diagonal)

    # -- factor rows ------------------------------------------------------------------
    def batch_size(self, x: torch.Tensor) -> int:
        """B: the first dimension of the layer input (1 for an unbatched input)."""
        return 1 if x.dim() == self.unbatched_dim else x.shape[0]

    def examples(self, x: torch.Tensor, reduce: bool) -> int:
        """N in G = N sum d d^T: the number of loss terms the output gradients average over.

        An example per batch entry (KFC's convention for images: one loss per image); see
        :meth:`LinearHelper.examples` for sequences.
        """
        return self.batch_size(x)

    unbatched_dim = -1
    # Layout of the factors (factor_shapes): ``groups`` > 1 makes both grouped (one dense block per group, sides
    # per group); ``a_diagonal`` / ``g_diagonal`` make a factor diagonal whatever its side (an embedding's A is
    # diagonal by nature). Any other side above ``max_factor_side`` is kept diagonal too (:meth:`factor_shapes`).
    groups = 1
    a_diagonal = False
    g_diagonal = False
    # Whether :meth:`check_forward` must see the layer's first collected call (a module whose forward may not be
    # what its attributes say: kfac/conv.py); it clears the flag once done.
    needs_check = False
    # A block collected by function capture only (kfac/capture.py): its module's forward is not its map (an expert
    # stack, a router's bare weight: kfac/experts.py), so no forward hook collects it.
    capture_only = False
    # Whether its number of calls per step varies (the experts a batch reaches): reduced at the step, not pipelined.
    dynamic_calls = False
    # Whether the layer's map is ``x @ weight`` (its weight stored ``in x out``): how function capture tells a use
    # of the weight that is the layer's map from a transposed one.
    capture_transposed = False
    # What factor_approx="auto" uses for this layer type (docs/math.md, "K-FAC-expand and K-FAC-reduce").
    auto_reduce = False
    # Whether K-FAC-reduce rows exist for this type (an embedding's stay expand: its A is diagonal only there).
    reducible = True

    # Whether :meth:`check_forward` also recomputes the output (set by ``make_helper`` for a subclass of the
    # registered type that overrides forward: kfac/forward_check.py); the check clears it once done.
    verify_output = False
    # The map :meth:`expected_output` computes, as the error of a mismatch names it.
    reference_map = "the map the helper assumes"

    def check_forward(self, name: str, x: torch.Tensor, output: Any) -> None:
        """Verify that the rows describe what the module's forward computed (raise naming ``name`` if not)."""
        self.needs_check = False
        if self.verify_output:
            _verify_output(self, name, x, output)
            self.needs_check = self.verify_output  # (an empty input: checked at the next call)

    def expected_output(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | str:
        """What the module computes from ``x`` if it is the map this helper assumes (float32, no grad), with a
        0-d bool tensor telling whether ``x`` is an input the map takes (None: any it runs on), or a reason why
        ``x`` cannot be one. Only for a type whose ``verify_output`` can be set (kfac/forward_check.py)."""
        raise NotImplementedError(f"{type(self).__name__} cannot recompute its module's output")

    def input_requirement(self) -> str:
        """What an input must be, as the error of an input the map does not take names it."""
        return "an input of the map the helper assumes"

    def a_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The input rows ``R x in`` without the bias column (the 1s are added in closed form)."""
        raise NotImplementedError  # pragma: no cover

    def g_rows(self, grad_output: torch.Tensor) -> torch.Tensor:
        """The output-gradient rows ``R x out``."""
        raise NotImplementedError  # pragma: no cover

    def a_reduced(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """K-FAC-reduce input rows ``B x in`` in ``dtype``: per example, the mean of its rows ``a_r``
        (without the bias column, whose mean is 1)."""
        raise NotImplementedError  # pragma: no cover

    def g_reduced(self, grad_output: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """K-FAC-reduce output-gradient rows ``B x out`` in ``dtype``: per example, the sum of its rows ``d_r``."""
        raise NotImplementedError  # pragma: no cover

    def factor_rows(self, x: torch.Tensor, reduce: bool, dtype: torch.dtype) -> torch.Tensor:
        """The rows of one call's input that :meth:`add_gram` takes (``R x in`` in ``dtype``)."""
        return self.a_reduced(x, dtype) if reduce else self.a_rows(x).to(dtype)

    def add_gram(self, xx: torch.Tensor, a: torch.Tensor, first: bool, shape: FactorShape) -> None:
        """``xx = a^T a`` (``first``) or ``xx += a^T a``, in place, in ``shape``'s layout: the A sum of one call."""
        factors.gram(xx, a, shape, first)

    def add_g_gram(self, dd: torch.Tensor, d: torch.Tensor, first: bool, shape: FactorShape) -> None:
        """``dd = d^T d`` (``first``) or ``dd += d^T d``, in place: the G sum of one call (an expert's call adds to its
        own block only: kfac/experts.py)."""
        factors.gram(dd, d, shape, first)

    counts_rows = False  # whether count_rows keeps per-block counts (layer.group_rows)

    def count_rows(self, counts: torch.Tensor, a: torch.Tensor) -> None:
        """Add one call's rows to the per-block row counts of a layer whose blocks see different rows (an expert
        stack: kfac/experts.py); nothing for any other layer (every block sees every row)."""

    # -- gradient as a matrix ---------------------------------------------------------
    def params(self) -> list[torch.nn.Parameter]:
        """The parameters whose gradients form :meth:`grad_matrix`: the weight, then the bias."""
        return [self._weight()] + ([self._bias()] if self.has_bias else [])

    def param_keys(self) -> list[tuple[int, Any]]:
        """What the block occupies, for :func:`shared_parameter_groups`: (parameter id, which part of it;
        None: the whole parameter), the weight first."""
        return [(id(p), None) for p in self.params()]

    def owner(self) -> nn.Module:
        """The module that holds the parameters (``self.module``, except for a projection of an attention)."""
        return self.module

    # The part of the weight's (bias's) gradient this block covers, as a tensor to read and write in place,
    # and how it is laid out as the ``out x in`` matrix; a block of rows of a packed weight overrides these.
    def _weight_part(self, wg: torch.Tensor) -> torch.Tensor:
        return wg

    def _bias_part(self, bg: torch.Tensor) -> torch.Tensor:
        return bg

    def _as_matrix(self, part: torch.Tensor) -> torch.Tensor:
        return part.reshape(part.shape[0], -1)

    def _from_matrix(self, block: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
        return block.reshape(part.shape)

    def grad_matrix(self, grads: Mapping[nn.Parameter, torch.Tensor | None]) -> torch.Tensor | None:
        """``[dW, db]`` as one ``out x a_dim`` matrix (``groups x out x a_dim`` for a grouped layer), from ``grads`` (parameter -> gradient
        tensor, see :mod:`lightning_spdkfac.kfac.gradients`); None when one of them has none."""
        wg = grads.get(self._weight())
        if wg is None:
            return None
        g = self._as_matrix(self._weight_part(wg))
        if self.has_bias:
            bg = grads.get(self._bias())
            if bg is None:
                return None
            g = torch.cat([g, self._bias_part(bg).reshape(*g.shape[:-1], 1)], dim=-1)
        return g

    def write_grad(self, matrix: torch.Tensor, scale: torch.Tensor | None,
                   grads: Mapping[nn.Parameter, torch.Tensor | None]) -> None:
        """Write ``scale * matrix`` back into the gradient tensors of ``grads``, in place.

        ``matrix`` came from :meth:`grad_matrix` of the same ``grads``, so every gradient is there.
        The source is shaped like each gradient, not the gradient like the matrix: a gradient in any memory
        format (a ``channels_last`` convolution weight's is not contiguous) is written through its own strides.
        """
        n_in = self.in_features
        wg = grads[self._weight()]
        assert wg is not None  # grad_matrix returned a matrix: the weight has a gradient
        part = self._weight_part(wg)
        _scaled_copy(part, self._from_matrix(matrix[..., :n_in], part), scale)
        if self.has_bias:
            bg = grads[self._bias()]
            assert bg is not None  # likewise for the bias
            part = self._bias_part(bg)
            _scaled_copy(part, matrix[..., n_in].reshape(part.shape), scale)


def _scaled_copy(dst: torch.Tensor, src: torch.Tensor, scale: torch.Tensor | None) -> None:
    if scale is None:
        dst.copy_(src)
    elif src.dtype == dst.dtype:
        torch.mul(src, scale, out=dst)
    else:
        dst.copy_(src * scale)
