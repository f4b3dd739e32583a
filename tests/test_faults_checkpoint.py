"""Faults in K-FAC checkpoints: states of another model, corrupt states, truncated files, and
checkpoints without K-FAC state.

What must hold (issue 7):
- a state saved for another model (layers missing or unexpected, other factor shapes) is refused with
  one ValueError listing every mismatch and naming ``KFAC(load_state="skip")``; with that option K-FAC
  starts fresh, with a warning, and the rest of the checkpoint loads normally;
- a corrupt state (missing keys, wrong types, non-tensor entries, tensors of the wrong shape or dtype,
  non-finite factors, a version from the future) is refused, and a refused load leaves the
  preconditioner bitwise as it was (everything is verified before anything is assigned);
- ``trainer.fit(ckpt_path=...)`` with a truncated file fails while reading it, before Lightning
  restores anything: the model weights and K-FAC state are unchanged;
- a checkpoint of a run without the KFAC callback (plain SGD) resumes with K-FAC starting fresh and
  exactly one warning saying so.

References are independent of the code under test: snapshots taken before the fault, and, for the
resumed runs, the same steps written by hand (checkpoint weights and optimizer state + a fresh
KFACPreconditioner on the same batches).
"""

from __future__ import annotations

import copy
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers.lightning_models import KW, Tiny, data, trainer
from torch import nn

from lightning_spdkfac import KFAC, KFACPreconditioner
from lightning_spdkfac.kfac.checkpoint import STATE_VERSION

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*GPU available but not used.*")

# --------------------------------------------------------------------------- helpers (core)
def named(spec: dict[str, tuple[int, int]], seed: int = 0) -> nn.Module:
    """A chain of Linear layers with the given names and (in, out) sizes, tanh in between."""
    torch.manual_seed(seed)

    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleDict({n: nn.Linear(i, o) for n, (i, o) in spec.items()})

        def forward(self, x):
            for i, layer in enumerate(self.layers.values()):
                x = layer(x) if i == 0 else layer(torch.tanh(x))
            return x

    return Chain()


def train(model: nn.Module, pre: KFACPreconditioner, steps: int, seed: int = 1, d_in: int = 6) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, d_in, generator=g)
        model.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        pre.step()


def snapshot(pre: KFACPreconditioner):
    return (
        pre.steps,
        pre.skipped_factor_steps,
        {n: [None if t is None else t.clone() for t in (ly.A, ly.G, ly.A_inv, ly.G_inv)] for n, ly in pre.layers.items()},
    )


def assert_unchanged(pre: KFACPreconditioner, snap) -> None:
    steps, skipped, layers = snap
    assert pre.steps == steps and pre.skipped_factor_steps == skipped
    for name, saved in layers.items():
        ly = pre.layers[name]
        for which, before, now in zip(("A", "G", "A_inv", "G_inv"), saved, (ly.A, ly.G, ly.A_inv, ly.G_inv)):
            if before is None:
                assert now is None, f"{name}.{which} appeared"
            else:
                assert now is not None and torch.equal(now, before), f"{name}.{which} changed"


SPEC = {"enc": (6, 5), "mid": (5, 5), "head": (5, 3)}


@pytest.fixture
def trained():
    """A preconditioner after 3 steps, and a valid state of the same model taken on other data."""
    model = named(SPEC)
    pre = KFACPreconditioner(model, inv_update_steps=1, lr=0.1)
    train(model, pre, 3, seed=1)
    other_model = named(SPEC, seed=5)
    other = KFACPreconditioner(other_model, inv_update_steps=1, lr=0.1)
    train(other_model, other, 2, seed=7)
    state = copy.deepcopy(other.state_dict())
    # the state really differs from pre's in every layer, so a partial load would show
    for name, ly in pre.layers.items():
        assert not torch.equal(state["layers"][name]["A"], ly.A)
    return pre, state


