"""Per-layer-type math: how a module's input and output gradient become Kronecker-factor rows.

Each helper knows, for one module type, how to turn the layer input into the rows ``a_r`` of
the A factor and the output gradient into the rows ``d_r`` of the G factor (one per position:
K-FAC-expand; or one per example, aggregated over its positions: K-FAC-reduce), how to read the
gradient of the weight (and bias) as one ``out x in`` matrix, and how to write a
preconditioned matrix back. Nothing here keeps state across steps or touches torch.distributed.
See docs/math.md for the definitions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn


class LayerHelper:
    """Math of one supported module. Subclasses fill in the row extraction."""

    def __init__(self, module: nn.Linear | nn.Conv2d) -> None:
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
    # What factor_approx="auto" uses for this layer type (docs/math.md, "K-FAC-expand and K-FAC-reduce").
    auto_reduce = False

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

    # -- gradient as a matrix ---------------------------------------------------------
    def params(self) -> list[torch.nn.Parameter]:
        """The parameters whose gradients form :meth:`grad_matrix`: the weight, then the bias."""
        return [self._weight()] + ([self._bias()] if self.has_bias else [])

    def grad_matrix(self, grads: Mapping[nn.Parameter, torch.Tensor | None]) -> torch.Tensor | None:
        """``[dW, db]`` as one ``out x a_dim`` matrix, from ``grads`` (parameter -> gradient
        tensor, see :mod:`lightning_spdkfac.kfac.gradients`); None when one of them has none."""
        w = self._weight()
        wg = grads.get(w)
        if wg is None:
            return None
        g = wg.reshape(w.shape[0], -1)
        if self.has_bias:
            bg = grads.get(self._bias())
            if bg is None:
                return None
            g = torch.cat([g, bg.reshape(-1, 1)], dim=1)
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
        _scaled_copy(wg, matrix[:, :n_in].reshape(wg.shape), scale)
        if self.has_bias:
            bg = grads[self._bias()]
            assert bg is not None  # likewise for the bias
            _scaled_copy(bg, matrix[:, n_in].reshape(bg.shape), scale)


def _scaled_copy(dst: torch.Tensor, src: torch.Tensor, scale: torch.Tensor | None) -> None:
    if scale is None:
        dst.copy_(src)
    elif src.dtype == dst.dtype:
        torch.mul(src, scale, out=dst)
    else:
        dst.copy_(src * scale)


class LinearHelper(LayerHelper):
    """``nn.Linear`` with inputs of any number of leading dimensions (contiguous or not)."""

    unbatched_dim = 1
    module: nn.Linear

    def __init__(self, module: nn.Linear) -> None:
        super().__init__(module)

    @property
    def in_features(self) -> int:
        return self.module.in_features

    @property
    def out_features(self) -> int:
        return self.module.out_features

    def a_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, x.shape[-1])

    def examples(self, x: torch.Tensor, reduce: bool) -> int:
        """Every position of a sequence input is an example in ``"expand"`` (K-FAC-expand's setting: a
        loss term per position, e.g. a per-token mean cross-entropy, whose G then does not depend on
        the sequence length); ``"reduce"`` aggregates the positions of an example into one row."""
        if reduce or x.dim() <= 2:
            return self.batch_size(x)
        return math.prod(x.shape[:-1])  # the rows of a_rows(x)

    def g_rows(self, grad_output: torch.Tensor) -> torch.Tensor:
        return grad_output.reshape(-1, grad_output.shape[-1])

    # One position per example for inputs of at most two dims: the rows themselves, bit for bit.
    def a_reduced(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if x.dim() <= 2:
            return self.a_rows(x).to(dtype)
        return x.reshape(x.shape[0], -1, x.shape[-1]).mean(1, dtype=dtype)

    def g_reduced(self, grad_output: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if grad_output.dim() <= 2:
            return self.g_rows(grad_output).to(dtype)
        return grad_output.reshape(grad_output.shape[0], -1, grad_output.shape[-1]).sum(1, dtype=dtype)


class Conv2dHelper(LayerHelper):
    """``nn.Conv2d`` (groups=1) with any stride, padding, dilation and padding mode (KFC rows)."""

    unbatched_dim = 3
    # reduce: expand's A costs (C kh kw)^2 Ho Wo per image, many times the convolution itself, and a
    # vision loss is per image (K-FAC-reduce's setting); measured faster to target (README).
    auto_reduce = True
    module: nn.Conv2d

    def __init__(self, module: nn.Conv2d) -> None:
        super().__init__(module)
        m = module
        self._explicit_pad = isinstance(m.padding, str) or m.padding_mode != "zeros"

    @property
    def in_features(self) -> int:
        m = self.module
        return m.in_channels * m.kernel_size[0] * m.kernel_size[1]

    @property
    def out_features(self) -> int:
        return self.module.out_channels

    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        """The batched input, padded exactly as the module's forward pads it, in whatever memory format.

        Not copied to a contiguous tensor: the row extraction below reads through the input's own strides,
        so a ``channels_last`` (or any strided) input is read in place.
        """
        m = self.module
        if x.dim() == 3:
            x = x.unsqueeze(0)
        if self._explicit_pad:
            # String padding ('same', 'valid') and non-zero padding modes: pad exactly as the
            # module's forward does.
            mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
            x = F.pad(x, m._reversed_padding_repeated_twice, mode=mode)
        elif not isinstance(m.padding, str) and (m.padding[0] or m.padding[1]):  # str: explicit above
            x = F.pad(x, (m.padding[1], m.padding[1], m.padding[0], m.padding[0]))
        return x

    def _out_size(self, H: int, W: int) -> tuple[int, int]:
        """(Ho, Wo) of a padded ``H x W`` input."""
        (kh, kw), (sh, sw), (dh, dw) = self.module.kernel_size, self.module.stride, self.module.dilation
        return (H - dh * (kh - 1) - 1) // sh + 1, (W - dw * (kw - 1) - 1) // sw + 1

    def a_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Patch rows ``R x (C*kh*kw)``, columns in the order of ``weight.view(out, -1)``.

        The patches are one strided view of the (padded) input, through its own strides (any memory
        format), copied once by the final reshape; ``F.unfold`` followed by the transpose to rows would
        copy them twice.
        """
        m = self.module
        x = self._padded(x)
        (kh, kw), (sh, sw), (dh, dw) = m.kernel_size, m.stride, m.dilation
        B, C, H, W = x.shape
        ho, wo = self._out_size(H, W)
        s_b, s_c, s_h, s_w = x.stride()
        patches = x.as_strided(
            (B, ho, wo, C, kh, kw),
            (s_b, sh * s_h, sw * s_w, s_c, dh * s_h, dw * s_w),
        )
        return patches.reshape(B * ho * wo, C * kh * kw)

    def a_reduced(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Mean patch of each example ``B x (C*kh*kw)``, without forming the patches.

        Entry (c, i, j) of the mean patch is the mean of ``x[c, i*dh + p*sh, j*dw + q*sw]`` over the
        output locations (p, q); the sum separates: over p for each kernel row i (a strided view of
        ``B x C x kh x W``), then over q for each kernel column j. That reads ``kh*Ho*W + kh*kw*Wo``
        values per channel instead of the ``kh*kw*Ho*Wo`` of the patches, and does no GEMM. The input is
        read through its own strides (any memory format).
        """
        m = self.module
        x = self._padded(x)
        (kh, kw), (sh, sw), (dh, dw) = m.kernel_size, m.stride, m.dilation
        B, C, H, W = x.shape
        ho, wo = self._out_size(H, W)
        s_b, s_c, s_h, s_w = x.stride()
        rows = x.as_strided((B, C, kh, W, ho), (s_b, s_c, dh * s_h, s_w, sh * s_h)).sum(-1, dtype=dtype)
        rows = rows.contiguous()  # (B, C, kh, W)
        cols = rows.as_strided((B, C, kh, kw, wo), (C * kh * W, kh * W, W, dw, sw)).sum(-1)
        return cols.reshape(B, C * kh * kw).mul_(1.0 / (ho * wo))

    def g_rows(self, grad_output: torch.Tensor) -> torch.Tensor:
        if grad_output.dim() == 3:
            grad_output = grad_output.unsqueeze(0)
        # (B, out, Ho, Wo) -> (B*Ho*Wo, out)
        return grad_output.flatten(2).transpose(1, 2).reshape(-1, grad_output.shape[1])

    def g_reduced(self, grad_output: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if grad_output.dim() == 3:
            grad_output = grad_output.unsqueeze(0)
        return grad_output.sum((2, 3), dtype=dtype)  # (B, out, Ho, Wo) -> (B, out)


def computed_parameter(module: nn.Module) -> str | None:
    """Why the module's weight (or bias) is not a Parameter of its own, or None when both are.

    ``torch.nn.utils.parametrizations.weight_norm`` / ``spectral_norm`` (and any ``parametrize``
    parametrization) make ``module.weight`` a tensor computed from other parameters at every access; the
    older ``torch.nn.utils.weight_norm`` / ``spectral_norm`` recompute it in a forward pre-hook. The
    optimizer then updates those other parameters (e.g. ``weight_g`` and ``weight_v``), whose gradients are
    not the gradient of the computed weight, and the computed weight has no ``.grad`` to precondition.
    """
    for pname in ("weight", "bias"):
        value = getattr(module, pname, None)
        if value is None or module._parameters.get(pname) is value:
            continue
        parametrizations = getattr(module, "parametrizations", None)
        if parametrizations is not None and pname in parametrizations:
            how = "parametrization " + ", ".join(type(p).__name__ for p in parametrizations[pname])
        else:
            hooks = [type(h).__name__ for h in module._forward_pre_hooks.values()]
            how = "forward pre-hook " + ", ".join(hooks) if hooks else "an attribute that is not a Parameter"
        return (
            f"its {pname} is computed from other parameters ({how}; e.g. weight_norm or spectral_norm), "
            f"and K-FAC's factors of the computed {pname} do not apply to the parameters the optimizer "
            "updates; it is left to the optimizer unpreconditioned"
        )
    return None


def make_helper(module: nn.Module) -> tuple[LayerHelper | None, str | None]:
    """The helper for a module, or ``(None, reason)`` when the module is not supported."""
    if not isinstance(module, nn.Linear | nn.Conv2d):
        return None, None
    computed = computed_parameter(module)
    if computed is not None:
        return None, computed
    if isinstance(module, nn.Linear):
        return LinearHelper(module), None
    if module.groups != 1:
        return None, f"grouped convolution (groups={module.groups}) is not supported by K-FAC"
    return Conv2dHelper(module), None


def linear_and_conv_modules(model: nn.Module) -> list[nn.Module]:
    """The ``nn.Linear`` and ``nn.Conv2d`` modules of ``model``, each once: ``model.modules()`` without
    building every module's name (half the time; this runs on factor steps)."""
    found: list[nn.Module] = []
    stack, seen = [model], {id(model)}
    while stack:
        module = stack.pop()
        if isinstance(module, nn.Linear | nn.Conv2d):
            found.append(module)
        for child in module._modules.values():
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                stack.append(child)
    return found


Candidate = tuple[str, nn.Module, LayerHelper]


def shared_parameter_groups(model: nn.Module,
                            candidates: list[Candidate]) -> list[tuple[list[Candidate], str | None]]:
    """The candidate layers grouped by the Parameters they share, each group with why it cannot be one K-FAC
    block (None: it can), in the order of each group's first layer in ``candidates``.

    A layer that shares no parameter is a group of its own. Layers that share all their parameters (``b.weight =
    a.weight`` and ``b.bias = a.bias``, of one kind) are one block: the gradient of the shared parameters is the
    sum of both layers' contributions, as for one layer called twice, and their factors sum both layers' calls.
    Any other sharing cannot be one Kronecker-factored block, so the group is refused: some but not all
    parameters shared (only the weight, or only the bias), layers of different kinds, or a parameter also used by
    a module K-FAC does not handle (an ``nn.Embedding`` tied to a head, a layer skipped for another reason,
    a parent that holds the parameter), whose part of the gradient the factors would not see.
    """
    owners: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append((name, module))
    position = {id(module): i for i, (_, module, _) in enumerate(candidates)}
    root = list(range(len(candidates)))

    def find(i: int) -> int:
        while root[i] != i:
            root[i] = root[root[i]]
            i = root[i]
        return i

    outside: list[tuple[int, str, nn.Module]] = []  # (candidate, name, module K-FAC does not handle)
    for i, (_, module, _) in enumerate(candidates):
        for p in module.parameters(recurse=False):
            for other_name, other in owners[id(p)]:
                j = position.get(id(other))
                if j is None:
                    outside.append((i, other_name, other))
                else:
                    root[find(j)] = find(i)
    groups: dict[int, list[Candidate]] = {}
    for i, candidate in enumerate(candidates):
        groups.setdefault(find(i), []).append(candidate)
    users: dict[int, dict[str, str]] = {}  # group root -> outside module name -> its type
    for i, other_name, other in outside:
        users.setdefault(find(i), {})[other_name or "<root>"] = type(other).__name__
    return [(group, _why_not_one_block(group, users.get(r))) for r, group in groups.items()]


def _why_not_one_block(group: list[Candidate], outside: dict[str, str] | None) -> str | None:
    if outside:
        used_by = ", ".join(f"{n!r} ({t})" for n, t in outside.items())
        return (f"a parameter is also used by {used_by}, whose part of the gradient K-FAC's factors do not see "
                "(e.g. an embedding tied to a head); left to the optimizer unpreconditioned")
    if len(group) == 1:
        return None
    first = [id(p) for p in group[0][1].parameters(recurse=False)]
    if any(type(h) is not type(group[0][2]) for _, _, h in group):
        return "they share parameters but are layers of different kinds; left to the optimizer unpreconditioned"
    if any([id(p) for p in module.parameters(recurse=False)] != first for _, module, _ in group[1:]):
        return ("they share some but not all of their parameters (e.g. the weight but not the bias), which is "
                "not one Kronecker-factored block; left to the optimizer unpreconditioned")
    return None
