"""Mixture-of-experts blocks (kfac/experts.py): transformers-5 expert stacks as per-expert grouped blocks, against
dense per-expert references computed here; the eager and grouped_mm implementations agree; experts that got no
token keep their factors; other MoE families and user stacks; replicas agree on two ranks."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_spdkfac.kfac.experts import register_experts
from lightning_spdkfac.kfac.preconditioner import KFACPreconditioner

transformers = pytest.importorskip("transformers")

KW = dict(lr=0.05, factor_update_steps=1, inv_update_steps=1, damping=1e-2)


def mixtral(impl: str, seed: int = 0, experts: int = 4) -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    cfg = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=2, num_local_experts=experts,
                        num_experts_per_tok=2, max_position_embeddings=32)
    return MixtralForCausalLM._from_config(cfg, experts_implementation=impl)


def ids(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))


def train(model: nn.Module, pre: KFACPreconditioner, steps: int) -> list[str]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for step in range(steps):
            batch = ids(step)
            opt.zero_grad()
            model(input_ids=batch, labels=batch).loss.backward()
            pre.step(opt)
            opt.step()
    return [str(w.message) for w in record if "K-FAC" in str(w.message)]


def test_a_mixtral_is_preconditioned_whole_and_both_implementations_agree() -> None:
    runs = {}
    for impl in ("eager", "grouped_mm"):
        model = mixtral(impl)
        pre = KFACPreconditioner(model, **KW)
        assert train(model, pre, 2) == [], impl
        s = pre.summary()
        assert not pre.unfactored and s.preconditioned / s.trainable > 0.99
        stacks = [ly for ly in pre.layers.values() if ly.name.endswith(("gate_up_proj", "down_proj"))]
        assert len(stacks) == 4 and all(ly.A.shape == (4, 16, 16) or ly.A.shape == (4, 24, 24) for ly in stacks)
        assert pre.layers["model.layers.0.mlp.gate"].A.shape == (16, 16)  # the router's bare weight
        runs[impl] = (pre, [p.detach().clone() for p in model.parameters()])
    (pe, we), (pg, wg) = runs["eager"], runs["grouped_mm"]
    for name, layer in pe.layers.items():
        torch.testing.assert_close(layer.A, pg.layers[name].A, rtol=1e-4, atol=1e-6, msg=name)
        torch.testing.assert_close(layer.G, pg.layers[name].G, rtol=1e-4, atol=1e-6, msg=name)
    for a, b in zip(we, wg, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def reference_experts(experts: nn.Module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor):
    """MixtralExperts' forward written out per expert, keeping each linear map's input and output (whose gradients
    give the dense G sums)."""
    out = torch.zeros_like(hidden)
    calls: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {"gate_up_proj": {}, "down_proj": {}}
    for e in range(experts.num_experts):
        tok, pos = torch.where(index == e)
        if tok.numel() == 0:
            continue
        x = hidden[tok]
        y = x @ experts.gate_up_proj[e].T
        y.retain_grad()
        gate, up = y.chunk(2, dim=-1)
        h = experts.act_fn(gate) * up
        z = h @ experts.down_proj[e].T
        z.retain_grad()
        calls["gate_up_proj"][e] = (x, y)
        calls["down_proj"][e] = (h, z)
        out.index_add_(0, tok, z * weights[tok, pos, None])
    return out, calls


def test_expert_factors_against_dense_per_expert_sums() -> None:
    """A_e: the mean of x x^T over the tokens routed to expert e; G_e: N sum d d^T over their output gradients, N the
    tokens entering the block; an expert with no token keeps its factors."""
    model = mixtral("eager")
    experts = model.model.layers[0].mlp.experts
    pre = KFACPreconditioner(experts, **KW)
    torch.manual_seed(1)
    N = 10
    hidden = torch.randn(N, 16)
    index = torch.stack([torch.randint(0, 3, (N,)), torch.full((N,), 3)], 1)  # expert 3 gets every token
    index[:, 0][index[:, 0] == 2] = 0  # expert 2 gets none
    weights = torch.rand(N, 2)
    out = experts(hidden, index, weights)
    (out.square().sum() * 0.5).backward()
    pre.step()
    ref_out, calls = reference_experts(experts, hidden, index, weights)
    torch.testing.assert_close(ref_out.detach(), out.detach())  # the reference computes the block's output
    (ref_out.square().sum() * 0.5).backward()
    for pname, per in calls.items():
        layer = pre.layers[pname]
        seen = sorted(per)
        assert seen == [0, 1, 3]
        A_ref = torch.stack([per[e][0].T @ per[e][0] / per[e][0].shape[0] for e in seen])
        G_ref = torch.stack([N * per[e][1].grad.T @ per[e][1].grad for e in seen])
        torch.testing.assert_close(layer.A[seen], A_ref.detach(), rtol=1e-5, atol=1e-6, msg=pname)
        torch.testing.assert_close(layer.G[seen], G_ref.detach(), rtol=1e-5, atol=1e-6, msg=pname)
        # expert 2 got no token at the first update: the mean of the experts that did (a prior of their scale)
        torch.testing.assert_close(layer.A[2], layer.A[seen].mean(0), msg=pname)
    # a second factor step that routes everything to experts 0 and 3: experts 1 and 2 keep their factors
    before = {n: (ly.A.clone(), ly.G.clone()) for n, ly in pre.layers.items()}
    experts.zero_grad()
    index2 = torch.stack([torch.zeros(N, dtype=torch.long), torch.full((N,), 3)], 1)
    experts(torch.randn(N, 16), index2, weights).square().sum().backward()
    pre.step()
    for name, (A0, G0) in before.items():
        layer = pre.layers[name]
        assert torch.equal(layer.A[1:3], A0[1:3]) and torch.equal(layer.G[1:3], G0[1:3]), name
        assert not torch.equal(layer.A[0], A0[0]) and not torch.equal(layer.G[3], G0[3]), name


@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe"])
def test_other_moe_families_are_preconditioned(family: str) -> None:
    import transformers as tf

    torch.manual_seed(0)
    if family == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=24, moe_intermediate_size=12,
                                shared_expert_intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                                num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                max_position_embeddings=32)
        model = tf.Qwen2MoeForCausalLM(cfg)
    else:
        cfg = tf.OlmoeConfig(vocab_size=64, hidden_size=16, intermediate_size=12, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                             max_position_embeddings=32)
        model = tf.OlmoeForCausalLM(cfg)
    pre = KFACPreconditioner(model, **KW)
    assert train(model, pre, 2) == []
    s = pre.summary()
    assert not pre.unfactored and s.preconditioned / s.trainable >= 0.95, str(s)


class UserStack(nn.Module):
    """A user's MoE layer: experts stored (E, in, out) and applied as x @ w[e]."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 5, 4) * 0.3)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(x.shape[0], 4)
        for e in range(3):
            tok = (route == e).nonzero().squeeze(1)
            out = out.index_add(0, tok, x[tok] @ self.w[e])
        return self.head(torch.tanh(out))