# --------------------------------------------------------------------------- mismatched model
def test_state_of_another_model_lists_every_mismatch_and_changes_nothing():
    saved_model = named({"enc": (6, 5), "mid": (5, 5), "head": (5, 3)})
    saved = KFACPreconditioner(saved_model, lr=0.1)
    train(saved_model, saved, 2)
    state = saved.state_dict()
    assert set(state["layer_dims"]) == {"layers.enc", "layers.mid", "layers.head"}

    # this model: 'mid' is gone, 'extra' is new, 'head' has 4 outputs instead of 3
    model = named({"enc": (6, 5), "extra": (5, 5), "head": (5, 4)})
    pre = KFACPreconditioner(model, lr=0.1)
    train(model, pre, 2, seed=3)
    snap = snapshot(pre)
    with pytest.raises(ValueError) as err:
        pre.load_state_dict(state)
    msg = str(err.value)
    assert "does not match this model (3 problems)" in msg
    assert "unexpected layer 'layers.mid'" in msg
    assert "missing layer 'layers.extra'" in msg
    assert "'layers.head': factor shapes (6, 6), (3, 3); this model needs (6, 6), (4, 4)" in msg
    assert 'KFAC(load_state="skip")' in msg
    assert_unchanged(pre, snap)


def test_layer_without_factors_yet_is_still_checked_and_listed():
    # 'head' never ran in the saved run: it has no factors, but its sides are in layer_dims
    saved_model = named({"enc": (6, 5), "head": (5, 3)})
    saved = KFACPreconditioner(saved_model, lr=0.1)
    x = torch.randn(4, 6)
    saved_model.layers["enc"](x).pow(2).mean().backward()
    saved.step()
    state = saved.state_dict()
    assert list(state["layers"]) == ["layers.enc"] and state["layer_dims"]["layers.head"] == [6, 3]
    wide = KFACPreconditioner(named({"enc": (6, 5), "head": (5, 2)}), lr=0.1)
    with pytest.raises(ValueError, match=r"'layers.head': factor shapes \(6, 6\), \(3, 3\) \(no factors yet\)"):
        wide.load_state_dict(state)
    # the same model loads it: the layer without factors starts without factors
    same = KFACPreconditioner(named({"enc": (6, 5), "head": (5, 3)}, seed=9), lr=0.1)
    same.load_state_dict(state)
    assert torch.equal(same.layers["layers.enc"].A, saved.layers["layers.enc"].A)
    assert same.layers["layers.head"].A is None and same.steps == 1


def test_layer_skipped_here_says_why():
    model = named(SPEC)
    pre = KFACPreconditioner(model, lr=0.1)
    train(model, pre, 1)
    skipping = KFACPreconditioner(named(SPEC), skip_layers="mid", lr=0.1)
    with pytest.raises(ValueError, match=r"unexpected layer 'layers.mid'.*\(skipped here: matched skip_layers\)"):
        skipping.load_state_dict(pre.state_dict())


# --------------------------------------------------------------------------- corrupt states
def _set(path, value):
    def corrupt(state):
        d = state
        for key in path[:-1]:
            d = d[key]
        d[path[-1]] = value(d[path[-1]]) if callable(value) else value
    return corrupt


def _delete(path):
    def corrupt(state):
        d = state
        for key in path[:-1]:
            d = d[key]
        del d[path[-1]]
    return corrupt


def _nan_at(t):
    t = t.clone()
    t[1, 0] = float("nan")
    return t


def _inf_at(t):
    t = t.clone()
    t[0, 0] = float("inf")
    return t


