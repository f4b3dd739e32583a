"""Subclasses verified (issue 35, Deliver 3): a registered layer whose class overrides ``forward`` is checked once
against its own output, and refused by name with the fix where the helper's map is not what it computes; the
convolution's self-padding check never crashes the step (an input smaller than the kernel before its padding).
"""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_spdkfac.kfac.preconditioner import KFACPreconditioner

F64 = torch.float64
ONE_STEP = {"factor_update_steps": 1, "inv_update_steps": 1, "kl_clip": None}


def assert_refused(pre: KFACPreconditioner, run, name: str, pattern: str) -> None:
    """``run()`` (a forward and backward) then a step: the layer is refused once by name with the fix, left to the
    optimizer and named in the summary, and the run goes on."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        run()
        pre.step()
    msgs = [str(w.message) for w in record if re.search(pattern, str(w.message), re.S)]
    assert len(msgs) == 1, [str(w.message) for w in record]
    assert "skip_layers" in msgs[0] and "register_layer_type" in msgs[0]
    assert pre.layers[name].A is None and pre.unfactored[name] == msgs[0]
    assert f"{name}.weight" in {x.name for x in pre.summary().left_out}


# -- embeddings -------------------------------------------------------------------------------------------
class WhisperLikePositions(nn.Embedding):
    """Like ``transformers``' WhisperPositionalEmbedding: takes the token ids (for their length) and returns the
    first rows of its table, the positions' embeddings."""

    def forward(self, input_ids: torch.Tensor, past_key_values_length: int = 0,  # type: ignore[override]
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            return self.weight[past_key_values_length:past_key_values_length + input_ids.shape[1]]
        return self.weight[position_ids]


class TinyDecoder(nn.Module):
    def __init__(self, vocab: int, positions: int, dim: int = 8) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = WhisperLikePositions(positions, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.tok(ids) + self.pos(ids))


@pytest.mark.parametrize("vocab", [50, 16], ids=["ids-beyond-the-table", "ids-that-fit"])
def test_whisper_like_position_embedding_is_refused_by_name(vocab: int) -> None:
    """Ids beyond the table crashed in index_add_ without a name; ids that fit gave silently wrong factors."""
    torch.manual_seed(0)
    model = TinyDecoder(vocab, 16)
    pre = KFACPreconditioner(model, **ONE_STEP)
    ids = torch.randint(0, vocab, (2, 6))
    ids[0, 0] = vocab - 1
    assert_refused(pre, lambda: model(ids).square().sum().backward(), "pos",
                   r"K-FAC layer 'pos' \(WhisperLikePositions\).*skip_layers=\['pos'\].*register_layer_type")
    model.zero_grad()
    model(ids).square().sum().backward()  # the next steps train, the refused layer left alone
    pre.step()
    pre.remove_hooks()


def test_whisper_like_position_embedding_skipped_trains() -> None:
    """The fix the error names works: skipped, the layer is left to the optimizer and the rest trains."""
    torch.manual_seed(0)
    model = TinyDecoder(50, 16)
    pre = KFACPreconditioner(model, skip_layers=["pos"], **ONE_STEP)
    model(torch.randint(0, 50, (2, 6))).square().sum().backward()
    pre.step()
    assert "pos" not in pre.layers and pre.layers["tok"].A is not None and pre.layers["head"].A is not None
    pre.remove_hooks()


def test_transformers_whisper_decoder_positions_refused_by_name() -> None:
    """The real ``WhisperPositionalEmbedding``, in a tiny Whisper built offline from a config (random weights)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.WhisperConfig(
        vocab_size=60, num_mel_bins=8, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=8,
        max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    model = transformers.WhisperForConditionalGeneration(cfg)
    model.train()
    pre = KFACPreconditioner(model, **ONE_STEP)
    feats = torch.randn(2, 8, 16)
    labels = torch.randint(3, 60, (2, 5))
    assert_refused(pre, lambda: model(input_features=feats, labels=labels).loss.backward(),
                   "model.decoder.embed_positions",
                   r"K-FAC layer 'model\.decoder\.embed_positions' \(WhisperPositionalEmbedding\).*skip_layers")
    pre.remove_hooks()


class ModuloEmbedding(nn.Embedding):
    """Wraps ids around its table: ids beyond the table are valid input to it, not to an embedding."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids % self.num_embeddings, self.weight)


class FloatIdsEmbedding(nn.Embedding):
    """Takes float ids (a non-integer input K-FAC's embedding rows do not take)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids.long(), self.weight)


@pytest.mark.parametrize("module, ids, why", [
    (ModuloEmbedding(8, 4), torch.tensor([[1, 9, 17]]).expand(2, 3), r"token ids in \[0, 8\)"),
    (FloatIdsEmbedding(8, 4), torch.tensor([[1.0, 3.0, 5.0], [0.0, 2.0, 7.0]]), r"torch.float32 input"),
], ids=["out-of-range", "float"])
def test_embedding_input_it_does_not_take_is_refused_by_name(module: nn.Module, ids: torch.Tensor,
                                                             why: str) -> None:
    model = nn.Sequential(module, nn.Linear(4, 2))
    pre = KFACPreconditioner(model, **ONE_STEP)
    assert_refused(pre, lambda: model(ids).square().sum().backward(), "0",
                   rf"K-FAC layer '0' \({type(module).__name__}\).*{why}.*skip_layers")
    pre.remove_hooks()


# -- linear layers ----------------------------------------------------------------------------------------
class ScaledLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2.0 * super().forward(x)


class ExactLinear(nn.Linear):
    """Overrides forward, computing exactly F.linear: accepted."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def test_linear_subclass_that_scales_its_output_is_refused_by_name() -> None:
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), ScaledLinear(5, 3))
    pre = KFACPreconditioner(model, **ONE_STEP)
    assert_refused(pre, lambda: model(torch.randn(3, 4)).square().sum().backward(), "2",
                   r"K-FAC layer '2' \(ScaledLinear\).*F\.linear.*skip_layers=\['2'\]")
    assert pre.layers["0"].A is not None  # the other layers are preconditioned
    pre.remove_hooks()


