"""Convolutions: ``nn.Conv1d/2d/3d`` of any stride, padding, dilation, padding mode and groups (docs/math.md,
"Layers and rows" and "Diagonal and grouped factors").

A grouped convolution (``groups`` > 1: ResNeXt, RegNet; depthwise, ``groups == in_channels``: MobileNet,
EfficientNet, ConvNeXt) is ``groups`` independent convolutions, each one exact Kronecker block of its own: A of
side ``in_channels/groups * prod(kernel) (+1)`` and G of side ``out_channels/groups``. They are kept as one
grouped factor (``groups x n x n``) and handled by batched kernels, never one Python object per group.

Subclasses whose ``forward`` pads the input itself (TensorFlow-style dynamic 'same' padding, as several vision
libraries do) are checked once, on their first collected call: the output the patches reproduce must be the
module's. Where it is not, the dynamic 'same' padding is tried; if that does not reproduce it either, the layer
stops the run with an error naming it, rather than building factors from the wrong patches.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from .forward_check import REFUSED, ForwardMismatch
from .layer_base import LayerHelper


class ConvHelper(LayerHelper):
    """``nn.Conv1d``, ``nn.Conv2d`` and ``nn.Conv3d`` with any stride, padding, dilation, padding mode and groups
    (KFC rows: one per output position, the patch of the input it reads; a grouped layer's rows are all its
    groups' patches side by side, in the order of ``weight.view(out, -1)`` per group)."""

    # reduce: expand's A costs (C k...)^2 * positions per example, many times the convolution itself, and a
    # vision loss is per image (K-FAC-reduce's setting); measured faster to target (README).
    auto_reduce = True
    module: nn.Conv1d | nn.Conv2d | nn.Conv3d

    def __init__(self, module: nn.Conv1d | nn.Conv2d | nn.Conv3d) -> None:
        super().__init__(module)
        self.spatial = len(module.kernel_size)
        self.unbatched_dim = self.spatial + 1
        self.groups = module.groups
        self._row_width = module.in_channels * math.prod(module.kernel_size)  # every group's patch columns
        # Padding found by check_forward for a subclass that pads inside forward: (pad, mode), F.pad's format.
        self._pad_override: tuple[list[int], str] | None = None
        # Whether check_forward must verify the first call: a subclass that overrides forward (or the conv call).
        cls = type(module)
        base = next(c for c in cls.__mro__ if c in (nn.Conv1d, nn.Conv2d, nn.Conv3d))
        self.needs_check = any(getattr(cls, f) is not getattr(base, f) for f in ("forward", "_conv_forward"))

    @property
    def in_features(self) -> int:
        """Inputs of one group's block (all inputs for groups=1)."""
        return self._row_width // self.groups

    @property
    def out_features(self) -> int:
        """Outputs of one group's block."""
        return self.module.out_channels // self.groups

    def _as_matrix(self, part: torch.Tensor) -> torch.Tensor:
        return part.reshape(part.shape[0], -1) if self.groups == 1 else part.reshape(self.groups, self.out_features, -1)

    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        """The batched input, padded exactly as the module's forward pads it, in whatever memory format.

        Not copied to a contiguous tensor: the row extraction below reads through the input's own strides,
        so a ``channels_last`` (or any strided) input is read in place. ``_reversed_padding_repeated_twice`` is
        the module's own padding of every side (string padding 'same' / 'valid' resolved, asymmetric included).
        """
        m = self.module
        if x.dim() == self.unbatched_dim:
            x = x.unsqueeze(0)
        if self._pad_override is not None:
            pad, mode = self._pad_override
        else:
            pad, mode = list(m._reversed_padding_repeated_twice), m.padding_mode
        if any(pad):
            x = F.pad(x, pad, mode="constant" if mode == "zeros" else mode)
        return x

    def _geometry(self, x: torch.Tensor) -> list[tuple[int, int, int, int]]:
        """Per spatial dim of the padded input: (kernel, stride, dilation, output size)."""
        m = self.module
        return [(k, s, d, (size - d * (k - 1) - 1) // s + 1)
                for k, s, d, size in zip(m.kernel_size, m.stride, m.dilation, x.shape[2:], strict=True)]

    def a_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Patch rows ``R x (C*k1*...*kn)``, columns in the order of ``weight.view(out, -1)``.

        The patches are one strided view of the (padded) input, through its own strides (any memory
        format), copied once by the final reshape; ``F.unfold`` followed by the transpose to rows would
        copy them twice (and exists for 2-D only).
        """
        x = self._padded(x)
        geo = self._geometry(x)
        s_b, s_c, *s_sp = x.stride()
        size = (x.shape[0], *(o for _, _, _, o in geo), x.shape[1], *(k for k, _, _, _ in geo))
        stride = (s_b, *(s * st for (_, s, _, _), st in zip(geo, s_sp)), s_c,
                  *(d * st for (_, _, d, _), st in zip(geo, s_sp)))
        patches = x.as_strided(size, stride)
        return patches.reshape(-1, self._row_width)

    def a_reduced(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Mean patch of each example ``B x (C*k1*...*kn)``, without forming the patches.

        Entry (c, i1..in) of the mean patch is the mean of ``x[c, i1*d1 + p1*s1, ...]`` over the output
        positions (p1..pn); the sum separates, one spatial dim at a time: a strided view puts (kernel index,
        output index) in place of that dim and the output index is summed away. That reads
        ``k1*O1*S2*...`` values for the first dim (instead of ``k1*...*kn*O1*...*On`` for the patches) and
        does no GEMM. The input is read through its own strides (any memory format).
        """
        t = self._padded(x)
        geo = self._geometry(t)
        for i, (k, s, d, o) in enumerate(geo):
            dim = 2 + i
            size, stride = list(t.shape), list(t.stride())
            t = t.as_strided(size[:dim] + [k, o] + size[dim + 1:],
                             stride[:dim] + [d * stride[dim], s * stride[dim]] + stride[dim + 1:])
            t = t.sum(dim + 1, dtype=dtype)  # a new tensor: the next dim's view reads its strides
        positions = math.prod(o for _, _, _, o in geo)
        # (an explicit width: an empty batch has no elements to infer it from)
        return t.reshape(t.shape[0], self._row_width).mul_(1.0 / positions)

    def _batched(self, grad_output: torch.Tensor) -> torch.Tensor:
        return grad_output.unsqueeze(0) if grad_output.dim() == self.unbatched_dim else grad_output

    def g_rows(self, grad_output: torch.Tensor) -> torch.Tensor:
        g = self._batched(grad_output)
        # (B, out, *spatial) -> (B*positions, out)
        return g.flatten(2).transpose(1, 2).reshape(-1, g.shape[1])

    def g_reduced(self, grad_output: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        g = self._batched(grad_output)
        return g.flatten(2).sum(2, dtype=dtype)  # (B, out, *spatial) -> (B, out)

    # -- the forward check ------------------------------------------------------------
    def _output_from_patches(self, x: torch.Tensor) -> torch.Tensor:
        """The convolution of the input padded as the rows read it (no further padding): the module's output iff
        the rows are its patches."""
        m = self.module
        conv = (F.conv1d, F.conv2d, F.conv3d)[self.spatial - 1]
        xp = self._padded(x.detach().float())
        bias = None if m.bias is None else m.bias.detach().float()
        out: torch.Tensor = conv(xp, m.weight.detach().float(), bias, m.stride, 0, m.dilation, m.groups)
        return out

    def _same_padding(self, x: torch.Tensor) -> list[int]:
        """TensorFlow's dynamic 'same' padding of ``x`` (extra on the right), in F.pad's order (last dim first)."""
        m = self.module
        pads: list[int] = []
        for size, k, s, d in zip(reversed(x.shape[-self.spatial:]), reversed(m.kernel_size), reversed(m.stride),
                                 reversed(m.dilation), strict=True):
            total = max((math.ceil(size / s) - 1) * s + (k - 1) * d + 1 - size, 0)
            pads += [total // 2, total - total // 2]
        return pads

    def check_forward(self, name: str, x: torch.Tensor, output: Any) -> None:
        """Verify once that the rows are the patches the module's forward convolved (see the module docstring)."""
        checked, self.needs_check = self.needs_check, False
        if not checked or not isinstance(output, torch.Tensor) or x.numel() == 0:
            return
        want = output.detach().float()
        if want.dim() == self.unbatched_dim:
            want = want.unsqueeze(0)

        failures: list[str] = []  # why an attempt could not run at all

        def matches() -> bool:
            # An attempt that cannot run (an input smaller than the kernel before the padding that makes it fit,
            # a reflect padding wider than the input) does not match; it never crashes the step.
            try:
                got = self._output_from_patches(x)
            except (RuntimeError, ValueError) as e:
                failures.append(str(e).splitlines()[0] if str(e) else type(e).__name__)
                return False
            if got.shape != want.shape:
                return False
            return bool((got - want).norm() <= 1e-2 * want.norm() + 1e-6)  # once per layer: its first call

        with torch.no_grad():
            if matches():
                return
            self._pad_override = (self._same_padding(x), self.module.padding_mode)
            if matches():
                return
            self._pad_override = None
        if len(failures) == 2:
            raise ForwardMismatch(
                f"K-FAC layer {name!r} ({type(self.module).__name__}): its forward overrides the convolution's, and "
                f"K-FAC could not check what it computes from its input of shape {tuple(x.shape)}: neither the "
                f"padding its attributes describe nor dynamic 'same' padding gives a convolution that runs "
                f"({failures[0]}; {failures[1]}). " + REFUSED.format(name=name, cls=type(self.module).__name__))
        raise ForwardMismatch(
            f"K-FAC layer {name!r} ({type(self.module).__name__}): its forward does not compute the convolution its "
            f"attributes describe (padding={self.module.padding!r}, padding_mode={self.module.padding_mode!r}, "
            f"stride={self.module.stride}, dilation={self.module.dilation}; nor dynamic 'same' padding), so K-FAC "
            "cannot tell which input patches it convolves and would build wrong factors. "
            + REFUSED.format(name=name, cls=type(self.module).__name__))


def conv_helper(module: nn.Module) -> ConvHelper:
    """The helper of an ``nn.Conv1d/2d/3d`` (the registry's factory)."""
    return ConvHelper(cast(nn.Conv1d | nn.Conv2d | nn.Conv3d, module))
