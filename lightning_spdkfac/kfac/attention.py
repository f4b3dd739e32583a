"""K-FAC for ``nn.MultiheadAttention``: its projections run through points the preconditioner can hook.

PyTorch's ``nn.MultiheadAttention`` computes its input projections inside
``F.multi_head_attention_forward`` from the packed ``in_proj_weight`` (or ``q/k/v_proj_weight`` when
``kdim``/``vdim`` differ from ``embed_dim``), and its output projection with ``F.linear`` on
``out_proj.weight``: no module is called, so no forward hook sees an input. :func:`install` replaces the
forward of one instance (not of the class) with :func:`attention_forward`, the same computation in which
each of the three input projections is a call of a parameter-free :class:`Projection` module and the output
projection is a call of ``out_proj``. The parameters, their names and the ``state_dict`` do not change; the
``Projection`` modules are not submodules (``named_modules()`` does not list them).

Without grad (evaluation, inference) the replaced forward calls the class's own forward, fused fast path
included; no statistics are collected there in any case.

Curvature (docs/math.md, "Attention"): q, k and v are three K-FAC blocks, each like an ``nn.Linear`` on its
own input (A: the covariance of the query, key or value input with a 1 for its bias slice; G: that of the
gradient of its ``embed_dim`` projected outputs, every position an example). The packed weight's
cross-blocks between q, k and v are dropped (block-diagonal), also for self-attention where the three
inputs are one tensor. ``bias_k``/``bias_v`` (``add_bias_kv``) are left to the optimizer.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from .experts import experts_layers
from .layers import LayerHelper, LinearHelper, make_helper, unsupported_reason

_PARTS = ("q", "k", "v")


class Projection(nn.Module):
    """One input projection (q, k or v) of a ``MultiheadAttention``, computed by calling this module.

    ``weight`` and ``bias`` are the attention's Parameters (``in_proj_weight``, or ``q/k/v_proj_weight``, and
    ``in_proj_bias``), of which this projection uses the rows ``weight_rows`` and ``bias_rows``.
    """

    def __init__(self, owner: nn.MultiheadAttention, part: int) -> None:
        super().__init__()
        e = owner.embed_dim
        separate = not owner._qkv_same_embed_dim
        # A plain attribute, not a submodule: the attention is not a child of its projection.
        self.__dict__["owner"] = owner
        self.weight_name = f"{_PARTS[part]}_proj_weight" if separate else "in_proj_weight"
        self.weight_rows = slice(0, e) if separate else slice(part * e, (part + 1) * e)
        self.bias_rows = slice(part * e, (part + 1) * e)
        self.embed_dim: int = e

    # Train/eval mode is the attention's (model.train() / eval() do not reach a module outside the tree).
    @property
    def training(self) -> bool:
        return bool(self._owner().training)

    @training.setter
    def training(self, mode: bool) -> None:
        pass

    def _owner(self) -> nn.MultiheadAttention:
        return cast(nn.MultiheadAttention, self.__dict__["owner"])

    @property
    def weight(self) -> nn.Parameter:
        return cast(nn.Parameter, getattr(self._owner(), self.weight_name))

    @property
    def bias(self) -> nn.Parameter | None:
        return cast("nn.Parameter | None", self._owner().in_proj_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias
        return F.linear(x, self.weight[self.weight_rows], None if bias is None else bias[self.bias_rows])


class ProjectionHelper(LinearHelper):
    """A :class:`Projection` as a Linear layer of ``embed_dim`` outputs whose weight (and bias) is a slice of a
    larger Parameter: the gradient is read from, and written to, those rows only."""

    module: Projection  # type: ignore[assignment]

    def __init__(self, module: Projection) -> None:
        super().__init__(module)

    @property
    def in_features(self) -> int:
        return int(self.module.weight.shape[1])

    @property
    def out_features(self) -> int:
        return self.module.embed_dim

    def _weight_part(self, wg: torch.Tensor) -> torch.Tensor:
        return wg[self.module.weight_rows]

    def _bias_part(self, bg: torch.Tensor) -> torch.Tensor:
        return bg[self.module.bias_rows]

    def param_keys(self) -> list[tuple[int, Any]]:
        m = self.module
        keys: list[tuple[int, Any]] = [(id(m.weight), (m.weight_rows.start, m.weight_rows.stop))]
        if self.has_bias:
            keys.append((id(m.bias), (m.bias_rows.start, m.bias_rows.stop)))
        return keys

    def owner(self) -> nn.Module:
        return self.module._owner()


def refusal(module: nn.MultiheadAttention) -> str | None:
    """Why K-FAC cannot handle this attention module (None: it can)."""
    if type(module).forward is not nn.MultiheadAttention.forward:
        return (f"{type(module).__name__} overrides MultiheadAttention.forward, whose computation K-FAC cannot "
                "follow; its projections (out_proj included) are left to the optimizer unpreconditioned")
    current = module.__dict__.get("forward")
    if current is not None and not isinstance(current, RoutedForward):
        return ("its forward was replaced on the instance, a computation K-FAC cannot follow; its projections "
                "(out_proj included) are left to the optimizer unpreconditioned")
    return None


def install(module: nn.MultiheadAttention) -> tuple[Projection, Projection, Projection]:
    """Route the instance's forward through hookable projections (idempotent); returns the q, k, v ones."""
    taps = module.__dict__.get("_kfac_projections")
    if taps is None:
        taps = module.__dict__["_kfac_projections"] = tuple(Projection(module, i) for i in range(3))
        module.__dict__["forward"] = RoutedForward(module)
    return taps