def test_linear_subclass_computing_f_linear_is_accepted_with_the_plain_factors() -> None:
    torch.manual_seed(0)
    exact = nn.Sequential(ExactLinear(4, 5), nn.Tanh(), ExactLinear(5, 3)).double()
    plain = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    plain.load_state_dict(exact.state_dict())
    x = torch.randn(6, 4, dtype=F64)
    pres = []
    for model in (exact, plain):
        pre = KFACPreconditioner(model, factor_dtype="float64", inv_dtype="float64", **ONE_STEP)
        model(x).square().sum().backward()
        pre.step()
        pres.append(pre)
    pe, pp = pres
    assert pe.layers["0"].helper.verify_output is False and pe.layers["0"].helper.needs_check is False  # checked
    assert not pp.layers["0"].helper.verify_output  # a plain layer is never checked
    for name in ("0", "2"):
        assert torch.equal(pe.layers[name].A, pp.layers[name].A) and torch.equal(pe.layers[name].G, pp.layers[name].G)
    for p_e, p_p in zip(exact.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p_e.grad, p_p.grad)
    for pre in pres:
        pre.remove_hooks()


def test_linear_subclass_checked_once() -> None:
    """The check runs on the first collected call only; later steps do not recompute the output."""
    model = nn.Sequential(ExactLinear(4, 3))
    pre = KFACPreconditioner(model, **ONE_STEP)
    helper = pre.layers["0"].helper
    assert helper.verify_output and helper.needs_check
    calls = []
    original = helper.expected_output
    helper.expected_output = lambda x: calls.append(1) or original(x)  # type: ignore[method-assign]
    for _ in range(3):
        model(torch.randn(2, 4)).square().sum().backward()
        pre.step()
    assert calls == [1]
    pre.remove_hooks()