def test_register_experts_for_another_implementation() -> None:
    register_experts(UserStack, {"w": "in_out"})
    torch.manual_seed(0)
    model = UserStack()
    pre = KFACPreconditioner(model, **KW)
    x, route = torch.randn(9, 5), torch.arange(9) % 3
    F.cross_entropy(model(x, route), torch.randint(0, 2, (9,))).backward()
    pre.step()
    layer = pre.layers["w"]
    assert layer.A.shape == (3, 5, 5) and layer.G.shape == (3, 4, 4)
    xe = x[route == 1]
    torch.testing.assert_close(layer.A[1], xe.T @ xe / 3)
    with pytest.raises(ValueError, match="'out_in' or 'in_out'"):
        register_experts(UserStack, {"w": "transposed"})


class SquareStack(nn.Module):
    """Experts (E, 5, 5) applied as x @ w[e]: square, so that both layouts have the shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 5, 5) * 0.3)
        self.head = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(x @ self.w[0]))


def test_a_stack_used_the_other_way_round_is_named() -> None:
    """Registered as (E, out, in) but applied as x @ w[e]: refused by name, with the reason."""
    register_experts(SquareStack, {"w": "out_in"})
    model = SquareStack()
    pre = KFACPreconditioner(model, **KW)
    F.cross_entropy(model(torch.randn(6, 5)), torch.zeros(6, dtype=torch.long)).backward()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        pre.step()
    assert "transposed" in pre.unfactored["w"] and any("'w'" in str(w.message) for w in record)


def test_a_mixtral_state_dict_round_trip() -> None:
    model = mixtral("grouped_mm")
    pre = KFACPreconditioner(model, **KW)
    train(model, pre, 2)
    twin = mixtral("grouped_mm")
    twin.load_state_dict(model.state_dict())
    other = KFACPreconditioner(twin, **KW)
    other.load_state_dict(pre.state_dict())
    for name, layer in pre.layers.items():
        assert torch.equal(layer.A, other.layers[name].A) and torch.equal(layer.G, other.layers[name].G), name


# ------------------------------------------------------------------ 2 ranks
def _ranked(rank: int, world: int) -> dict[str, list[torch.Tensor]]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_spdkfac.comm.scheduler import SPDDistributor, SPDOptions

    torch.set_num_threads(1)
    out = {}
    for schedule in ("spd", "dpkfac"):
        model = mixtral("grouped_mm")
        options = SPDOptions.from_schedule(schedule=schedule, profile_steps=(1, 2))
        pre = KFACPreconditioner(model, distributor=SPDDistributor(options, process_group=dist.new_group()), **KW)
        net = DDP(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(3):
            batch = ids(10 * step + rank)  # each rank its own tokens: its own routing
            opt.zero_grad()
            net(input_ids=batch, labels=batch).loss.backward()
            pre.step(opt)
            opt.step()
        assert not pre.unfactored
        out[schedule] = [p.detach().clone() for p in model.parameters()]
        pre.remove_hooks()
    return out


def test_two_ranks_keep_mixtral_replicas_equal() -> None:
    from lightning_spdkfac.multiprocess import run_distributed

    results = run_distributed(_ranked, 2, timeout=240)
    start = [p.detach() for p in mixtral("grouped_mm").parameters()]
    for schedule in ("spd", "dpkfac"):
        for a, b in zip(results[0][schedule], results[1][schedule], strict=True):
            assert torch.equal(a, b), f"{schedule}: the replicas differ"
        assert any(not torch.equal(a, s) for a, s in zip(results[0][schedule], start, strict=True))
