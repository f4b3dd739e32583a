"""The layer types K-FAC handles, and the registry through which a user adds their own.

Built in: ``nn.Linear``; ``transformers``' ``Conv1D`` (a linear layer whose weight is stored ``in x out``, the body
of GPT-2), matched by its qualified name so that ``transformers`` is never imported here; ``nn.Embedding``; and
``nn.Conv1d/2d/3d`` of any groups (:mod:`.conv`). Each is registered with :func:`register_layer_type`, the public
extension point: a user's own module type gets K-FAC by registering a :class:`~.layer_base.LayerHelper` subclass
(how to read its input rows, its output-gradient rows, and its weight's layout) the same way. docs/extending.md
shows one. Multi-head attention's packed projections are in :mod:`.attention`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..factor_shapes import FactorShape
from .conv import ConvHelper, conv_helper
from .forward_check import overrides_forward
from .layer_base import LayerHelper

__all__ = [
    "ConvHelper",
    "EmbeddingHelper",
    "LayerHelper",
    "LinearHelper",
    "TransposedLinearHelper",
    "make_helper",
    "register_layer_type",
    "registered_layer_types",
]


class LinearHelper(LayerHelper):
    """``nn.Linear`` with inputs of any number of leading dimensions (contiguous or not)."""

    unbatched_dim = 1
    module: nn.Linear

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

    reference_map = "F.linear(x, weight, bias)"

    def expected_output(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | str:
        if not x.is_floating_point():
            return f"a {x.dtype} input where the map takes floating-point features"
        bias = self._bias().detach().float() if self.has_bias else None
        return self._linear(x.detach().float(), self._weight().detach().float(), bias), None

    @staticmethod
    def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.nn.functional.linear(x, weight, bias)

    # One position per example for inputs of at most two dims: the rows themselves, bit for bit.
    def a_reduced(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if x.dim() <= 2:
            return self.a_rows(x).to(dtype)
        # Explicit sizes: an empty batch has no elements to infer a -1 from.
        return x.reshape(x.shape[0], math.prod(x.shape[1:-1]), x.shape[-1]).mean(1, dtype=dtype)

    def g_reduced(self, grad_output: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if grad_output.dim() <= 2:
            return self.g_rows(grad_output).to(dtype)
        g = grad_output
        return g.reshape(g.shape[0], math.prod(g.shape[1:-1]), g.shape[-1]).sum(1, dtype=dtype)


class TransposedLinearHelper(LinearHelper):
    """A linear layer whose weight is stored ``in x out`` (``y = x W + b``): ``transformers``' ``Conv1D`` (GPT-2's
    attention and MLP projections), or any module with that layout and a ``weight`` / ``bias`` of its own."""

    module: Any

    @property
    def in_features(self) -> int:
        return int(self.module.weight.shape[0])

    @property
    def out_features(self) -> int:
        return int(self.module.weight.shape[1])

    def _as_matrix(self, part: torch.Tensor) -> torch.Tensor:
        return part.T

    def _from_matrix(self, block: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
        return block.T

    reference_map = "x @ weight + bias"
    capture_transposed = True

    @staticmethod
    def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = x @ weight
        return y if bias is None else y + bias


class EmbeddingHelper(LayerHelper):
    """``nn.Embedding``: an input row is the one-hot vector of the token, so A is the diagonal matrix of the
    token frequencies (a padding_idx token's row is zero: its weight row gets no gradient), and G the full
    ``embedding_dim`` output-gradient covariance; every position is an example (K-FAC-expand only).

    A is kept as its diagonal (``vocab`` entries, whatever the vocabulary), G dense up to ``max_factor_side``.
    The weight is ``vocab x dim``: its gradient matrix is the transpose.
    """

    reducible = False
    a_diagonal = True
    needs_check = True  # (once: a batch-1 input shared by a whole batch, see check_forward)
    module: nn.Embedding

    def check_forward(self, name: str, x: torch.Tensor, output: Any) -> None:
        """Warn once about a batch-1 input of a sequence: position ids shared by the batch (GPT-2's and BERT's
        ``position_ids`` are ``1 x T``), whose output is broadcast, so that its output gradient is the sum over the
        batch's examples and its G factor depends on the per-rank batch size."""
        super().check_forward(name, x, output)  # a subclass's own forward, first (kfac/forward_check.py)
        if x.dim() >= 2 and x.shape[0] == 1 and not self.warned_batch_1:
            self.warned_batch_1 = True
            warnings.warn(
                f"K-FAC layer {name!r} (nn.Embedding) got an input of batch dimension 1 ({tuple(x.shape)}): if it is "
                "shared by the batch (position ids broadcast over the examples, as GPT-2 and BERT pass them), its "
                "output gradient is the batch's sum and its G factor depends on the per-rank batch size, so runs on "
                "different numbers of ranks differ. Pass position_ids expanded to the batch (B x T), or leave the "
                f"layer to the optimizer with skip_layers=[{name!r}]", stacklevel=2)

    warned_batch_1 = False
    reference_map = "F.embedding(ids, weight, padding_idx)"

    def expected_output(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | str:
        """The table rows of the ids, with whether every id is in the table (out-of-range ids are clamped for the
        lookup, so that a GPU does not assert: the flag is read with the comparison, in one host read)."""
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            return f"a {x.dtype} input where an embedding takes integer token ids"
        n = self.module.num_embeddings
        ids = x.detach().long()
        valid = ((ids >= 0) & (ids < n)).all()
        rows = torch.nn.functional.embedding(ids.clamp(0, n - 1), self._weight().detach(), self.module.padding_idx)
        return rows.float(), valid  # (the rows looked up, then widened: no float copy of a large table)

    def input_requirement(self) -> str:
        return f"token ids in [0, {self.module.num_embeddings}) (its num_embeddings), not all of them are"

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

    def add_gram(self, xx: torch.Tensor, a: torch.Tensor, first: bool, shape: FactorShape) -> None:
        """The token counts (the diagonal of the one-hot rows' Gram sum), padding left out."""
        if first:
            xx.zero_()
        # Weighted, not filtered: a boolean mask would make the GPU wait for the host (nonzero).
        xx.index_add_(0, a.clamp(min=0), (a >= 0).to(xx.dtype))

    def g_rows(self, grad_output: torch.Tensor) -> torch.Tensor:
        return grad_output.reshape(-1, grad_output.shape[-1])

    def _as_matrix(self, part: torch.Tensor) -> torch.Tensor:
        return part.T

    def _from_matrix(self, block: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
        return block.T


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


# -- the registry ----------------------------------------------------------------------------------------
HelperFactory = Callable[[nn.Module], LayerHelper]
# type -> factory, and "module.QualName" -> factory for types matched by name (never imported here).
_BY_TYPE: dict[type, HelperFactory] = {}
_BY_NAME: dict[str, HelperFactory] = {}
_REFUSALS: dict[type, Callable[[nn.Module], str | None]] = {}


def register_layer_type(module_type: type[nn.Module] | str, helper: HelperFactory,
                        refusal: Callable[[nn.Module], str | None] | None = None) -> None:
    """Give K-FAC a module type: every module of ``module_type`` (subclasses included, the nearest registered
    class winning) gets the block ``helper(module)`` describes.

    Args:
        module_type: the class, or its qualified name ``"package.module.ClassName"`` (matched against each
            module's class and its bases without importing the package: ``transformers``' ``Conv1D`` is
            registered so).
        helper: a :class:`~lightning_spdkfac.kfac.layer_base.LayerHelper` subclass (or any callable taking the
            module and returning one). :class:`LinearHelper`, :class:`TransposedLinearHelper` and
            :class:`ConvHelper` can be subclassed or reused as they are (docs/extending.md).
        refusal: optional; given the module, a reason to leave it to the optimizer (named in the K-FAC summary),
            or None to precondition it.

    Registering a type again replaces its helper.
    """
    if not callable(helper):
        raise TypeError(f"helper must be a LayerHelper subclass or a callable returning one, got {helper!r}")
    if isinstance(module_type, str):
        if "." not in module_type:
            raise ValueError(f"module_type: a name must be qualified ('package.module.ClassName'), got {module_type!r}")
        _BY_NAME[module_type] = helper
        return
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"module_type must be an nn.Module subclass or its qualified name, got {module_type!r}")
    _BY_TYPE[module_type] = helper
    if refusal is not None:
        _REFUSALS[module_type] = refusal


def registered_layer_types() -> list[str]:
    """The registered types, by qualified name."""
    return [f"{t.__module__}.{t.__qualname__}" for t in _BY_TYPE] + list(_BY_NAME)


Refusal = Callable[[nn.Module], str | None]


def _lookup(module: nn.Module) -> tuple[HelperFactory | None, Refusal | None, type]:
    """The factory and refusal of the nearest registered class of the module's, and that class."""
    for cls in type(module).__mro__:
        if cls in _BY_TYPE:
            return _BY_TYPE[cls], _REFUSALS.get(cls), cls
        factory = _BY_NAME.get(f"{cls.__module__}.{cls.__qualname__}")
        if factory is not None:
            return factory, None, cls
    return None, None, type(module)


def _is_candidate(module: nn.Module) -> bool:
    return _lookup(module)[0] is not None


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
    if isinstance(module, nn.modules.lazy.LazyModuleMixin):
        return None, None
    factory, refusal, registered = _lookup(module)
    if factory is None:
        return None, None
    computed = computed_parameter(module)
    if computed is not None:
        return None, computed
    why = refusal(module) if refusal is not None else None
    if why is not None:
        return None, why
    helper = factory(module)
    # A subclass of the registered type with a forward of its own: checked once against its output, where the
    # helper can recompute it (a convolution's helper checks its own subclasses: kfac/conv.py).
    if (registered is not type(module) and overrides_forward(type(module), registered)
            and type(helper).expected_output is not LayerHelper.expected_output):
        helper.verify_output = helper.needs_check = True
    return helper, None


def linear_and_conv_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` of a registered type, each once: ``model.modules()`` without building every
    module's name (half the time; this runs on factor steps)."""
    found: list[nn.Module] = []
    stack, seen = [model], {id(model)}
    while stack:
        module = stack.pop()
        if _is_candidate(module):
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
                           if id(other) not in inside and not _is_ancestor(other_name, candidates[i][0]))
    groups: dict[int, list[Candidate]] = {}
    for i, candidate in enumerate(candidates):
        groups.setdefault(find(i), []).append(candidate)
    used_by: dict[int, dict[str, str]] = {}  # group root -> outside module name -> its type
    for i, other_name, other in outside:
        used_by.setdefault(find(i), {})[other_name or "<root>"] = type(other).__name__
    return [(group, _why_not_one_block(group, used_by.get(r))) for r, group in groups.items()] + refused


def _is_ancestor(holder: str, name: str) -> bool:
    """Whether the module ``holder`` contains the layer ``name``: a parent that registers its child's parameter as
    its own too (BERT's LM head: ``self.bias = self.decoder.bias``) holds an alias for tying, and the gradient is
    still the child's alone. (A parent that also computed with it would add to that gradient unseen: such a
    parent is not recognizable from the outside, and none is known among the libraries people use.)"""
    return name.startswith(f"{holder}.") if holder else False


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


register_layer_type(nn.Linear, LinearHelper)
register_layer_type(nn.Conv1d, conv_helper)
register_layer_type(nn.Conv2d, conv_helper)
register_layer_type(nn.Conv3d, conv_helper)
register_layer_type(nn.Embedding, EmbeddingHelper, embedding_refusal)  # type: ignore[arg-type]
register_layer_type("transformers.pytorch_utils.Conv1D", TransposedLinearHelper)