LAST = "layers.head"  # the corrupt layer is the last one: see the test below
CORRUPTIONS = [
    ("missing steps", _delete(["steps"]), r"not a KFACPreconditioner state dict \(missing 'steps'"),
    ("missing layers", _delete(["layers"]), r"not a KFACPreconditioner state dict \(missing 'layers'"),
    ("missing version", _delete(["version"]), r"not a KFACPreconditioner state dict \(missing 'version'"),
    ("future version", _set(["version"], STATE_VERSION + 7),
     rf"K-FAC state version {STATE_VERSION + 7} was written by a newer lightning-spdkfac; this one reads versions "
     rf"up to {STATE_VERSION}: upgrade"),
    ("version not an int", _set(["version"], "2"), r"'version' must be a positive integer, got '2'"),
    ("negative steps", _set(["steps"], -3), r"'steps' must be a non-negative integer, got -3"),
    ("float steps", _set(["steps"], 2.5), r"'steps' must be a non-negative integer, got 2.5"),
    ("bool steps", _set(["steps"], True), r"'steps' must be a non-negative integer, got True"),
    ("layers a list", _set(["layers"], lambda v: list(v.values())), r"'layers' must be a dict of layer name"),
    ("layer_dims missing", _delete(["layer_dims"]), r"missing 'layer_dims'"),
    ("layer_dims entry bad", _set(["layer_dims", LAST], [6]), r"'layer_dims' entry 'layers.head': expected \[A side, G side\]"),
    ("entry not a dict", _set(["layers", LAST], lambda v: list(v.values())),
     r"layer 'layers.head': expected a dict with keys \['A', 'G', 'A_inv', 'G_inv'\], got list"),
    ("entry missing G_inv", _delete(["layers", LAST, "G_inv"]),
     r"layer 'layers.head': expected a dict with keys .*got \['A', 'A_inv', 'G'\]"),
    ("A not a tensor", _set(["layers", LAST, "A"], lambda t: t.tolist()), r"layer 'layers.head': A must be a tensor, got a list"),
    ("A integer dtype", _set(["layers", LAST, "A"], lambda t: t.to(torch.int64)),
     r"layer 'layers.head': A must be a floating-point tensor, got dtype torch.int64"),
    ("A complex dtype", _set(["layers", LAST, "A"], lambda t: t.to(torch.complex64)),
     r"layer 'layers.head': A must be a floating-point tensor, got dtype torch.complex64"),
    ("G not square", _set(["layers", LAST, "G"], lambda t: t[:, :-1]), r"layer 'layers.head': G must be a square matrix, got shape \(3, 2\)"),
    ("G a vector", _set(["layers", LAST, "G"], lambda t: t.diagonal().clone()), r"G must be a square matrix, got shape \(3,\)"),
    ("A of another size", _set(["layers", LAST], lambda e: {**e, "A": torch.eye(9), "A_inv": torch.eye(9)}),
     r"layer 'layers.head': factor sides \(9, 3\) disagree with 'layer_dims' \(6, 3\)"),
    ("NaN in A", _set(["layers", LAST, "A"], _nan_at), r"layer 'layers.head': A has non-finite values"),
    ("inf in G_inv", _set(["layers", LAST, "G_inv"], _inf_at), r"layer 'layers.head': G_inv has non-finite values"),
    ("one inverse missing", _set(["layers", LAST, "A_inv"], None), r"A_inv and G_inv must both be tensors or both None"),
    ("inverse of another shape", _set(["layers", LAST, "A_inv"], lambda t: torch.eye(4)),
     r"inverse shapes \(4, 4\), \(3, 3\) differ from factor shapes \(6, 6\), \(3, 3\)"),
]