def test_transformers_conv1d_subclass_is_checked() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    class HalfConv1D(Conv1D):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) / 2

    class SameConv1D(Conv1D):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight + self.bias

    assert transformers is not None
    for cls, refused in ((HalfConv1D, True), (SameConv1D, False)):
        model = nn.Sequential(cls(3, 4))  # Conv1D(nf=out, nx=in)
        pre = KFACPreconditioner(model, **ONE_STEP)
        if refused:
            assert_refused(pre, lambda model=model: model(torch.randn(2, 5, 4)).square().sum().backward(), "0",
                           r"K-FAC layer '0' \(HalfConv1D\).*x @ weight \+ bias")
        else:
            model(torch.randn(2, 5, 4)).square().sum().backward()
            pre.step()
            assert pre.layers["0"].A is not None and not pre.layers["0"].helper.verify_output
        pre.remove_hooks()


# -- convolutions: the self-padding check on an input smaller than the kernel ----------------------------
def _same_pad(size: int, k: int, s: int) -> tuple[int, int]:
    total = max((math.ceil(size / s) - 1) * s + k - size, 0)
    return total // 2, total - total // 2


class Conv2dSame(nn.Conv2d):
    """Like timm's Conv2dSame: pads dynamically in forward (pad_same), then F.conv2d with padding 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (kh, kw), (sh, sw) = self.kernel_size, self.stride
        ph, pw = _same_pad(x.shape[-2], kh, sh), _same_pad(x.shape[-1], kw, sw)
        x = F.pad(x, [*pw, *ph])
        return F.conv2d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_conv2d_same_on_a_map_smaller_than_its_kernel(approx: str) -> None:
    """A 5x5 kernel of stride 2 on a 4x4 map (a tf_ model at 64 px): the unpadded attempt cannot run; the 'same'
    one is found, and the factors are those of a plain convolution of the padded input."""
    torch.manual_seed(0)
    same = Conv2dSame(3, 4, 5, stride=2).double()
    plain = nn.Conv2d(3, 4, 5, stride=2).double()
    plain.load_state_dict(same.state_dict())
    x = torch.randn(2, 3, 4, 4, dtype=F64)
    padded = F.pad(x, [1, 2, 1, 2])  # ceil(4/2)=2: (2-1)*2+5-4 = 3 -> 1 left, 2 right
    layers = []
    for model, inp in ((same, x), (plain, padded)):
        pre = KFACPreconditioner(model, factor_dtype="float64", inv_dtype="float64", factor_approx=approx,
                                 **ONE_STEP)
        model(inp).square().sum().backward()
        pre.step()
        layers.append(pre.layers[""])
        pre.remove_hooks()
    assert torch.allclose(layers[0].A, layers[1].A, rtol=1e-12, atol=1e-12)
    assert torch.allclose(layers[0].G, layers[1].G, rtol=1e-12, atol=1e-12)
    assert torch.allclose(same.weight.grad, plain.weight.grad, rtol=1e-10, atol=1e-12)


class ReplicateSame(nn.Conv2d):
    """Attributes say reflect padding (of 0), forward pads by replication: no attempt of the check can run on a
    1x1 map (unpadded: smaller than the kernel; reflect 'same' padding: wider than the map)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.pad(x, [2, 2, 2, 2], mode="replicate")
        return F.conv2d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


def test_conv_check_that_cannot_run_is_refused_by_name() -> None:
    model = nn.Sequential(ReplicateSame(2, 3, 5, padding_mode="reflect"))
    pre = KFACPreconditioner(model, **ONE_STEP)
    assert_refused(pre, lambda: model(torch.randn(1, 2, 1, 1)).square().sum().backward(), "0",
                   r"K-FAC layer '0' \(ReplicateSame\).*could not check.*skip_layers")
    pre.remove_hooks()
