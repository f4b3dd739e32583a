"""The look-alike zoo itself (tests/helpers/lookalikes.py), without K-FAC: every model builds, runs forward and
backward to a finite loss with a gradient on every trainable parameter, and really uses its weights the way the
imitated library does (the functional uses bypass the module calls, the fused kernel is opaque, the subclass ignores
the ids, the output is written in place, the compiled graph skips hooks added later, the MoE experts are 3-D, LoRA
freezes the base)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import lookalikes as zoo

FAST = [n for n in zoo.ZOO if n not in ("compiled_before", "lora_llama") and not n.endswith(("_eager", "_grouped_mm"))]


def _calls(*modules: nn.Module) -> dict[nn.Module, int]:
    """Counts the forward calls of each module (a forward hook each)."""
    counts = {m: 0 for m in modules}
    for m in modules:
        def hook(mod, _inp, _out):
            counts[mod] += 1
        m.register_forward_hook(hook)
    return counts


def _run(built) -> tuple[nn.Module, torch.Tensor]:
    model, make, loss_fn = built
    loss = loss_fn(model, make(0))
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    return model, loss


def _assert_all_grads(model: nn.Module) -> None:
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"trainable parameters without a gradient: {missing}"


@pytest.mark.parametrize("name", FAST)
def test_builds_and_trains(name):
    torch.manual_seed(0)
    model, make, _ = built = zoo.ZOO[name]()
    a, b = make(3), make(3)
    for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
        assert torch.equal(x, y)  # deterministic per seed
    model, _ = _run(built)
    _assert_all_grads(model)


def test_swin_window_attention_bypasses_its_linears():
    model, make, loss_fn = zoo.swin_like()
    attn = [m for m in model.modules() if isinstance(m, zoo.ShiftedWindowAttention)]
    mlp = [m for m in model.modules() if isinstance(m, nn.Linear) and m not in
           {x for a in attn for x in (a.qkv, a.proj)}]
    calls = _calls(*[x for a in attn for x in (a.qkv, a.proj)], *mlp)
    loss_fn(model, make(0)).backward()
    for a in attn:
        assert calls[a.qkv] == 0 and calls[a.proj] == 0  # never called ...
        assert a.qkv.weight.grad is not None and a.proj.weight.grad.abs().sum() > 0  # ... yet trained
        assert a.qkv.bias.grad is not None
    assert all(calls[m] == 1 for m in mlp)  # the MLP, merging and head Linears are called
    assert any(a.shift_size > 0 for a in attn)


def test_shifted_window_attention_matches_a_module_call():
    """The free function computes what calling the modules would (no shift, one window: plain attention)."""
    torch.manual_seed(0)
    a = zoo.ShiftedWindowAttention(8, 2, 0, 2)
    x = torch.randn(1, 2, 2, 8)
    out = a(x)
    t = x.reshape(1, 4, 8)
    q, k, v = a.qkv(t).reshape(1, 4, 3, 2, 4).permute(2, 0, 3, 1, 4)
    bias = a.relative_position_bias_table[a.relative_position_index].view(4, 4, 2).permute(2, 0, 1)
    att = ((q * 4 ** -0.5) @ k.transpose(-2, -1) + bias).softmax(-1)
    ref = a.proj((att @ v).transpose(1, 2).reshape(1, 4, 8)).reshape(1, 2, 2, 8)
    torch.testing.assert_close(out, ref)


def test_eva_qkv_is_used_through_f_linear_with_a_built_bias():
    model, make, loss_fn = zoo.eva_like()
    attn = [m for m in model.modules() if isinstance(m, zoo.EvaAttention)]
    calls = _calls(*[a.qkv for a in attn], *[a.proj for a in attn])
    loss_fn(model, make(0)).backward()
    for a in attn:
        assert a.qkv.bias is None
        assert calls[a.qkv] == 0 and calls[a.proj] == 1
        assert a.qkv.weight.grad is not None and a.q_bias.grad is not None and a.v_bias.grad is not None


def test_mamba_dt_proj_as_left_operand_and_opaque_conv():
    model, make, loss_fn = zoo.mamba_like()
    mixers = list(model.layers)
    calls = _calls(*[m.dt_proj for m in mixers], *[m.conv1d for m in mixers], *[m.in_proj for m in mixers])
    seen: list[str] = []

    class Spy(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (F.conv1d, torch.conv1d):
                seen.append("conv1d")
            return func(*args, **(kwargs or {}))

    with Spy():
        loss_fn(model, make(0)).backward()
    for m in mixers:
        assert calls[m.dt_proj] == 0 and calls[m.conv1d] == 0 and calls[m.in_proj] == 1
        assert m.dt_proj.weight.grad is not None and m.dt_proj.bias.grad is not None
        assert m.conv1d.weight.grad is not None and m.conv1d.weight.grad.abs().sum() > 0
    assert not seen  # the fused kernel never calls F.conv1d: nothing a function mode could follow


def test_causal_conv_kernel_gradients():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(zoo.CausalConv1dFn.apply, (x, w, b))
    ref = F.silu(F.conv1d(x, w.unsqueeze(1), b, padding=3, groups=3)[..., :7])  # a causal depthwise conv
    torch.testing.assert_close(zoo.CausalConv1dFn.apply(x, w, b), ref)


def test_shared_weight_module_call_and_functional_uses():
    model, make, loss_fn = zoo.shared_weight()
    calls = _calls(model.enc, model.lin, model.head)
    loss_fn(model, make(0)).backward()
    assert calls == {model.enc: 1, model.lin: 0, model.head: 1}  # enc's second use and lin's only use: functions
    assert model.lin.weight.grad is not None and model.enc.weight.grad is not None


def test_whisper_positional_embedding_ignores_the_ids():
    model, make, _ = zoo.whisper_like()
    emb = model.embed_positions
    assert isinstance(emb, nn.Embedding) and type(emb).forward is not nn.Embedding.forward
    ids, _ = make(0)
    assert int(ids.max()) >= emb.num_embeddings  # token ids beyond its table: as ids they would be out of range
    torch.testing.assert_close(emb(ids), emb.weight[:ids.shape[1]])
    torch.testing.assert_close(emb(torch.zeros_like(ids)), emb(ids))
    torch.testing.assert_close(emb(ids, past_key_values_length=2), emb.weight[2:2 + ids.shape[1]])


def test_conv2d_same_pads_itself_and_the_kernel_exceeds_the_map():
    model, make, loss_fn = zoo.tf_same()
    x, _ = make(0)
    inner = {}
    model.conv_dw.register_forward_hook(lambda m, i, o: inner.update(x=i[0], y=o))
    loss_fn(model, make(0)).backward()
    assert inner["x"].shape[-2:] == (4, 4) and model.conv_dw.kernel_size == (5, 5)
    assert inner["y"].shape[-2:] == (4, 4)  # 'same'
    assert model.conv_dw.padding == (0, 0)
    with pytest.raises(RuntimeError):  # convolving the unpadded input fails
        F.conv2d(inner["x"], model.conv_dw.weight, model.conv_dw.bias)
    assert x.shape[-2:] == (8, 8)


def test_wav2vec2_masking_writes_into_the_projection_output():
    model, make, loss_fn = zoo.wav2vec2_like()
    got = {}
    model.projection.register_forward_hook(lambda m, i, o: got.update(version=o._version, out=o))
    audio, mask, _ = inputs = make(0)
    loss_fn(model, inputs).backward()
    assert got["out"]._version > got["version"]  # modified in place after the module returned it
    assert torch.equal(got["out"][mask], model.masked_spec_embed.detach().expand(int(mask.sum()), -1))
    assert model.masked_spec_embed.grad is not None and model.projection.weight.grad is not None
    model.eval()  # no masking outside training
    got.clear()
    model(audio, mask)
    assert got["out"]._version == got["version"]


def _compiled_case(backend: str) -> None:
    model, make, loss_fn = zoo.compiled_before(backend)
    assert isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
    inner = model._orig_mod
    calls = _calls(inner.conv1, inner.fc1)  # hooks added after the warm-up forward, as K-FAC's would be
    loss_fn(model, make(1)).backward()
    assert calls == {inner.conv1: 0, inner.fc1: 0}  # the cached graph runs without them
    assert inner.conv1.weight.grad is not None
    fresh = zoo.SmallCNN()
    calls = _calls(fresh.conv1)
    loss = loss_fn(fresh, make(1))
    assert calls[fresh.conv1] == 1 and torch.isfinite(loss)  # an eager copy calls them


def test_compiled_before_aot_eager():
    _compiled_case("aot_eager")


@pytest.mark.slow  # inductor compiles C++: about 10 s on 2 cores
def test_compiled_before_inductor():
    _compiled_case("inductor")


@pytest.mark.parametrize("family", list(zoo.MOE_SPECS))
@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_moe_models(family, impl):
    pytest.importorskip("transformers")
    model, make, loss_fn = zoo.moe(family, impl)
    assert model.config._experts_implementation == impl
    experts = {n: p for n, p in model.named_parameters() if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    assert experts and all(p.dim() == 3 for p in experts.values())
    E = next(iter(experts.values())).shape[0]
    assert E == 4
    _run((model, make, loss_fn))
    _assert_all_grads(model)
    assert all(p.grad.abs().sum() > 0 for p in experts.values())


def test_moe_default_implementation_on_this_torch():
    """What transformers picks when asked for nothing (documented in lookalikes.py): grouped_mm where torch has
    F.grouped_mm (torch >= 2.10; on CPU the alignment fallback is for torch <= 2.10 only)."""
    pytest.importorskip("transformers")
    model, _, _ = zoo.moe("mixtral", None)
    want = "grouped_mm" if hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm") else "eager"
    assert model.config._experts_implementation == want


def test_moe_eager_and_grouped_mm_agree():
    pytest.importorskip("transformers")
    a, make, loss_fn = zoo.moe("mixtral", "eager")
    b, _, _ = zoo.moe("mixtral", "grouped_mm")
    b.load_state_dict(a.state_dict())
    torch.testing.assert_close(loss_fn(a, make(0)), loss_fn(b, make(0)), rtol=1e-4, atol=1e-5)


def test_lora_llama():
    why = zoo.peft_available()
    if why is not None:
        pytest.skip(why)
    model, make, loss_fn = zoo.lora_llama()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
    assert any(n.endswith("q_proj.base_layer.weight") for n, _ in model.named_parameters())
    _run((model, make, loss_fn))
    _assert_all_grads(model)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