@pytest.mark.parametrize("name, corrupt, match", CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_corrupt_state_is_refused_and_changes_nothing(trained, name, corrupt, match):
    pre, state = trained
    # The corruption is in the last layer: the other layers of the state are valid and differ from
    # pre's, so an implementation that checked and assigned layer by layer would have changed them.
    corrupt(state)
    snap = snapshot(pre)
    with pytest.raises(ValueError, match=match) as err:
        pre.load_state_dict(state)
    assert 'KFAC(load_state="skip")' in str(err.value)
    assert_unchanged(pre, snap)
    with pytest.raises(ValueError, match=match):
        pre.check_state_dict(state)  # the check alone says the same
    assert_unchanged(pre, snap)


def test_every_problem_is_listed_at_once(trained):
    pre, state = trained
    state["steps"] = -1
    state["layers"]["layers.enc"]["A"] = _nan_at(state["layers"]["layers.enc"]["A"])
    state["layers"]["layers.head"]["G"] = state["layers"]["layers.head"]["G"].to(torch.int32)
    state["layers"]["layers.ghost"] = state["layers"]["layers.mid"]
    snap = snapshot(pre)
    with pytest.raises(ValueError) as err:
        pre.load_state_dict(state)
    msg = str(err.value)
    assert msg.startswith("K-FAC state is corrupt (4 problems); nothing was loaded")
    for part in ("'steps' must be a non-negative integer", "'layers.enc': A has non-finite values",
                 "'layers.head': G must be a floating-point tensor", "'layers.ghost' has factors but is not listed"):
        assert part in msg
    assert_unchanged(pre, snap)


def test_not_a_dict_is_refused():
    pre = KFACPreconditioner(named(SPEC), lr=0.1)
    for bad in (None, [1, 2], "state", torch.zeros(3)):
        with pytest.raises(ValueError, match="not a KFACPreconditioner state dict: got a"):
            pre.load_state_dict(bad)
    assert pre.steps == 0 and all(ly.A is None for ly in pre.layers.values())


def test_valid_state_loads_after_a_refusal_and_version_1_states_still_load(trained):
    pre, state = trained
    bad = copy.deepcopy(state)
    bad["layers"]["layers.mid"]["G"] = _inf_at(bad["layers"]["layers.mid"]["G"])
    with pytest.raises(ValueError):
        pre.load_state_dict(bad)
    pre.load_state_dict(state)
    for name, s in state["layers"].items():
        for which in ("A", "G", "A_inv", "G_inv"):
            assert torch.equal(getattr(pre.layers[name], which), s[which])
    assert pre.steps == state["steps"] == 2
    # A version-1 state (before layer_dims) loads too; float64 factors are converted to factor_dtype.
    v1 = copy.deepcopy(state)
    v1["version"] = 1
    del v1["layer_dims"]
    v1["layers"]["layers.enc"]["A"] = v1["layers"]["layers.enc"]["A"].double()
    fresh = KFACPreconditioner(named(SPEC), lr=0.1)
    fresh.load_state_dict(v1)
    assert fresh.layers["layers.enc"].A.dtype == torch.float32
    assert torch.equal(fresh.layers["layers.enc"].A, state["layers"]["layers.enc"]["A"])


# --------------------------------------------------------------------------- Lightning checkpoints
def params(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def kfac_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "K-FAC" in str(w.message)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Lightning checkpoints after epoch 1 (4 steps) of Tiny: with K-FAC and without (plain SGD)."""
    tmp = tmp_path_factory.mktemp("ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = trainer(max_epochs=1, callbacks=[KFAC(**KW)])
        t.fit(Tiny())
        t.save_checkpoint(tmp / "kfac.ckpt")
        t = trainer(max_epochs=1)
        t.fit(Tiny())
        t.save_checkpoint(tmp / "sgd.ckpt")
    return tmp


def continue_by_hand(ckpt_path, kfac_kwargs, steps=4, lr=0.2):
    """Epoch 2 written by hand: the checkpoint's weights and SGD state, a fresh K-FAC, batches 0-3."""
    ckpt = torch.load(ckpt_path, weights_only=False)
    module = Tiny()
    module.load_state_dict(ckpt["state_dict"])
    opt = torch.optim.SGD(module.parameters(), lr=lr, momentum=0.9)
    opt.load_state_dict(ckpt["optimizer_states"][0])
    # on the LightningModule, as the callback does: layer names "net.0", "net.2"
    pre = KFACPreconditioner(module, lr=lambda s: opt.param_groups[0]["lr"], **kfac_kwargs)
    x, y = data()
    for i in range(steps):
        opt.zero_grad()
        F.cross_entropy(module(x[8 * i:8 * i + 8]), y[8 * i:8 * i + 8]).backward()
        pre.step()
        opt.step()
    return module.net, pre


def fit_fails(ckpt_path, **kfac_kwargs):
    """fit(ckpt_path=...) that must fail: the error, and proof that nothing was restored."""
    model = Tiny()
    before = params(model)
    cb = KFAC(**KW, **kfac_kwargs)
    t = trainer(max_epochs=2, callbacks=[cb])
    with pytest.raises(Exception) as err:  # noqa: B017 - torch.load's error type depends on where the file ends
        t.fit(model, ckpt_path=ckpt_path)
    assert same(params(model), before), "model weights were (partly) restored"
    assert t.global_step == 0 and t.current_epoch == 0
    assert cb.preconditioner is None  # released on the exception: no hook left on the model
    assert all(not m._forward_hooks for m in model.modules())
    state = cb.state_dict()
    assert state["steps"] == 0 and state["layers"] == {}  # K-FAC loaded nothing either
    return err.value


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_checkpoint_fails_before_anything_is_restored(checkpoints, tmp_path, keep):
    raw = (checkpoints / "kfac.ckpt").read_bytes()
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(raw[: int(len(raw) * keep)])
    err = fit_fails(cut)
    # torch.load raises (OSError / RuntimeError / ValueError, depending on where the file ends);
    # on Python >= 3.11 the callback adds a note saying what it means.
    assert not isinstance(err, AssertionError)
    if sys.version_info >= (3, 11):
        assert any("a truncated or corrupt file?" in n for n in getattr(err, "__notes__", []))


def test_checkpoint_of_a_model_with_other_kfac_layers_is_refused_then_skipped(checkpoints):
    ckpt = checkpoints / "kfac.ckpt"
    # The model is the same, but this run leaves 'net.2' to the optimizer alone: the saved K-FAC
    # state has a layer this one does not.
    err = fit_fails(ckpt, skip_layers="net.2")
    assert isinstance(err, ValueError)
    msg = str(err)
    assert f"checkpoint {ckpt}: K-FAC state does not match this model (1 problem)" in msg
    assert "unexpected layer 'net.2': in the state, not a K-FAC layer of this model" in msg
    assert 'KFAC(load_state="skip")' in msg

    # With load_state="skip": one warning, K-FAC starts fresh, the weights/optimizer/loops load.
    model = Tiny()
    cb = KFAC(**KW, skip_layers="net.2", load_state="skip")
    t = trainer(max_epochs=2, callbacks=[cb])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        t.fit(model, ckpt_path=ckpt)
    assert len(kfac_warnings(record)) == 1, kfac_warnings(record)
    assert "load_state='skip'" in kfac_warnings(record)[0] and "(saved at K-FAC step 4)" in kfac_warnings(record)[0]
    assert t.global_step == 8  # training went on from step 4
    assert cb.state_dict()["steps"] == 4  # K-FAC from 0: the 4 steps of epoch 2
    ref, ref_pre = continue_by_hand(ckpt, dict(KW, skip_layers="net.2"))
    for a, b in zip(model.net.parameters(), ref.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cb.state_dict()["layers"]["net.0"]["A"], ref_pre.layers["net.0"].A)


def test_checkpoint_of_a_model_with_other_shapes_is_refused_before_the_weights_load(checkpoints):
    class Wide(Tiny):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))

    model = Wide()
    before = params(model)
    cb = KFAC(**KW)
    with pytest.raises(ValueError) as err:
        trainer(max_epochs=2, callbacks=[cb]).fit(model, ckpt_path=checkpoints / "kfac.ckpt")
    msg = str(err.value)
    # K-FAC's check runs first (Lightning's own weight loading would fail too, later)
    assert "'net.0': factor shapes (7, 7), (8, 8); this model needs (7, 7), (10, 10)" in msg
    assert "'net.2': factor shapes (9, 9), (3, 3); this model needs (11, 11), (3, 3)" in msg
    assert same(params(model), before)


