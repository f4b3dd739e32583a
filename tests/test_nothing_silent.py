"""Nothing left out silently (issue 35): frozen parameters are neither registered nor counted, and every trainable
parameter whose K-FAC block produced no factors is named with the measured reason.

- A PEFT-LoRA look-alike (frozen ``nn.Linear`` bases, trainable ``lora_A`` / ``lora_B`` adapters): the bases are not
  registered (no hooks, no memory), the summary's share is of trainable parameters only, the memory it states is what
  the adapters' blocks hold (counted from the tensors), and a ``memory_limit`` sized for the adapters accepts the run.
- A layer whose weight is frozen but whose bias trains: not registered, the bias named with the reason.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_spdkfac.kfac import KFACPreconditioner
from lightning_spdkfac.kfac.gradients import GradAccess
from tests.helpers.memory import held_bytes


class LoRALinear(nn.Module):
    """What peft.LoraModel makes of an ``nn.Linear``: the frozen base plus a trainable low-rank update."""

    def __init__(self, n_in: int, n_out: int, rank: int = 4, alpha: float = 8.0) -> None:
        super().__init__()
        self.base_layer = nn.Linear(n_in, n_out).requires_grad_(False)
        self.lora_A = nn.Linear(n_in, rank, bias=False)
        self.lora_B = nn.Linear(rank, n_out, bias=False)
        nn.init.normal_(self.lora_B.weight, std=0.02)  # (peft starts B at zero; any value serves here)
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * self.scale


def lora_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(LoRALinear(96, 96), nn.Tanh(), LoRALinear(96, 10))


def adapters_only() -> nn.Module:
    """The adapters' layers alone, as plain trainable layers of the same shapes: the reference for their blocks."""
    return nn.Sequential(nn.Linear(96, 4, bias=False), nn.Linear(4, 96, bias=False), nn.Linear(96, 4, bias=False),
                         nn.Linear(4, 10, bias=False))


def train(model: nn.Module, pre: KFACPreconditioner, steps: int = 2) -> None:
    for _ in range(steps):
        model.zero_grad()
        F.cross_entropy(model(torch.randn(8, 96)), torch.randint(0, 10, (8,))).backward()
        pre.step()


def test_lora_summary_counts_only_the_adapters() -> None:
    model = lora_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a frozen base is not worth a warning
        pre = KFACPreconditioner(model, lr=0.1, factor_update_steps=1, inv_update_steps=1)
    assert sorted(pre.layers) == ["0.lora_A", "0.lora_B", "2.lora_A", "2.lora_B"]
    assert all(not ly.handles or "base" not in ly.name for ly in pre.layers.values())
    for base in (model[0].base_layer, model[2].base_layer):  # no hooks on the frozen bases
        assert not base._forward_hooks and not base._forward_pre_hooks
    s = pre.summary()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert s.trainable == trainable == 96 * 4 + 4 * 96 + 96 * 4 + 4 * 10
    assert s.preconditioned == trainable and not s.left_out  # 100%, the frozen bases nowhere
    assert "(100.0% of 1,192 trainable)" in str(s), str(s)
    # The memory stated is that of the adapters' blocks: as for the same layers trained on their own, and as held.
    assert s.total_bytes == KFACPreconditioner(adapters_only(), lr=0.1).summary().total_bytes
    train(model, pre)
    held = held_bytes(pre)
    assert held > 0 and abs(s.total_bytes - held) <= 0.05 * held, (s.total_bytes, held)
    assert model[0].base_layer.weight.grad is None


def test_memory_limit_sized_for_the_adapters_accepts_lora() -> None:
    limit = int(1.1 * KFACPreconditioner(adapters_only(), lr=0.1).summary().peak_bytes)  # (the limit bounds the peak)
    model = lora_model()
    pre = KFACPreconditioner(model, lr=0.1, memory_limit=limit)
    train(model, pre)
    assert held_bytes(pre) <= limit
    full = lora_model().requires_grad_(True)  # the bases trained too: they need far more than the adapters
    with pytest.raises(MemoryError, match="memory_limit"):
        KFACPreconditioner(full, lr=0.1, memory_limit=limit)


