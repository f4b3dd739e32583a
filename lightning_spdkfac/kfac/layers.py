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
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn


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
    # Whether K-FAC-reduce rows exist for this type (an embedding's stay expand: its A is diagonal only there).
    reducible = True

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

    def add_gram(self, xx: torch.Tensor, a: torch.Tensor, first: bool) -> None:
        """``xx = a^T a`` (``first``) or ``xx += a^T a``, in place: the A sum of one call."""
        if first:
            torch.mm(a.T, a, out=xx)
        else:
            xx.addmm_(a.T, a)

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
        """``[dW, db]`` as one ``out x a_dim`` matrix, from ``grads`` (parameter -> gradient
        tensor, see :mod:`lightning_spdkfac.kfac.gradients`); None when one of them has none."""
        wg = grads.get(self._weight())
        if wg is None:
            return None
        g = self._as_matrix(self._weight_part(wg))
        if self.has_bias:
            bg = grads.get(self._bias())
            if bg is None:
                return None
            g = torch.cat([g, self._bias_part(bg).reshape(-1, 1)], dim=1)
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
        _scaled_copy(part, self._from_matrix(matrix[:, :n_in], part), scale)
        if self.has_bias:
            bg = grads[self._bias()]
            assert bg is not None  # likewise for the bias
            part = self._bias_part(bg)
            _scaled_copy(part, matrix[:, n_in].reshape(part.shape), scale)


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