def test_corrupt_kfac_state_in_a_lightning_checkpoint(checkpoints, tmp_path):
    ckpt = torch.load(checkpoints / "kfac.ckpt", weights_only=False)
    ckpt["callbacks"]["KFAC"]["layers"]["net.2"]["G"][0, 1] = float("nan")
    bad = tmp_path / "nan.ckpt"
    torch.save(ckpt, bad)
    err = fit_fails(bad)
    assert isinstance(err, ValueError) and "layer 'net.2': G has non-finite values" in str(err)
    # skipping the K-FAC state: the fit resumes (weights, optimizer, loops from the file)
    model = Tiny()
    cb = KFAC(**KW, load_state="skip")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        t = trainer(max_epochs=2, callbacks=[cb])
        t.fit(model, ckpt_path=bad)
    assert len(kfac_warnings(record)) == 1 and t.global_step == 8 and cb.state_dict()["steps"] == 4
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_checkpoint_without_kfac_state_starts_kfac_fresh_with_one_warning(checkpoints):
    ckpt = checkpoints / "sgd.ckpt"
    assert "KFAC" not in torch.load(ckpt, weights_only=False)["callbacks"]
    model = Tiny()
    cb = KFAC(**KW)
    t = trainer(max_epochs=2, callbacks=[cb])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        t.fit(model, ckpt_path=ckpt)
    msgs = kfac_warnings(record)
    assert len(msgs) == 1, msgs
    assert f"checkpoint {ckpt} has no K-FAC state (saved by a run without the KFAC callback" in msgs[0]
    assert "K-FAC starts fresh" in msgs[0]
    assert t.global_step == 8 and cb.state_dict()["steps"] == 4
    ref, ref_pre = continue_by_hand(ckpt, KW)
    for a, b in zip(model.net.parameters(), ref.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
    for name in ("net.0", "net.2"):
        torch.testing.assert_close(cb.state_dict()["layers"][name]["G"], ref_pre.layers[name].G)


def test_load_state_argument_is_checked_and_skip_ignores_direct_loads():
    with pytest.raises(ValueError, match="load_state must be one of 'strict', 'skip'"):
        KFAC(load_state="lenient")
    cb = KFAC(load_state="skip")
    with pytest.warns(UserWarning, match="ignores the K-FAC state passed to load_state_dict"):
        cb.load_state_dict({"version": STATE_VERSION, "steps": 3, "layers": {}, "layer_dims": {}})
    assert cb.state_dict() == {}


def test_fault_counters_survive_a_state_round_trip():
    """skipped/fallback counters and the current bad streak are saved, so max_bad_steps counts a streak
    that spans a checkpoint; states without them (older ones) load as zeros; a bad counter is refused."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    pre = KFACPreconditioner(model, kl_clip=None)
    model(torch.randn(4, 3)).sum().backward()
    pre.step()
    pre.skipped_factor_steps, pre.skipped_precondition_steps = 3, 2
    pre.consecutive_bad_steps, pre.inverse_fallbacks = 2, 5
    state = pre.state_dict()
    other = KFACPreconditioner(nn.Linear(3, 2), kl_clip=None)
    other.load_state_dict(state)
    assert (other.skipped_factor_steps, other.skipped_precondition_steps,
            other.consecutive_bad_steps, other.inverse_fallbacks) == (3, 2, 2, 5)
    old = {k: v for k, v in state.items() if k not in ("skipped_precondition_steps", "consecutive_bad_steps",
                                                       "inverse_fallbacks")}
    fresh = KFACPreconditioner(nn.Linear(3, 2), kl_clip=None)
    fresh.load_state_dict(old)
    assert (fresh.consecutive_bad_steps, fresh.inverse_fallbacks) == (0, 0)
    with pytest.raises(ValueError, match="consecutive_bad_steps"):
        fresh.load_state_dict({**state, "consecutive_bad_steps": -1})
