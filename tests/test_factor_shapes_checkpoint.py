"""Checkpoints of diagonal and grouped factors (state version 3: 'layer_dims' holds shapes): they round-trip,
are checked against the model's factor shapes, version-2 states (ints: dense factors) still load, and under
dpkfac the gathered state (from each layer's owner) has every layer's shapes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_spdkfac.comm.dpkfac import DPKFACDistributor
from lightning_spdkfac.comm.scheduler import SPDOptions
from lightning_spdkfac.kfac import KFACPreconditioner
from lightning_spdkfac.kfac.checkpoint import STATE_VERSION
from lightning_spdkfac.multiprocess import run_distributed

pytestmark = pytest.mark.timeout(120)

KW = {"lr": 0.1, "damping": 0.01, "factor_update_steps": 1, "inv_update_steps": 1}
# A grouped conv (both factors grouped: 4 blocks), a linear with a diagonal A (129 > 25), one with a diagonal G.
SHAPES = {"0": [[4, 10, 10], [4, 2, 2]], "3": [[129], 20], "5": [21, [30]]}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(4, 8, 3, groups=4, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(128, 20),
                         nn.ReLU(), nn.Linear(20, 30))


def train(pre: KFACPreconditioner, m: nn.Module, steps: int = 2, seed: int = 1) -> None:
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        x, y = torch.randn(8, 4, 4, 4, generator=g), torch.randint(0, 30, (8,), generator=g)
        F.cross_entropy(m(x), y).backward()
        pre.step()
        opt.step()


def trained(method: str = "cholesky", max_side: int = 25) -> tuple[KFACPreconditioner, dict]:
    m = model()
    pre = KFACPreconditioner(m, max_factor_side=max_side, inverse_method=method, **KW)
    train(pre, m)
    return pre, pre.state_dict()


@pytest.mark.parametrize("method", ["cholesky", "eigen"])
def test_diag_and_grouped_state_round_trips(method):
    pre, state = trained(method)
    assert state["version"] == STATE_VERSION == 3
    assert state["layer_dims"] == SHAPES
    shapes = {n: {k: tuple(t.shape) for k, t in e.items()} for n, e in state["layers"].items()}
    assert shapes["0"]["A"] == (4, 10, 10) and shapes["3"]["A"] == (129,) and shapes["5"]["G"] == (30,)
    if method == "eigen":
        assert shapes["0"]["A_inv"] == (4, 11, 10) and shapes["3"]["A_inv"] == (129,)
    fresh_model = model()
    fresh = KFACPreconditioner(fresh_model, max_factor_side=25, inverse_method=method, **KW)
    fresh.load_state_dict(copy.deepcopy(state))
    for name, entry in state["layers"].items():
        for key, t in entry.items():
            assert torch.equal(getattr(fresh.layers[name], key), t), (name, key)
    again = fresh.state_dict()  # saved again: the same state
    assert again["layer_dims"] == SHAPES
    for name, entry in state["layers"].items():
        assert all(torch.equal(again["layers"][name][k], t) for k, t in entry.items())


def test_state_of_other_layouts_is_refused_naming_the_shapes():
    _, state = trained(max_side=25)
    dense = KFACPreconditioner(model(), max_factor_side=4096, **KW)  # every factor of the linears dense here
    with pytest.raises(ValueError, match="does not match this model") as err:
        dense.load_state_dict(state)
    msg = str(err.value)
    assert "'3': factor shapes (129,), (20, 20); this model needs (129, 129), (20, 20)" in msg
    assert "'5': factor shapes (21, 21), (30,); this model needs (21, 21), (30, 30)" in msg


CORRUPT = [
    ("grouped inverse not symmetric",
     lambda s: s["layers"]["0"]["A_inv"].add_(torch.triu(torch.ones(10, 10), 1)),
     r"layer '0': A_inv is not symmetric \(per block\)"),
    ("diagonal factor with a negative entry", lambda s: s["layers"]["3"]["A"].__setitem__(7, -1.0),
     r"layer '3': A has a negative diagonal entry \(-1 at 7\)"),
    ("grouped factor with a negative diagonal", lambda s: s["layers"]["0"]["G"].__setitem__((2, 1, 1), -1.0),
     r"layer '0': G has a negative diagonal entry \(-1 at block 2, 1\)"),
    ("grouped factor saved as one block", lambda s: s["layers"]["0"].__setitem__("G", s["layers"]["0"]["G"][0]),
     r"layer '0': G must be a \(b, n, n\) stack of square blocks, got shape \(2, 2\)"),
    ("diagonal inverse of another length", lambda s: s["layers"]["5"].__setitem__("G_inv", torch.ones(29)),
     r"layer '5': inverse shapes \(21, 21\), \(29,\) differ from factor shapes \(21, 21\), \(30,\)"),
    ("layer_dims a bad shape", lambda s: s["layer_dims"].__setitem__("5", [21, [30, 31]]),
     r"'layer_dims' entry '5': expected \[A side, G side\], each a positive integer n .* got \[21, \[30, 31\]\]"),
    ("layer_dims another layout", lambda s: s["layer_dims"].__setitem__("5", [21, 30]),
     r"layer '5': G must be a square matrix, got shape \(30,\)"),
]


@pytest.mark.parametrize("name, corrupt, match", CORRUPT, ids=[c[0] for c in CORRUPT])
def test_corrupt_diag_and_grouped_states_are_refused(name, corrupt, match):
    pre, state = trained()
    corrupt(state)
    with pytest.raises(ValueError, match=match):
        pre.check_state_dict(state)


def test_version_2_states_still_load():
    """A version-2 state: 'layer_dims' ints (every factor dense then), and nothing else differs."""
    m = model()
    pre = KFACPreconditioner(m, max_factor_side=4096, **KW)
    train(pre, m)
    state = pre.state_dict()
    assert state["layer_dims"] == {"0": [[4, 10, 10], [4, 2, 2]], "3": [129, 20], "5": [21, 30]}
    v2 = copy.deepcopy(state)
    v2["version"] = 2
    del v2["layer_dims"]["0"], v2["layers"]["0"]  # (a grouped conv could not be saved by version 2)
    dense_model = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(128, 20),
                                nn.ReLU(), nn.Linear(20, 30))
    fresh = KFACPreconditioner(dense_model, skip_layers="^0$", max_factor_side=4096, **KW)
    fresh.load_state_dict(v2)
    for name in ("3", "5"):
        for key in ("A", "G", "A_inv", "G_inv"):
            assert torch.equal(getattr(fresh.layers[name], key), state["layers"][name][key])
    v2["layer_dims"]["3"] = [128, 20]
    with pytest.raises(ValueError, match=r"layer '3': factor sides \(129, 20\) disagree with 'layer_dims' \(128, 20\)"):
        fresh.check_state_dict(v2)


def _dpkfac_state(rank: int, world: int) -> dict:
    m = model()
    d = DPKFACDistributor(SPDOptions.from_schedule("dpkfac", profile_steps=(0, 1)), process_group=dist.new_group())
    pre = KFACPreconditioner(m, max_factor_side=25, distributor=d, **KW)
    train(pre, m, steps=3, seed=10 + rank)
    state = pre.state_dict()  # gathered from each layer's owner: every layer, on every rank
    return {"dims": state["layer_dims"], "layers": state["layers"], "owners": list(d.layer_owners)}


def test_dpkfac_state_gathers_diag_and_grouped_layers_two_ranks():
    r0, r1 = run_distributed(_dpkfac_state, 2, timeout=110)
    assert r0["dims"] == r1["dims"] == SHAPES
    assert len(set(r0["owners"])) == 2  # the layers are spread over both ranks
    assert r0["layers"].keys() == r1["layers"].keys() == SHAPES.keys()
    for name, entry in r0["layers"].items():
        for key, t in entry.items():
            assert torch.equal(t, r1["layers"][name][key]), (name, key)
