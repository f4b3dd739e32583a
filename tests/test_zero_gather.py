"""The fused ZeRO 1/2 gradient gather (one all-gather of the partitions) against DeepSpeed's own accessor.

Each case builds a real DeepSpeed engine on 2 gloo processes (no Trainer), runs a backward and, before
the step, compares what ``DeepSpeedGradAccess`` assembles with ``deepspeed.utils.safe_get_full_grad``
bit for bit (the sign of zeros included). The planner that turns every rank's pieces into the gather
is checked alone on layouts DeepSpeed would not produce.
"""

from __future__ import annotations

import argparse
import os
import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("deepspeed")

from lightning_spdkfac.lightning.deepspeed_grads import (  # noqa: E402
    DeepSpeedGradAccess,
    _fusable,
    _GatherPlan,
    _owned,
    _plan_layout,
)
from lightning_spdkfac.multiprocess import run_distributed  # noqa: E402


# ----------------------------------------------------------------------------------- the planner alone
def test_plan_of_a_parameter_straddling_two_partitions_and_one_owned_by_a_single_rank():
    # Rank 0 owns [0, 5) of a 8-element parameter; rank 1 the rest of it and all of a 3-element one.
    table = [[(0, 5), (0, 0)], [(5, 3), (0, 3)]]
    plan = _plan_layout(table, [8, 3], rank=0)
    assert plan == _GatherPlan(owned=((0, 5), (0, 0)), chunk=6, runs=((0, 5), (6, 6)))
    assert _plan_layout(table, [8, 3], rank=1).owned == ((5, 3), (0, 3))


def test_plan_is_one_run_where_the_partitions_follow_the_parameters():
    # Equal shares, in order: the full gradients are a view of the gathered buffer.
    table = [[(0, 4), (0, 0)], [(4, 2), (0, 2)]]
    assert _plan_layout(table, [6, 2], rank=1) == _GatherPlan(((4, 2), (0, 2)), 4, ((0, 8),))


def test_plan_of_parameters_in_another_order_than_the_partitions():
    # The K-FAC order lists the second partition's parameter first.
    table = [[(0, 0), (0, 4)], [(0, 3), (0, 0)]]
    plan = _plan_layout(table, [3, 4], rank=0)
    assert plan is not None and plan.chunk == 4 and plan.runs == ((4, 3), (0, 4))


def test_plan_refuses_pieces_that_do_not_tile_a_parameter():
    assert _plan_layout([[(0, 2)], [(3, 1)]], [4], rank=0) is None  # a gap
    assert _plan_layout([[(0, 3)], [(2, 2)]], [4], rank=0) is None  # an overlap
    assert _plan_layout([[(0, 2)], [(2, 1)]], [4], rank=0) is None  # short of the end
    assert _plan_layout([[(0, 4)], [(0, 4)]], [4], rank=0) is None  # replicated, not partitioned


def test_plan_of_nothing_owned_anywhere_is_empty():
    assert _plan_layout([[(0, 0)], [(0, 0)]], [0], rank=1) == _GatherPlan(((0, 0),), 0, ())