def test_a_trainable_bias_beside_a_frozen_weight_is_named() -> None:
    """Decided: K-FAC preconditions a layer's weight and bias together, so a layer registers only once all of them
    train; a trainable bias beside a frozen weight is left to the optimizer, named (warning and summary)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model[0].weight.requires_grad_(False)
    with pytest.warns(UserWarning, match=r"layer '0' to the optimizer while some of its parameters are frozen"):
        pre = KFACPreconditioner(model, lr=0.1)
    assert list(pre.layers) == ["2"]
    s = pre.summary()
    assert [(x.name, x.params) for x in s.left_out] == [("0.bias", 8)]
    assert "weight and bias together" in s.left_out[0].reason
    assert s.preconditioned + 8 == s.trainable == 8 + 8 * 3 + 3
    bias = model[0].bias
    model.zero_grad()
    F.cross_entropy(model(torch.randn(4, 6)), torch.randint(0, 3, (4,))).backward()
    raw = bias.grad.clone()
    pre.step()
    assert torch.equal(bias.grad, raw)  # left as it is


# --------------------------------------------------------------------------- blocks that produced no factors
class Functional(nn.Module):
    """``lin`` is registered (an nn.Linear) but its forward is never called: its weight goes through F.linear, as in
    torchvision's Swin-T attention."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(F.linear(x, self.lin.weight, self.lin.bias)))


class OutputWithoutGradient(nn.Module):
    """``lin``'s forward runs (a side output that is detached: no gradient reaches it) while the loss reaches its
    weight through a function: the output-gradient hook never runs. (Writing into the output in place, by index,
    masked_fill_ or a view, does not lose the hook on this torch: the hook fires; checked in the tests' history.)"""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        side = self.lin(x).detach()  # e.g. a masked copy kept for logging
        side.masked_fill_(side < 0, 0.0)
        return self.head(torch.tanh(F.linear(x, self.lin.weight, self.lin.bias)))


def run(model: nn.Module, pre: KFACPreconditioner, steps: int = 3) -> list[str]:
    torch.manual_seed(1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(steps):
            model.zero_grad()
            F.cross_entropy(model(torch.randn(4, 6)), torch.randint(0, 3, (4,))).backward()
            pre.step()
    return [str(w.message) for w in record if "K-FAC" in str(w.message)]


def assert_named(model: nn.Module, pre: KFACPreconditioner, msgs: list[str], reason: str) -> None:
    named = [m for m in msgs if "'lin'" in m]
    assert len(named) == 1 and reason in named[0], msgs  # once, over three steps
    assert pre.layers["head"].A is not None and pre.layers["lin"].A is None
    s = pre.summary()
    left = {x.name: x.reason for x in s.left_out}
    assert set(left) == {"lin.weight", "lin.bias"} and reason in left["lin.weight"], left
    assert s.preconditioned == 8 * 3 + 3 == s.trainable - (8 * 6 + 8)  # the head's block only
    assert "lin (no factors)" in str(s) and reason in str(s)


def test_a_weight_used_through_a_function_is_named_and_not_counted_without_capture() -> None:
    model = Functional()
    pre = KFACPreconditioner(model, lr=0.1, factor_update_steps=1, capture=False)
    assert pre.summary().preconditioned == pre.summary().trainable  # before any step: nothing measured yet
    assert_named(model, pre, run(model, pre), "and capture=False")


def test_a_weight_used_through_a_function_is_followed_from_the_first_step() -> None:
    """capture='auto' (the default): the first factor step follows every layer and finds the function's use."""
    model = Functional()
    pre = KFACPreconditioner(model, lr=0.1, factor_update_steps=1)
    assert [m for m in run(model, pre) if "'lin'" in m] == []
    assert pre.layers["lin"].A is not None and not pre.unfactored
    s = pre.summary()
    assert s.preconditioned == s.trainable and not s.left_out and "lin (functions)" in str(s)


def test_an_output_that_got_no_gradient_is_named_with_its_reason() -> None:
    model = OutputWithoutGradient()
    pre = KFACPreconditioner(model, lr=0.1, factor_update_steps=1)
    msgs = run(model, pre)
    assert_named(model, pre, msgs, "its output got no gradient while its weight did")
    assert not any("backward call(s) in one step" in m for m in msgs), msgs  # one warning, with the reason


def test_a_model_compiled_before_kfac_is_named_with_the_compile_reason() -> None:
    if not hasattr(torch, "compile"):
        pytest.skip("this torch has no torch.compile")
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model = torch.compile(inner, backend="eager")  # (eager: no C compiler needed; the cached graph is what matters)
    try:
        model(torch.randn(4, 6)).sum().backward()  # a warm-up forward before K-FAC attaches its hooks
    except Exception as e:  # pragma: no cover - a platform where dynamo cannot run
        pytest.skip(f"torch.compile does not run here: {e}")
    pre = KFACPreconditioner(model, lr=0.1, factor_update_steps=1)
    msgs = run(model, pre, steps=2)
    assert len(msgs) == 1 and "compiled before K-FAC attached" in msgs[0], msgs
    assert "'_orig_mod.0'" in msgs[0] and "'_orig_mod.2'" in msgs[0]
    s = pre.summary()
    assert s.preconditioned == 0 and all("compile after K-FAC is set up" in x.reason for x in s.left_out)


def test_legitimate_no_gradient_cases_stay_quiet() -> None:
    """A layer not used this step (its gradient zeros left by zero_grad(set_to_none=False)), a frozen one, one another
    optimizer steps: no warning, no error."""

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.frozen, self.other = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)
            self.step = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.step += 1
            h = self.a(x) if self.step % 2 else self.b(x)  # each branch unused every other step
            return self.other(self.frozen(torch.tanh(h)))

    torch.manual_seed(0)
    model = Branchy()
    pre = KFACPreconditioner(model, lr=0.1, factor_update_steps=1)
    model.frozen.requires_grad_(False)  # frozen after setup
    opt = torch.optim.SGD([*model.a.parameters(), *model.b.parameters()], lr=0.1)  # 'other': another optimizer's
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(4):
            model.zero_grad(set_to_none=False)  # the unused branch keeps a zero gradient, not None
            F.cross_entropy(model(torch.randn(4, 6)), torch.randint(0, 3, (4,))).backward()
            pre.step(opt)
            opt.step()
    assert not [str(w.message) for w in record if "K-FAC" in str(w.message)]
    assert not pre.unfactored