class RoutedForward:
    """The instance's ``forward``: :func:`attention_forward` on it. An object rather than a bound method so that
    the module pickles (``torch.save(model)``) and deep-copies with it."""

    def __init__(self, module: nn.MultiheadAttention) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        return attention_forward(self.module, *args, **kwargs)


def _batch_first(x: torch.Tensor, batched: bool, batch_first: bool) -> torch.Tensor:
    if not batched:
        return x.unsqueeze(0)
    return x if batch_first else x.transpose(0, 1)


def _masks(self: nn.MultiheadAttention, query: torch.Tensor, key_padding_mask: torch.Tensor | None,
           attn_mask: torch.Tensor | None, need_weights: bool, is_causal: bool
           ) -> tuple[torch.Tensor | None, torch.Tensor | None, bool]:
    """The masks as ``F.multi_head_attention_forward`` resolves them: float masks, the causal hint kept only
    where SDPA can use it alone."""
    key_padding_mask = F._canonical_mask(mask=key_padding_mask, mask_name="key_padding_mask",
                                         other_type=F._none_or_dtype(attn_mask), other_name="attn_mask",
                                         target_type=query.dtype)
    attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                                  target_type=query.dtype, check_other=False)
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the Transformer module "
                           "method `generate_square_subsequent_mask` to create this mask.")
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None
    elif key_padding_mask is not None:
        is_causal = False
    if attn_mask is not None and attn_mask.dim() == 2:
        attn_mask = attn_mask.unsqueeze(0)
    return key_padding_mask, attn_mask, is_causal


