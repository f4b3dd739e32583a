"""A zoo of small look-alike models of the field cases of issue 35: models from other libraries that stop calling
their layers as modules (functional use of a module's weight, opaque fused kernels, subclasses that change
``forward``, outputs written in place, graphs compiled before K-FAC attached), ``transformers`` 5 mixture-of-experts
models with fused 3-D expert parameters, and a PEFT LoRA model.

torchvision and timm do not install with the pinned CPU torch (only CUDA torchvision wheels exist for it and its C
ops fail to load), so their models are imitated here: each class says which library code it imitates. The code is
written for these tests (nothing is copied from the libraries); what matters is that the weights are used the same
way (the same functions, given the same tensors).

Every builder returns ``(model, make_batch, loss_fn)``: ``make_batch(seed)`` makes the inputs (deterministic per seed),
``loss_fn(model, inputs)`` a scalar loss. All run offline with random weights; one forward + backward takes well under
0.5 s on one CPU core. :data:`ZOO` maps a short name to each builder (the tests and benchmarks/hf_models.py use it).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

Inputs = Any
Built = tuple[nn.Module, Callable[[int], Inputs], Callable[[nn.Module, Inputs], torch.Tensor]]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _image_batch(channels: int = 3, size: int = 32, classes: int = 10, batch: int = 2) -> Callable[[int], Inputs]:
    def make(seed: int) -> Inputs:
        g = _gen(seed)
        return torch.randn(batch, channels, size, size, generator=g), torch.randint(0, classes, (batch,), generator=g)

    return make


def _classify(model: nn.Module, inputs: Inputs) -> torch.Tensor:
    x, y = inputs
    return F.cross_entropy(model(x), y)


def _tokens_batch(vocab: int, seq: int, batch: int = 2) -> Callable[[int], Inputs]:
    def make(seed: int) -> Inputs:
        g = _gen(seed)
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        return ids, torch.randint(0, vocab, (batch, seq), generator=g)

    return make


def _lm_loss(model: nn.Module, inputs: Inputs) -> torch.Tensor:
    ids, labels = inputs
    logits = model(ids)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _hf_loss(model: nn.Module, inputs: Inputs) -> torch.Tensor:
    return model(**inputs).loss


def _hf_lm_batch(vocab: int, seq: int = 16, batch: int = 2) -> Callable[[int], Inputs]:
    def make(seed: int) -> Inputs:
        ids = torch.randint(0, vocab, (batch, seq), generator=_gen(seed))
        return dict(input_ids=ids, labels=ids)

    return make


# --------------------------------------------------------------------------------------------- Swin-T (torchvision)
def shifted_window_attention(x: torch.Tensor, qkv_weight: torch.Tensor, proj_weight: torch.Tensor,
                             relative_position_bias: torch.Tensor, window_size: int, num_heads: int, shift_size: int,
                             qkv_bias: torch.Tensor | None = None, proj_bias: torch.Tensor | None = None
                             ) -> torch.Tensor:
    """Window attention as torchvision's ``torchvision.models.swin_transformer.shifted_window_attention`` computes it
    (a free function given the weights, not the modules): pad to whole windows, roll by ``shift_size``, split into
    windows, ``F.linear(x, qkv_weight, qkv_bias)``, attention with the relative position bias (and the mask that keeps
    rolled-in regions apart), ``F.linear(x, proj_weight, proj_bias)``, then undo the split, roll and padding.
    ``x``: (B, H, W, C)."""
    B, H, W, C = x.shape
    ws = window_size
    pad_b, pad_r = (ws - H % ws) % ws, (ws - W % ws) % ws
    x = F.pad(x, (0, 0, 0, pad_r, 0, pad_b))
    _, Hp, Wp, _ = x.shape
    if ws >= Hp:  # one window covers the map: no shift (as torchvision does)
        shift_size = 0
    if shift_size > 0:
        x = torch.roll(x, shifts=(-shift_size, -shift_size), dims=(1, 2))
    nh, nw = Hp // ws, Wp // ws
    x = x.view(B, nh, ws, nw, ws, C).permute(0, 1, 3, 2, 4, 5).reshape(B * nh * nw, ws * ws, C)
    qkv = F.linear(x, qkv_weight, qkv_bias)  # the weight of the block's nn.Linear, used without calling it
    qkv = qkv.reshape(x.shape[0], ws * ws, 3, num_heads, C // num_heads).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    attn = (q * (C // num_heads) ** -0.5) @ k.transpose(-2, -1) + relative_position_bias
    if shift_size > 0:  # tokens rolled in from the other side of the map do not attend to each other
        region = x.new_zeros(Hp, Wp)
        cuts = ((0, -ws), (-ws, -shift_size), (-shift_size, None))
        idx = 0
        for hs in cuts:
            for wsl in cuts:
                region[hs[0]:hs[1], wsl[0]:wsl[1]] = idx
                idx += 1
        region = region.view(nh, ws, nw, ws).permute(0, 2, 1, 3).reshape(nh * nw, ws * ws)
        mask = (region.unsqueeze(1) - region.unsqueeze(2)).ne(0).to(x.dtype) * -100.0
        attn = attn.view(B, nh * nw, num_heads, ws * ws, ws * ws) + mask.unsqueeze(1).unsqueeze(0)
        attn = attn.view(-1, num_heads, ws * ws, ws * ws)
    attn = attn.softmax(dim=-1)
    x = (attn @ v).transpose(1, 2).reshape(x.shape[0], ws * ws, C)
    x = F.linear(x, proj_weight, proj_bias)
    x = x.view(B, nh, nw, ws, ws, C).permute(0, 1, 3, 2, 4, 5).reshape(B, Hp, Wp, C)
    if shift_size > 0:
        x = torch.roll(x, shifts=(shift_size, shift_size), dims=(1, 2))
    return x[:, :H, :W, :].contiguous()


class ShiftedWindowAttention(nn.Module):
    """torchvision's ``ShiftedWindowAttention``: holds ``qkv`` and ``proj`` as ``nn.Linear`` and a relative position
    bias table, but its forward hands their weights to :func:`shifted_window_attention` (the modules are never
    called: their forward hooks never fire)."""

    def __init__(self, dim: int, window_size: int, shift_size: int, num_heads: int) -> None:
        super().__init__()
        self.window_size, self.shift_size, self.num_heads = window_size, shift_size, num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.relative_position_bias_table = nn.Parameter(torch.randn((2 * window_size - 1) ** 2, num_heads) * 0.02)
        coords = torch.stack(torch.meshgrid(torch.arange(window_size), torch.arange(window_size), indexing="ij"))
        rel = (coords.flatten(1)[:, :, None] - coords.flatten(1)[:, None, :]).permute(1, 2, 0) + window_size - 1
        self.register_buffer("relative_position_index", (rel[..., 0] * (2 * window_size - 1) + rel[..., 1]).flatten(),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.window_size ** 2
        bias = self.relative_position_bias_table[self.relative_position_index].view(n, n, -1).permute(2, 0, 1)
        return shifted_window_attention(x, self.qkv.weight, self.proj.weight, bias.unsqueeze(0), self.window_size,
                                        self.num_heads, self.shift_size, qkv_bias=self.qkv.bias,
                                        proj_bias=self.proj.bias)


class SwinBlock(nn.Module):
    """torchvision's ``SwinTransformerBlock``: norm, window attention, norm, MLP (``nn.Linear`` modules, called)."""

    def __init__(self, dim: int, heads: int, window: int, shift: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = ShiftedWindowAttention(dim, window, shift, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchMerging(nn.Module):
    """torchvision's ``PatchMerging``: 2x2 neighbours concatenated, norm, ``nn.Linear(4C, 2C, bias=False)``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], dim=-1)
        return self.reduction(self.norm(x))


class SwinLike(nn.Module):
    """A two-stage Swin-T-like classifier (torchvision ``swin_t``'s structure, tiny): patch embedding Conv2d, a stage
    of two blocks (the second shifted), patch merging, a second stage, norm, pooling, head."""

    def __init__(self, dim: int = 16, patch: int = 4, window: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)
        self.embed_norm = nn.LayerNorm(dim)
        self.stage1 = nn.Sequential(SwinBlock(dim, 2, window, 0), SwinBlock(dim, 2, window, window // 2))
        self.merge = PatchMerging(dim)
        self.stage2 = nn.Sequential(SwinBlock(2 * dim, 4, window, 0), SwinBlock(2 * dim, 4, window, window // 2))
        self.norm = nn.LayerNorm(2 * dim)
        self.head = nn.Linear(2 * dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed_norm(self.patch_embed(x).permute(0, 2, 3, 1))  # (B, H, W, C)
        x = self.stage2(self.merge(self.stage1(x)))
        return self.head(self.norm(x).mean(dim=(1, 2)))


def swin_like() -> Built:
    """Swin-T-like: 32 px images, 8x8 patches map, windows of 4 (stage 2's map is one window: no shift there)."""
    return SwinLike(), _image_batch(), _classify


# --------------------------------------------------------------------------------------------- EVA-02 (timm)
class EvaAttention(nn.Module):
    """timm's ``EvaAttention`` (EVA-02): ``qkv = nn.Linear(C, 3C, bias=False)`` plus separate ``q_bias`` and ``v_bias``
    parameters (and a zero k bias buffer); forward applies ``F.linear(x, weight=self.qkv.weight, bias=cat(q_bias, 0,
    v_bias))``, never calling ``qkv``. ``proj`` is called as a module."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(dim))
        self.register_buffer("k_bias", torch.zeros(dim), persistent=False)
        self.v_bias = nn.Parameter(torch.zeros(dim))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv_bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
        qkv = F.linear(x, weight=self.qkv.weight, bias=qkv_bias)
        q, k, v = qkv.reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class EvaBlock(nn.Module):
    """timm's EVA block: norm, attention, norm, SwiGLU MLP (``fc1_g``, ``fc1_x``, ``fc2``: modules, called)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = EvaAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1_g = nn.Linear(dim, 2 * dim)
        self.fc1_x = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        h = self.norm2(x)
        return x + self.fc2(F.silu(self.fc1_g(h)) * self.fc1_x(h))


class EvaLike(nn.Module):
    """A tiny EVA-02-like ViT: patch embedding Conv2d, class token, position embedding, two blocks, head."""

    def __init__(self, dim: int = 32, patch: int = 8, size: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, (size // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(EvaBlock(dim, 2), EvaBlock(dim, 2))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


def eva_like() -> Built:
    return EvaLike(), _image_batch(), _classify


# --------------------------------------------------------------------------------------------- Mamba (mamba_ssm)
class CausalConv1dFn(torch.autograd.Function):
    """An opaque fused kernel, as ``causal_conv1d_fn`` of the ``causal-conv1d`` package (which Mamba's fast path hands
    ``conv1d.weight``): a depthwise causal conv1d with SiLU, computed in ``forward`` from the raw weight by shifted
    multiply-adds (no ``F.conv1d`` call, nothing recorded by autograd), its gradients by a hand-written ``backward``.
    K-FAC cannot follow the weight into it: the layer must be named with a reason."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight, bias)
        return F.silu(CausalConv1dFn._conv(x, weight, bias))

    @staticmethod
    def _conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # x (B, D, L), weight (D, K): out[b, d, t] = sum_j weight[d, j] * x[b, d, t - (K - 1) + j]
        k = weight.shape[1]
        xp = F.pad(x, (k - 1, 0))
        out = sum(weight[:, j, None] * xp[:, :, j:j + x.shape[2]] for j in range(k))
        return out if bias is None else out + bias[:, None]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, bias = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(True) if t is not None else None for t in (x, weight, bias)]
            out = F.silu(CausalConv1dFn._conv(*leaves))
            grads = torch.autograd.grad(out, [t for t in leaves if t is not None], grad)
        it = iter(grads)
        return tuple(next(it) if t is not None else None for t in leaves)


class MambaMixer(nn.Module):
    """The Mamba block as ``mamba_ssm``'s ``Mamba`` runs it: ``in_proj`` (called), the depthwise ``conv1d`` weight handed
    to a fused causal-conv kernel (:class:`CausalConv1dFn`, the module is never called), ``x_proj`` (called),
    ``dt = self.dt_proj.weight @ x_dbl[:, :dt_rank].t()`` (the weight as the LEFT matmul operand; its bias is added in
    the scan as ``delta_bias``), a selective scan (a plain loop here) and ``out_proj`` (called)."""

    def __init__(self, d_model: int = 16, d_state: int = 4, d_conv: int = 4, expand: int = 2) -> None:
        super().__init__()
        di = expand * d_model
        self.dt_rank = math.ceil(d_model / 16)
        self.d_state = d_state
        self.in_proj = nn.Linear(d_model, 2 * di, bias=False)
        self.conv1d = nn.Conv1d(di, di, d_conv, groups=di, padding=d_conv - 1)
        self.x_proj = nn.Linear(di, self.dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, di)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, d_state + 1, dtype=torch.float32)).repeat(di, 1))
        self.D = nn.Parameter(torch.ones(di))
        self.out_proj = nn.Linear(di, d_model, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        B, L, _ = h.shape
        x, z = self.in_proj(h).transpose(1, 2).chunk(2, dim=1)  # (B, di, L) each
        x = CausalConv1dFn.apply(x, self.conv1d.weight.squeeze(1), self.conv1d.bias)
        x_dbl = self.x_proj(x.transpose(1, 2).reshape(B * L, -1))  # (B L, dt_rank + 2N)
        dt = self.dt_proj.weight @ x_dbl[:, :self.dt_rank].t()  # (di, B L): dt_proj is never called
        dt = F.softplus(dt.view(-1, B, L).permute(1, 0, 2) + self.dt_proj.bias[None, :, None])  # delta_bias
        Bm = x_dbl[:, self.dt_rank:self.dt_rank + self.d_state].view(B, L, -1)
        Cm = x_dbl[:, self.dt_rank + self.d_state:].view(B, L, -1)
        A = -torch.exp(self.A_log)  # (di, N)
        state = x.new_zeros(B, x.shape[1], self.d_state)
        ys = []
        for t in range(L):
            state = torch.exp(dt[:, :, t, None] * A) * state + dt[:, :, t, None] * Bm[:, None, t] * x[:, :, t, None]
            ys.append((state * Cm[:, None, t]).sum(-1))
        y = torch.stack(ys, dim=-1) + x * self.D[:, None]
        return self.out_proj((y * F.silu(z)).transpose(1, 2))


class MambaLike(nn.Module):
    """A tiny Mamba language model: embedding, two residual mixer blocks with RMS-like norms, tied-free head."""

    def __init__(self, vocab: int = 64, d_model: int = 16) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList([MambaMixer(d_model) for _ in range(2)])
        self.norms = nn.ModuleList([nn.LayerNorm(d_model) for _ in range(2)])
        self.norm_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embedding(ids)
        for norm, mixer in zip(self.norms, self.layers):
            h = h + mixer(norm(h))
        return self.lm_head(self.norm_f(h))


def mamba_like() -> Built:
    return MambaLike(), _tokens_batch(64, 8), _lm_loss


# --------------------------------------------------------------------------------------------- a weight shared
class SharedWeightNet(nn.Module):
    """One weight used by a module call and by a function: ``enc`` is called, then its weight is applied again as
    ``F.linear(h, self.enc.weight, self.enc.bias)`` (a tied re-application, as weight-tied encoders do); ``lin`` is only
    used as ``h @ self.lin.weight.T + self.lin.bias`` (never called); ``head`` is an ordinary call."""

    def __init__(self, d: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.enc = nn.Linear(d, d)
        self.lin = nn.Linear(d, d)
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.enc(x))
        h = torch.tanh(F.linear(h, self.enc.weight, self.enc.bias))
        h = torch.tanh(h @ self.lin.weight.T + self.lin.bias)
        return self.head(h)


def shared_weight() -> Built:
    def make(seed: int) -> Inputs:
        g = _gen(seed)
        return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)

    return SharedWeightNet(), make, _classify


# --------------------------------------------------------------------------------------------- Whisper (transformers)
class WhisperLikePositionalEmbedding(nn.Embedding):
    """``transformers``' ``WhisperPositionalEmbedding``: an ``nn.Embedding`` subclass whose forward takes the token ids
    only for their length and returns rows ``past : past + seq`` of its table (the ids' values are ignored)."""

    def forward(self, input_ids: torch.Tensor, past_key_values_length: int = 0,  # type: ignore[override]
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            return self.weight[past_key_values_length:past_key_values_length + input_ids.shape[1]]
        return self.weight[position_ids]


class WhisperLikeDecoder(nn.Module):
    """Token embedding (an ordinary ``nn.Embedding``) plus the positional embedding subclass (48 positions: token ids up
    to 100 are out of its range, as in the field case), one Linear layer, a head."""

    def __init__(self, vocab: int = 100, positions: int = 48, d: int = 16) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.embed_positions = WhisperLikePositionalEmbedding(positions, d)
        self.fc = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(ids) + self.embed_positions(ids)
        return self.head(torch.tanh(self.fc(h)))


def whisper_like() -> Built:
    return WhisperLikeDecoder(), _tokens_batch(100, 6), _lm_loss


# --------------------------------------------------------------------------------------------- Conv2dSame (timm tf_)
def pad_same(x: torch.Tensor, kernel: tuple[int, int], stride: tuple[int, int], dilation: tuple[int, int]
             ) -> torch.Tensor:
    """TensorFlow 'SAME' padding computed from the input's size at run time (timm's ``pad_same``)."""
    pads = []
    for i, k, s, d in zip(x.shape[-2:], kernel, stride, dilation):
        pads.append(max((math.ceil(i / s) - 1) * s + (k - 1) * d + 1 - i, 0))
    ph, pw = pads
    return F.pad(x, [pw // 2, pw - pw // 2, ph // 2, ph - ph // 2])


class Conv2dSameLike(nn.Conv2d):
    """timm's ``Conv2dSame`` (the ``tf_`` models): an ``nn.Conv2d`` with padding 0 whose forward pads 'same' itself,
    then calls ``F.conv2d`` with its weight. Unpadded, a 5x5 kernel does not fit a 4x4 map."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = pad_same(x, self.kernel_size, self.stride, self.dilation)  # type: ignore[arg-type]
        return F.conv2d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


class TfSameNet(nn.Module):
    """A tiny tf_-EfficientNet-like stem: a stride-2 3x3 'same' conv (8x8 -> 4x4), then a 5x5 'same' conv on the 4x4
    map, pooling, head."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv_stem = Conv2dSameLike(3, 8, 3, stride=2, bias=False)
        self.conv_dw = Conv2dSameLike(8, 8, 5)
        self.classifier = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.silu(self.conv_dw(F.silu(self.conv_stem(x))))
        return self.classifier(x.mean(dim=(2, 3)))


def tf_same() -> Built:
    return TfSameNet(), _image_batch(size=8), _classify


# --------------------------------------------------------------------------------------------- Wav2Vec2 (transformers)
class Wav2Vec2LikeModel(nn.Module):
    """``transformers``' Wav2Vec2 at training time: a conv feature extractor, the feature projection (LayerNorm +
    ``nn.Linear``), then SpecAugment-style masking that writes into the projection's output in place
    (``hidden_states[mask_time_indices] = self.masked_spec_embed``), an encoder, a head. The mask comes with the batch
    (Wav2Vec2's forward takes ``mask_time_indices`` too)."""

    def __init__(self, conv_dim: int = 8, hidden: int = 16, classes: int = 6) -> None:
        super().__init__()
        self.feature_extractor = nn.Conv1d(1, conv_dim, kernel_size=10, stride=5)
        self.layer_norm = nn.LayerNorm(conv_dim)
        self.projection = nn.Linear(conv_dim, hidden)
        self.masked_spec_embed = nn.Parameter(torch.rand(hidden))
        self.encoder = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, audio: torch.Tensor, mask_time_indices: torch.Tensor | None = None) -> torch.Tensor:
        feats = F.gelu(self.feature_extractor(audio.unsqueeze(1))).transpose(1, 2)  # (B, T, conv_dim)
        hidden_states = self.projection(self.layer_norm(feats))
        if mask_time_indices is not None and self.training:
            hidden_states[mask_time_indices] = self.masked_spec_embed.to(hidden_states.dtype)
        return self.head(torch.tanh(self.encoder(hidden_states)))  # (B, T, classes): per-frame labels


def wav2vec2_like() -> Built:
    def make(seed: int) -> Inputs:
        g = _gen(seed)
        audio = torch.randn(2, 85, generator=g)  # 16 frames
        mask = torch.zeros(2, 16, dtype=torch.bool)
        mask[:, 4:8] = True
        return audio, mask, torch.randint(0, 6, (2, 16), generator=g)

    def loss(model: nn.Module, inputs: Inputs) -> torch.Tensor:
        audio, mask, labels = inputs
        return F.cross_entropy(model(audio, mask).reshape(-1, 6), labels.reshape(-1))

    return Wav2Vec2LikeModel(), make, loss


# --------------------------------------------------------------------------------------------- compiled before K-FAC
class SmallCNN(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        return self.fc2(F.relu(self.fc1(x.mean(dim=(2, 3)))))


def compiled_before(backend: str = "inductor") -> Built:
    """A small CNN compiled with ``torch.compile`` (``backend``; inductor by default, as users do) that ran one
    forward + backward (a warm-up batch, or ``lr_find`` before ``fit``) BEFORE K-FAC attaches: the cached graph then
    runs without hooks added later (Dynamo does not guard on module hooks by default). The returned model is the
    ``OptimizedModule``."""
    torch.manual_seed(0)
    model = torch.compile(SmallCNN(), backend=backend)
    make = _image_batch(size=8)
    _classify(model, make(0)).backward()
    model.zero_grad(set_to_none=True)
    return model, make, _classify


# --------------------------------------------------------------------------------------------- transformers MoE
# transformers 5 stores a MoE layer's experts as fused 3-D parameters (``MixtralExperts.gate_up_proj`` (E, 2I, H),
# ``down_proj`` (E, H, I)); the experts' forward is chosen by ``config._experts_implementation``: "eager" (a loop over
# experts: ``F.linear(tokens, self.gate_up_proj[e])``), "grouped_mm" (``torch.nn.functional.grouped_mm`` over tokens
# sorted by expert) or "batched_mm". Asked for nothing, transformers 5.24 picks "grouped_mm" whenever the check in
# ``get_correct_experts_implementation`` passes -- which it does on CPU with torch 2.13 (``F.grouped_mm`` exists, and
# the CPU alignment fallback applies to torch <= 2.10 only): the default on this machine is grouped_mm, not eager.
MOE_COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, vocab_size=128)
MOE_SPECS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mixtral": ("MixtralForCausalLM", "MixtralConfig",
                dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                  dict(intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                       num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1)),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", dict(intermediate_size=32, num_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                  dict(intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                       decoder_sparse_step=1, head_dim=16)),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config",
                    dict(intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                         n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16,
                         q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)),
}


def _transformers() -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def moe(family: str, experts_implementation: str | None = "eager", seq: int = 16, batch: int = 2,
        **overrides: Any) -> Built:
    """A tiny ``transformers`` MoE causal LM of ``family`` (a key of :data:`MOE_SPECS`), random weights, offline.
    ``experts_implementation``: "eager", "grouped_mm", "batched_mm", or None for transformers' own pick (grouped_mm
    here, see above); ``model.config._experts_implementation`` says what was applied."""
    tf = _transformers()
    cls, cfg, kw = MOE_SPECS[family]
    extra = {} if experts_implementation is None else dict(experts_implementation=experts_implementation)
    torch.manual_seed(0)
    config = getattr(tf, cfg)(**{**MOE_COMMON, **kw, **overrides}, **extra)
    return getattr(tf, cls)(config), _hf_lm_batch(config.vocab_size, seq, batch), _hf_loss


# --------------------------------------------------------------------------------------------- PEFT LoRA
def peft_available() -> str | None:
    """None where peft imports, else the reason it does not."""
    try:
        import peft  # noqa: F401
    except Exception as e:  # ImportError, or a peft that does not load with this torch / transformers
        return f"peft is not importable ({type(e).__name__}: {e}); it is in the dev extra (pip install peft==0.21.2)"
    return None


def lora_llama(r: int = 4) -> Built:
    """A tiny ``LlamaForCausalLM`` wrapped by ``peft.get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj",
    "v_proj"]))``: only the LoRA A/B matrices train; the base layers (and their weights) are frozen."""
    why = peft_available()
    if why is not None:
        raise ImportError(why)
    import peft

    tf = _transformers()
    torch.manual_seed(0)
    base = tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=2, num_key_value_heads=1, vocab_size=128))
    model = peft.get_peft_model(base, peft.LoraConfig(r=r, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      lora_dropout=0.0))
    return model, _hf_lm_batch(128), _hf_loss


# --------------------------------------------------------------------------------------------- the zoo
ZOO: dict[str, Callable[[], Built]] = {
    "swin_like": swin_like,
    "eva_like": eva_like,
    "mamba_like": mamba_like,
    "shared_weight": shared_weight,
    "whisper_like": whisper_like,
    "tf_same": tf_same,
    "wav2vec2_like": wav2vec2_like,
    "compiled_before": compiled_before,
    **{f"{f}_{impl}": (lambda f=f, impl=impl: moe(f, impl)) for f in MOE_SPECS for impl in ("eager", "grouped_mm")},
    "lora_llama": lora_llama,
}