# --------------------------------------------------------------------------- gradients K-FAC cannot read
class FlatShards(GradAccess):
    """What a strategy that is not K-FAC-aware hands over under FSDP (use_orig_params): a flat shard per parameter."""

    def open(self, params):
        return {p: None if p.grad is None else p.grad.reshape(-1)[: p.numel() // 2] for p in params}


def test_a_flat_gradient_shard_raises_naming_the_layer() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8, bias=False), nn.Tanh(), nn.Linear(8, 3, bias=False))
    pre = KFACPreconditioner(model, lr=0.1, grad_access=FlatShards())
    F.cross_entropy(model(torch.randn(4, 6)), torch.randint(0, 3, (4,))).backward()
    with pytest.raises(RuntimeError, match=r"K-FAC layer '0': its weight's gradient has shape \(24,\), not \(8, 6\)"
                                           r".*SPDKFACDeepSpeedStrategy"):
        pre.step()


def test_gradients_kept_elsewhere_raise_instead_of_a_silent_plain_run() -> None:
    """A ZeRO-like strategy takes every gradient into its own buffer (param.grad None) although the hooks ran."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    pre = KFACPreconditioner(model, lr=0.1)
    F.cross_entropy(model(torch.randn(4, 6)), torch.randint(0, 3, (4,))).backward()
    with pytest.raises(RuntimeError, match=r"hooks of 2 layer\(s\) ran \('0', '2'\).*param.grad is None.*"
                                           r"SPDKFACDeepSpeedStrategy or the DDP strategy"):
        pre.step()


def test_a_gradient_that_does_not_match_the_factors_raises_naming_the_layer() -> None:
    """The layer's weight replaced by one of another shape after its factors were taken (was: a silent skip)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    pre = KFACPreconditioner(model, lr=0.1, factor_update_steps=10, inv_update_steps=10)
    F.cross_entropy(model(torch.randn(4, 6)), torch.randint(0, 3, (4,))).backward()
    pre.step()  # factors and inverses for a 6-input layer
    model[0].weight.data = torch.randn(8, 5)  # the same Parameter, another shape
    model.zero_grad()
    F.cross_entropy(model(torch.randn(4, 5)), torch.randint(0, 3, (4,))).backward()  # not a factor step
    with pytest.raises(RuntimeError, match=r"K-FAC layer '0': its gradient matrix has shape \(8, 6\), not \(8, 7\)"):
        pre.step()


def test_a_state_naming_a_layer_frozen_at_setup_registers_it() -> None:
    """Resuming a fine-tuning run: the state was saved once the layer trained; here it is frozen at setup."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    pre = KFACPreconditioner(model, lr=0.1)
    train_small = [(torch.randn(4, 6), torch.randint(0, 3, (4,))) for _ in range(2)]
    for x, y in train_small:
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
    state = pre.state_dict()
    model[0].requires_grad_(False)
    resumed = KFACPreconditioner(model, lr=0.1)
    assert "0" not in resumed.layers
    resumed.load_state_dict(state)
    assert "0" in resumed.layers and torch.equal(resumed.layers["0"].A, pre.layers["0"].A)