def _extend_keys(self: nn.MultiheadAttention, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                 key_padding_mask: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """``bias_k``/``bias_v`` and the zero attention (``(N*H, S, hd)`` keys and values), masks padded to match."""
    if self.bias_k is not None and self.bias_v is not None:
        n = k.shape[0] // self.num_heads
        k = torch.cat([k, self.bias_k.reshape(1, self.num_heads, -1).repeat(n, 1, 1).reshape(-1, 1, k.shape[2])], 1)
        v = torch.cat([v, self.bias_v.reshape(1, self.num_heads, -1).repeat(n, 1, 1).reshape(-1, 1, v.shape[2])], 1)
        attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
        key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
    if self.add_zero_attn:
        k = torch.cat([k, k.new_zeros(k.shape[0], 1, k.shape[2])], 1)
        v = torch.cat([v, v.new_zeros(v.shape[0], 1, v.shape[2])], 1)
        attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
        key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
    return k, v, attn_mask, key_padding_mask  # type: ignore[return-value]


def attention_forward(self: nn.MultiheadAttention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                      attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                      is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``nn.MultiheadAttention.forward`` with the projections called as modules (see the module docstring).

    Follows ``F.multi_head_attention_forward`` step by step (masks, ``bias_k``/``bias_v``, ``add_zero_attn``,
    dropout, ``need_weights`` / ``average_attn_weights``, the SDPA path otherwise) in batch-first layout.
    """
    if not torch.is_grad_enabled() or query.is_nested or key.is_nested or value.is_nested:
        return nn.MultiheadAttention.forward(self, query, key, value, key_padding_mask, need_weights, attn_mask,
                                             average_attn_weights, is_causal)
    batched = query.dim() == 3
    if not batched and key_padding_mask is not None:
        key_padding_mask = key_padding_mask.unsqueeze(0)
    key_padding_mask, attn_mask, is_causal = _masks(self, query, key_padding_mask, attn_mask, need_weights,
                                                    is_causal)
    taps = self.__dict__["_kfac_projections"]
    # (N, L, E) inputs: the projections' rows are grouped by example, as for any Linear layer.
    q, k, v = (tap(_batch_first(x, batched, self.batch_first)) for tap, x in zip(taps, (query, key, value)))
    n, tgt, e = q.shape
    heads, hd = self.num_heads, e // self.num_heads
    q, k, v = (t.reshape(t.shape[0], t.shape[1], heads, hd).transpose(1, 2).reshape(n * heads, t.shape[1], hd)
               for t in (q, k, v))
    k, v, attn_mask, key_padding_mask = _extend_keys(self, k, v, attn_mask, key_padding_mask)
    src = k.shape[1]
    if key_padding_mask is not None:
        kpm = key_padding_mask.view(n, 1, 1, src).expand(-1, heads, -1, -1).reshape(n * heads, 1, src)
        attn_mask = kpm if attn_mask is None else attn_mask + kpm
    dropout_p = self.dropout if self.training else 0.0
    weights = None
    if need_weights:
        scores = q * math.sqrt(1.0 / float(hd))
        scores = (torch.baddbmm(attn_mask, scores, k.transpose(-2, -1)) if attn_mask is not None
                  else torch.bmm(scores, k.transpose(-2, -1)))
        weights = F.softmax(scores, dim=-1)
        if dropout_p > 0.0:
            weights = F.dropout(weights, p=dropout_p)
        out = torch.bmm(weights, v).view(n, heads, tgt, hd)
        weights = weights.view(n, heads, tgt, src)
        if average_attn_weights:
            weights = weights.mean(dim=1)
    else:
        if attn_mask is not None:
            attn_mask = (attn_mask.unsqueeze(0) if attn_mask.size(0) == 1 and attn_mask.dim() == 3
                         else attn_mask.view(n, heads, -1, src))
        out = F.scaled_dot_product_attention(q.view(n, heads, tgt, hd), k.view(n, heads, src, hd),
                                             v.view(n, heads, src, hd), attn_mask, dropout_p, is_causal)
    out = self.out_proj(out.transpose(1, 2).reshape(n, tgt, e))
    if not batched:
        return out.squeeze(0), None if weights is None else weights.squeeze(0)
    return (out if self.batch_first else out.transpose(0, 1)), weights


def module_layers(name: str, module: nn.Module) -> list[tuple[str, nn.Module, LayerHelper | None, str | None]]:
    """The K-FAC layers of one module of the model: ``(name, module to hook, helper, None)``, or
    ``(name, module, None, why)`` for one that is not handled (why None: not a layer type K-FAC looks at).

    A ``MultiheadAttention`` gives its three input projections (after :func:`install`); its ``out_proj`` is
    an ``nn.Linear`` found on its own. One that cannot be followed gives itself and its ``out_proj``, refused.
    """
    if isinstance(module, nn.MultiheadAttention):
        why = refusal(module)
        if why is not None:
            return [(name, module, None, why), (_child(name, "out_proj"), module.out_proj, None, why)]
        return [(_child(name, f"{part}_proj"), tap, ProjectionHelper(tap), None)
                for part, tap in zip(_PARTS, install(module), strict=True)]
    helper, why = make_helper(module)
    if helper is None and why is None:
        stacks = experts_layers(module)  # expert stacks and bare-weight routers (kfac/experts.py)
        if stacks:
            return [(name if pname == "weight" else _child(name, pname), module, h, w) for pname, h, w in stacks]
        why = unsupported_reason(module)
        if why is None or not any(p.requires_grad for p in module.parameters()):
            return []
        return [(name, module, None, why)]
    return [(name, module, helper, why)]


def _child(name: str, child: str) -> str:
    return f"{name}.{child}" if name else child