# ----------------------------------------------------------------------------------- real engines
class Net(nn.Module):
    """24 + 4 + 8 + 2 = 38 elements: at 2 ranks (partitions of 20) rank 0 owns part of the first weight
    only; the first weight straddles the two partitions and rank 0 owns nothing of the three others."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 4)
        self.b = nn.Linear(4, 2)
        # Both ranks' gradient of a.weight[0, :3] is -0.0: averaged, it stays -0.0 in the owner's fragment.
        self.a.weight.register_hook(self._negative_zeros)

    @staticmethod
    def _negative_zeros(grad):
        grad = grad.clone()
        grad[0, :3] = -0.0
        return grad

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _bits(t):
    return t.float().view(torch.int32)


def gather_on_rank(rank, world, zero, *, bf16=False, subset=None, order=None, steps=2, **config):
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    warnings.filterwarnings("ignore")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29500"))
    deepspeed.init_distributed("gloo")
    model = Net()
    engine, *_ = deepspeed.initialize(
        args=argparse.Namespace(device_rank=-1), model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        config=dict(train_micro_batch_size_per_gpu=4, zero_optimization=dict(stage=zero),
                    bf16=dict(enabled=bf16), zero_allow_untested_optimizer=True, **config),
    )
    params = list(model.parameters())
    if subset is not None:
        params = [params[i] for i in subset]
    if order is not None:
        params = [params[i] for i in order]
    access = DeepSpeedGradAccess(lambda: engine)
    g = torch.Generator().manual_seed(rank)
    out = dict(optimizer=type(engine.optimizer).__name__, steps=[])
    for _ in range(steps):
        x = torch.randn(4, 6, generator=g).to(torch.bfloat16 if bf16 else torch.float32)
        engine.backward(engine(x).float().square().mean())
        frag = [p for p in params if DeepSpeedGradAccess._partitioned(p)]
        step = dict(partitioned=len(frag), n=len(params))
        if frag:
            each = {p: safe_get_full_grad(p) for p in frag}
            grads = access.open(params)
            step.update(
                fused_path=access._fused_path, fusable=_fusable(frag), owned=_owned(frag),
                own_negative_zero=any(bool(torch.signbit(f[f == 0]).any()) for f in map(_fragment, frag) if f is not None),
            )
            step["bitwise"] = [bool(torch.equal(_bits(grads[p]), _bits(each[p]))) for p in frag]
            step["values"] = [bool(torch.equal(grads[p], each[p].float())) for p in frag]
            step["dtype"] = [str(grads[p].dtype) for p in frag]
            access.close({p: grads[p] for p in frag})  # writes back what it read: the step is unchanged
        out["steps"].append(step)
        engine.step()
    out["params"] = [p.detach().float().clone() for p in model.parameters()]
    return out


def _fragment(p):
    """This rank's averaged gradient piece (of the bf16 optimizer's full buffer: its share); None: it owns none."""
    if p._hp_mapping is None:
        return None
    f = p._hp_mapping.get_lp_grad_fragment(p._index_in_param_group).reshape(-1).float()
    a = p._hp_mapping.lp_fragment_address
    return f.narrow(0, a.start, a.numel) if f.numel() == p.numel() and a.numel != p.numel() else f


CASES = {
    "zero1-fp32": dict(zero=1),
    "zero2-fp32": dict(zero=2),
    "zero2-bf16": dict(zero=2, bf16=True),
    # bf16 parameters with fp32 accumulation at stage 1: DeepSpeed's BF16_Optimizer (a full fp32 buffer per rank)
    "bf16-optimizer": dict(zero=1, bf16=True, data_types=dict(grad_accum_dtype="fp32")),
    # only the weights (uneven shares: rank 0 sends 20 elements, rank 1 its 12 zero-padded), in reverse order
    "zero2-weights-reversed": dict(zero=2, subset=[2, 0]),
    # the K-FAC order need not be the partitions': the full gradients are assembled from several runs
    "zero2-reversed": dict(zero=2, order=[3, 2, 1, 0]),
}


# One case in the 10-minute suite, the others in make test-slow (each starts two DeepSpeed ranks: ~9 s).
@pytest.mark.parametrize("case", [c if c == "zero2-fp32" else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_fused_gather_is_bitwise_deepspeeds_full_gradient(case):
    results = run_distributed(gather_on_rank, 2, timeout=240, **CASES[case])
    for r in results:
        assert r["optimizer"] in ("DeepSpeedZeroOptimizer", "BF16_Optimizer")
        for step in r["steps"]:
            assert step["partitioned"] == step["n"] and step["fusable"] and step["fused_path"]
            assert all(step["bitwise"]) and all(step["values"]) and set(step["dtype"]) == {"torch.float32"}
    if not {"subset", "order"} & set(CASES[case]):
        # The layout the test is about: a.weight straddles the partitions, rank 0 owns nothing of the rest.
        owned0, owned1 = results[0]["steps"][0]["owned"], results[1]["steps"][0]["owned"]
        (s0, n0), (s1, n1) = owned0[0], owned1[0]
        assert n0 > 0 and n1 > 0 and s1 == s0 + n0 and n0 + n1 == 24
        assert all(n == 0 for _, n in owned0[1:]) and all(n > 0 for _, n in owned1[1:])
    if case in ("zero1-fp32", "zero2-fp32", "zero2-bf16"):
        # A -0.0 in an owner's fragment, which the all-reduce behind safe_get_full_grad makes +0.0 (the bf16
        # optimizer's accumulation adds it to +0.0 itself).
        assert results[0]["steps"][0]["own_negative_zero"]
    # the ranks stepped identically
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)


def test_zero0_bf16_leaves_gradients_in_param_grad():
    """Stage 0 in bf16 is DeepSpeed's FP16_Optimizer on bf16, which fills ``param.grad``: no gather at all."""
    r = run_distributed(gather_on_rank, 2, timeout=240, zero=0, bf16=True)[0]
    assert r["optimizer"] != "BF16_Optimizer" and all(s["partitioned"] == 0 for s in r["steps"])