class ConvHelper(LayerHelper):
    """``nn.Conv1d``, ``nn.Conv2d`` and ``nn.Conv3d`` (groups=1) with any stride, padding, dilation and padding
    mode (KFC rows: one per output position, the patch of the input it reads)."""

    # reduce: expand's A costs (C k...)^2 * positions per example, many times the convolution itself, and a
    # vision loss is per image (K-FAC-reduce's setting); measured faster to target (README).
    auto_reduce = True
    module: nn.Conv1d | nn.Conv2d | nn.Conv3d

    def __init__(self, module: nn.Conv1d | nn.Conv2d | nn.Conv3d) -> None:
        super().__init__(module)
        self.spatial = len(module.kernel_size)
        self.unbatched_dim = self.spatial + 1

    @property
    def in_features(self) -> int:
        return self.module.in_channels * math.prod(self.module.kernel_size)

    @property
    def out_features(self) -> int:
        return self.module.out_channels

    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        """The batched input, padded exactly as the module's forward pads it, in whatever memory format.

        Not copied to a contiguous tensor: the row extraction below reads through the input's own strides,
        so a ``channels_last`` (or any strided) input is read in place. ``_reversed_padding_repeated_twice`` is
        the module's own padding of every side (string padding 'same' / 'valid' resolved, asymmetric included).
        """
        m = self.module
        if x.dim() == self.unbatched_dim:
            x = x.unsqueeze(0)
        pad = m._reversed_padding_repeated_twice
        if any(pad):
            x = F.pad(x, pad, mode="constant" if m.padding_mode == "zeros" else m.padding_mode)
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
        return patches.reshape(-1, self.in_features)

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
        return t.reshape(t.shape[0], -1).mul_(1.0 / positions)

    def _batched(self, grad_output: torch.Tensor) -> torch.Tensor:
        return grad_output.unsqueeze(0) if grad_output.dim() == self.unbatched_dim else grad_output

    def g_rows(self, grad_output: torch.Tensor) -> torch.Tensor:
        g = self._batched(grad_output)
        # (B, out, *spatial) -> (B*positions, out)
        return g.flatten(2).transpose(1, 2).reshape(-1, g.shape[1])

    def g_reduced(self, grad_output: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        g = self._batched(grad_output)
        return g.flatten(2).sum(2, dtype=dtype)  # (B, out, *spatial) -> (B, out)


class EmbeddingHelper(LayerHelper):
    """``nn.Embedding``: an input row is the one-hot vector of the token, so A is the diagonal matrix of the
    token frequencies (a padding_idx token's row is zero: its weight row gets no gradient), and G the full
    ``embedding_dim`` output-gradient covariance; every position is an example (K-FAC-expand only).

    A is kept as a dense ``vocab x vocab`` matrix (diagonal) so that factor reduction, inversion, checkpoints
    and the distributed plan treat it like any other factor; hence the vocabulary limit
    :data:`EMBEDDING_MAX_VOCAB`. The weight is ``vocab x dim``: its gradient matrix is the transpose.
    """

    reducible = False
    module: nn.Embedding

    @property
    def in_features(self) -> int:
        return self.module.num_embeddings

    @property
    def out_features(self) -> int:
        return self.module.embedding_dim

    def examples(self, x: torch.Tensor, reduce: bool) -> int:
        """Every position is an example (the G of a per-token loss does not depend on the sequence length)."""
        return x.numel()

    def factor_rows(self, x: torch.Tensor, reduce: bool, dtype: torch.dtype) -> torch.Tensor:
        """The token ids (``R``, int64), padding tokens as -1."""
        ids = x.reshape(-1).long()
        pad = self.module.padding_idx
        return ids if pad is None else ids.masked_fill(ids == pad, -1)

    def add_gram(self, xx: torch.Tensor, a: torch.Tensor, first: bool) -> None:
        """The token counts on the diagonal (sum of the one-hot rows' outer products), padding left out."""
        if first:
            xx.zero_()
        # Weighted, not filtered: a boolean mask would make the GPU wait for the host (nonzero).
        xx.diagonal().index_add_(0, a.clamp(min=0), (a >= 0).to(xx.dtype))

    def g_rows(self, grad_output: torch.Tensor) -> torch.Tensor:
        return grad_output.reshape(-1, grad_output.shape[-1])

    def _as_matrix(self, part: torch.Tensor) -> torch.Tensor:
        return part.T

    def _from_matrix(self, block: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
        return block.T


# nn.Embedding gets K-FAC up to this vocabulary size: its diagonal A is stored (and inverted) as a dense matrix
# (4096^2 floats: 64 MiB in float32); a larger one is skipped with a warning.
EMBEDDING_MAX_VOCAB = 4096


def embedding_refusal(module: nn.Embedding) -> str | None:
    """Why an ``nn.Embedding`` is left to the optimizer (None: it gets K-FAC)."""
    if module.sparse:
        return ("sparse=True: its gradient is a sparse tensor, which K-FAC does not precondition; left to the "
                "optimizer unpreconditioned (use sparse=False for K-FAC)")
    if module.max_norm is not None:
        return ("max_norm renormalizes the weight in place in every forward, which K-FAC's factors do not model; "
                "left to the optimizer unpreconditioned")
    if module.scale_grad_by_freq:
        return ("scale_grad_by_freq rescales its gradient by the batch's token counts, which K-FAC's factors do "
                "not model; left to the optimizer unpreconditioned")
    if module.num_embeddings > EMBEDDING_MAX_VOCAB:
        return (f"its vocabulary ({module.num_embeddings}) is above EMBEDDING_MAX_VOCAB={EMBEDDING_MAX_VOCAB}, "
                "the largest whose diagonal A factor K-FAC stores as a dense matrix; left to the optimizer "
                "unpreconditioned")
    return None


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


CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
SUPPORTED_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, *CONV_TYPES, nn.Embedding)

# Layer types with trainable weights that K-FAC does not handle, and why: named in one warning at setup.
UNSUPPORTED_TYPES: tuple[tuple[type, str], ...] = (
    (nn.modules.conv._ConvTransposeNd, "transposed convolutions are not supported"),
    (nn.modules.lazy.LazyModuleMixin, "its parameters are not initialized yet (build the preconditioner after "
                                      "the first forward)"),
    (nn.RNNBase, "recurrent layers are not supported"),
    (nn.Bilinear, "bilinear layers are not supported"),
    (nn.EmbeddingBag, "bag embeddings are not supported"),
)


def unsupported_reason(module: nn.Module) -> str | None:
    """Why a layer type with a weight K-FAC could be expected to handle is not handled (None: not such a type)."""
    for cls, why in UNSUPPORTED_TYPES:
        if isinstance(module, cls):
            return why
    return None


def make_helper(module: nn.Module) -> tuple[LayerHelper | None, str | None]:
    """The helper for a module, or ``(None, reason)`` when the module is not supported (reason None: not a
    layer type K-FAC looks at; see :func:`unsupported_reason` for the types it names)."""
    if isinstance(module, nn.modules.lazy.LazyModuleMixin) or not isinstance(module, SUPPORTED_TYPES):
        return None, None
    computed = computed_parameter(module)
    if computed is not None:
        return None, computed
    if isinstance(module, nn.Linear):
        return LinearHelper(module), None
    if isinstance(module, nn.Embedding):
        why = embedding_refusal(module)
        return (EmbeddingHelper(module), None) if why is None else (None, why)
    if module.groups != 1:
        return None, f"grouped convolution (groups={module.groups}) is not supported by K-FAC"
    return ConvHelper(cast(nn.Conv1d | nn.Conv2d | nn.Conv3d, module)), None


def linear_and_conv_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` of a type K-FAC supports, each once: ``model.modules()`` without building
    every module's name (half the time; this runs on factor steps)."""
    found: list[nn.Module] = []
    stack, seen = [model], {id(model)}
    while stack:
        module = stack.pop()
        if isinstance(module, SUPPORTED_TYPES):
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
    a module K-FAC does not handle (a layer skipped for another reason, a parent that holds the parameter), whose
    part of the gradient the factors would not see. Two exceptions: an ``nn.Embedding`` tied to an ``nn.Linear``
    head is preconditioned by the head's block alone (:func:`_untie_embeddings`), and the q, k and v rows of one
    packed attention weight are separate blocks (:meth:`LayerHelper.param_keys` names the part each uses).
    """
    owners: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append((name, module))
    candidates, refused, tied = _untie_embeddings(candidates, owners)
    inside = {id(helper.owner()) for _, _, helper in candidates} | tied
    root = list(range(len(candidates)))

    def find(i: int) -> int:
        while root[i] != i:
            root[i] = root[root[i]]
            i = root[i]
        return i

    # Two blocks share when they use one parameter and one of them uses all of it, or both the same part
    # (the q, k and v rows of one packed attention weight are three blocks that share nothing).
    users: dict[int, list[tuple[int, Any]]] = {}  # parameter id -> (candidate, part)
    outside: list[tuple[int, str, nn.Module]] = []  # (candidate, name, module K-FAC does not handle)
    for i, (_, _, helper) in enumerate(candidates):
        for pid, part in helper.param_keys():
            for j, other_part in users.get(pid, []):
                if part is None or other_part is None or part == other_part:
                    root[find(j)] = find(i)
            users.setdefault(pid, []).append((i, part))
            outside.extend((i, other_name, other) for other_name, other in owners.get(pid, [])
                           if id(other) not in inside)
    groups: dict[int, list[Candidate]] = {}
    for i, candidate in enumerate(candidates):
        groups.setdefault(find(i), []).append(candidate)
    used_by: dict[int, dict[str, str]] = {}  # group root -> outside module name -> its type
    for i, other_name, other in outside:
        used_by.setdefault(find(i), {})[other_name or "<root>"] = type(other).__name__
    return [(group, _why_not_one_block(group, used_by.get(r))) for r, group in groups.items()] + refused


def _untie_embeddings(candidates: list[Candidate], owners: dict[int, list[tuple[str, nn.Module]]]
                      ) -> tuple[list[Candidate], list[tuple[list[Candidate], str | None]], set[int]]:
    """An ``nn.Embedding`` whose weight is an ``nn.Linear``'s (a tied LM head): the Linear's block preconditions
    the shared weight's whole gradient, the embedding's part included (with the head's factors), and the
    embedding gets no block of its own, so the parameter is preconditioned once.

    Returns the candidates without such embeddings, the embeddings' refused groups, and the ids of every such
    embedding module (a candidate or not: it does not make the head's weight "used outside" K-FAC).
    """
    heads = {id(h._weight()): name for name, _, h in candidates if type(h) is LinearHelper}
    tied: dict[int, str] = {}  # embedding module id -> the head's name
    for pid, head in heads.items():
        for _, other in owners.get(pid, []):
            if isinstance(other, nn.Embedding) and id(other.weight) == pid:
                tied[id(other)] = head
    kept = [c for c in candidates if id(c[1]) not in tied]
    refused: list[tuple[list[Candidate], str | None]] = [
        ([c], f"its weight is tied to {tied[id(c[1])]!r} (nn.Linear), whose K-FAC block preconditions the shared "
              "weight's whole gradient (this embedding's part included, with the head's factors); no block of "
              "its own, so the parameter is preconditioned once")
        for c in candidates if id(c[1]) in tied]
    return kept, refused, set(tied)


def _why_not_one_block(group: list[Candidate], outside: dict[str, str] | None) -> str | None:
    if outside:
        used_by = ", ".join(f"{n!r} ({t})" for n, t in outside.items())
        return (f"a parameter is also used by {used_by}, whose part of the gradient K-FAC's factors do not see "
                "(e.g. an embedding tied to a head); left to the optimizer unpreconditioned")
    if len(group) == 1:
        return None
    first = group[0][2].param_keys()
    if any(type(h) is not type(group[0][2]) for _, _, h in group):
        return "they share parameters but are layers of different kinds; left to the optimizer unpreconditioned"
    if any(helper.param_keys() != first for _, _, helper in group[1:]):
        return ("they share some but not all of their parameters (e.g. the weight but not the bias), which is "
                "not one Kronecker-factored block; left to the optimizer unpreconditioned")
    return None
