"""Lifecycle and setup faults from the user's side (issue 15, items 3, 4, 11, 12).

- Several fits: a second ``Trainer.fit`` on the same Trainer (or a new Trainer with the same callback and
  model) continues K-FAC where the first fit ended; a fit with ``ckpt_path`` takes the checkpoint's state.
- Layers built in ``LightningModule.configure_model()`` get K-FAC like layers built in ``__init__``, on one
  process and on 2 ranks; a layer still lazy at fit start is refused by name.
- A strategy argument error in a YAML config reads as one line, exit 2 (the ``spdkfac`` command).
- A layer that sees an empty input contributes nothing that step, quietly; a real call mismatch still warns.
- A checkpoint holding finite but impossible factors or inverses is refused, naming the layer and tensor.

References are independent runs: one uninterrupted fit, the model built in ``__init__``, a model that does
not call the layer at all, an untouched checkpoint.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers.lightning_models import KW, Tiny, TinyInterleaved, trainer
from helpers.processes import clean_env
from torch import nn

from lightning_spdkfac import KFAC, KFACPreconditioner, SPDKFACStrategy
from lightning_spdkfac.multiprocess import run_distributed

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*GPU available but not used.*")
warnings.filterwarnings("ignore", ".*max_steps=.* reached.*")

REPO = Path(__file__).resolve().parents[1]


class Plain(Tiny):
    """Tiny with stateless SGD (Lightning re-creates the optimizer at every fit: no momentum to lose), 48
    samples in batches of 8: a fit of 6 steps ends exactly at an epoch boundary."""

    def __init__(self, **kw):
        super().__init__(n=48, **kw)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def kfac_tensors(state):
    return {(name, k): t for name, layer in state["layers"].items() for k, t in layer.items() if t is not None}


def assert_same_run(model_a, cb_a, model_b, cb_b):
    for a, b in zip(params(model_a), params(model_b)):
        assert torch.equal(a, b)
    sa, sb = cb_a.state_dict(), cb_b.state_dict()
    assert sa["steps"] == sb["steps"]
    ta, tb = kfac_tensors(sa), kfac_tensors(sb)
    assert ta.keys() == tb.keys() and len(ta) == 8  # 2 layers x A, G, A_inv, G_inv
    for key in ta:
        assert torch.equal(ta[key], tb[key]), key


def one_fit(steps, model=None, **kfac):
    model = model or Plain()
    cb = KFAC(**KW, **kfac)
    trainer(max_steps=steps, callbacks=[cb]).fit(model)
    return model, cb


# ----------------------------------------------------------------------------------------- item 3
def test_a_second_fit_on_the_same_trainer_continues_kfac_exactly():
    model, cb = Plain(), KFAC(**KW)
    t = trainer(max_steps=6, callbacks=[cb])
    t.fit(model)
    assert cb.state_dict()["steps"] == 6
    t.fit_loop.epoch_loop.max_steps = 12
    t.fit(model)
    assert t.global_step == 12
    ref_model, ref_cb = one_fit(12)
    assert_same_run(model, cb, ref_model, ref_cb)


def test_a_new_trainer_with_the_same_callback_and_model_warm_starts_kfac():
    # The notebook pattern: the K-FAC state continues (like the weights do), the new Trainer counts from 0.
    model, cb = Plain(), KFAC(**KW)
    trainer(max_steps=6, callbacks=[cb]).fit(model)
    t = trainer(max_steps=6, callbacks=[cb])
    t.fit(model)
    assert t.global_step == 6 and cb.state_dict()["steps"] == 12
    ref_model, ref_cb = one_fit(12)
    assert_same_run(model, cb, ref_model, ref_cb)


def test_another_model_with_the_same_callback_starts_kfac_fresh():
    cb = KFAC(**KW)
    trainer(max_steps=6, callbacks=[cb]).fit(Plain())
    model = Plain()
    trainer(max_steps=6, callbacks=[cb]).fit(model)
    ref_model, ref_cb = one_fit(6)
    assert_same_run(model, cb, ref_model, ref_cb)


def test_a_fit_with_ckpt_path_takes_the_checkpoints_kfac_state_not_the_previous_fits(tmp_path):
    # (max_epochs: Lightning resumes a checkpoint saved at the end of a max_steps fit an epoch late)
    model, cb = Plain(), KFAC(**KW)
    t = trainer(max_epochs=1, callbacks=[cb])
    t.fit(model)
    t.save_checkpoint(tmp_path / "six.ckpt")
    t.fit_loop.max_epochs = 2
    t.fit(model)  # K-FAC at step 12 now
    t.fit(model, ckpt_path=tmp_path / "six.ckpt")  # back to step 6 (weights and K-FAC), on to 12
    assert t.global_step == 12
    ref_model, ref_cb = one_fit(12)
    assert_same_run(model, cb, ref_model, ref_cb)


# ----------------------------------------------------------------------------------------- item 4
class BuiltInConfigureModel(Plain):
    """The layers of Plain, created in configure_model (Lightning's hook for large models), same init."""

    def __init__(self, **kw):
        super().__init__(**kw)
        del self.net
        self.net = None

    def configure_model(self):
        if self.net is not None:
            return
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def test_layers_built_in_configure_model_get_kfac_like_layers_built_in_init():
    model, cb = one_fit(6, BuiltInConfigureModel())
    ref_model, ref_cb = one_fit(6)
    assert set(cb.state_dict()["layers"]) == {"net.0", "net.2"}
    for a, b in zip(params(model), params(ref_model)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    ta, tb = kfac_tensors(cb.state_dict()), kfac_tensors(ref_cb.state_dict())
    assert ta.keys() == tb.keys()
    for key in ta:
        torch.testing.assert_close(ta[key], tb[key], rtol=1e-6, atol=1e-6)


def test_some_layers_built_in_configure_model_get_kfac_too():
    class Partly(Plain):
        def __init__(self):
            super().__init__()
            self.extra = None

        def configure_model(self):
            if self.extra is None:
                self.extra = nn.Linear(3, 3)

        def forward(self, x):
            return self.extra(self.net(x))

    model, cb = one_fit(3, Partly())
    assert set(cb.state_dict()["layers"]) == {"net.0", "net.2", "extra"}


class InterleavedInConfigureModel(TinyInterleaved):
    def __init__(self, **kw):
        super().__init__(**kw)
        del self.net
        self.net = None

    def configure_model(self):
        if self.net is None:
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _fit_two_ranks(rank, world, in_configure_model):
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    model = InterleavedInConfigureModel(batch_size=4) if in_configure_model else TinyInterleaved(batch_size=4)
    cb = KFAC(**KW)
    t = trainer(max_steps=4, devices=world, strategy=SPDKFACStrategy(schedule="spd", profile_steps=(1, 2)),
                callbacks=[cb], use_distributed_sampler=False)
    t.fit(model)
    return params(model), sorted(cb.state_dict()["layers"])


@pytest.mark.slow  # two gloo ranks through Lightning, 16 s: in make test-slow (CI runs it) to keep make test under 10 min
def test_layers_built_in_configure_model_get_kfac_on_two_ranks():
    built = run_distributed(_fit_two_ranks, 2, True, timeout=120)
    ref = run_distributed(_fit_two_ranks, 2, False, timeout=120)
    assert built[0][1] == built[1][1] == ["net.0", "net.2"]
    for a, b in zip(built[0][0], built[1][0]):
        assert torch.equal(a, b)  # replicas agree
    for a, b in zip(built[0][0], ref[0][0]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_a_layer_still_lazy_at_fit_start_is_refused_by_name():
    class Lazy(Plain):
        def __init__(self):
            super().__init__()
            self.net[2] = nn.LazyLinear(3)

    model = Lazy()
    with pytest.raises(ValueError, match=r"net\.2 \(LazyLinear\).*run one forward pass.*configure_model"):
        trainer(max_steps=1, callbacks=[KFAC(**KW)]).fit(model)
    assert all(not m._forward_hooks for m in model.modules())


# ----------------------------------------------------------------------------------------- item 11
CONFIG = """\
trainer:
  accelerator: cpu
  devices: 1
  logger: false
  enable_progress_bar: false
  max_steps: 1
  strategy:
    class_path: {strategy}
    init_args:
{strategy_args}
  callbacks:
    - class_path: lightning_spdkfac.KFAC
model:
  class_path: lightning_spdkfac.demo.DigitsCNN
data:
  class_path: lightning_spdkfac.demo.DigitsDataModule
"""
DDP = "lightning_spdkfac.SPDKFACStrategy"
DEEPSPEED = "lightning_spdkfac.SPDKFACDeepSpeedStrategy"


YAML_ERRORS = [
    (DDP, "comm_timeout_s: 0", "ValueError: comm_timeout_s must be a number > 0, got 0.0"),
    (DDP, "profile_steps: [5, 3]", "ValueError: profile_steps must be two integers"),
    (DDP, "schedule: mpd\nreplan_every: 10", "ValueError: replan_every must be None unless pipelining=True"),
    (DEEPSPEED, "stage: 4", "ValueError: stage must be the ZeRO stage 0, 1, 2 or 3, got 4"),
]


@pytest.mark.slow
def test_a_strategy_argument_error_in_yaml_reads_as_one_line_with_exit_2(tmp_path):
    """Each bad strategy argument through the CLI (the runs at once: each is mostly imports)."""
    pytest.importorskip("deepspeed")
    env = clean_env()
    env["PYTHONPATH"] = str(REPO)  # this checkout's package, not an installed one
    procs = []
    for k, (strategy, strategy_args, _) in enumerate(YAML_ERRORS):
        config = tmp_path / f"config{k}.yaml"
        config.write_text(CONFIG.format(strategy=strategy, strategy_args=textwrap.indent(strategy_args, " " * 6)))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "lightning_spdkfac.cli", "fit", "--config", str(config),
             f"--trainer.default_root_dir={tmp_path / f'run{k}'}"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outcomes = [proc.communicate(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    for proc, (_, stderr), (_, strategy_args, message) in zip(procs, outcomes, YAML_ERRORS):
        assert proc.returncode == 2, (strategy_args, stderr[-3000:])
        lines = [ln for ln in stderr.splitlines() if ln.startswith("spdkfac: invalid configuration:")]
        assert len(lines) == 1 and message in lines[0], (strategy_args, stderr[-3000:])
        assert "Traceback" not in stderr and "Union subtypes" not in stderr


# ----------------------------------------------------------------------------------------- item 12 (a)
class Routed(nn.Module):
    """A body, a head, and an expert that sees only the rows ``route`` selects (none, on some steps)."""

    def __init__(self, call_expert_when_empty: bool):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head, self.expert = nn.Linear(6, 8), nn.Linear(8, 3), nn.Linear(8, 3)
        self.call_expert_when_empty = call_expert_when_empty

    def forward(self, x, route, use_expert=True):
        h = torch.tanh(self.body(x))
        out = self.head(h)
        if route.any() or self.call_expert_when_empty:
            e = self.expert(h[route])
            if use_expert:
                out = out.index_add(0, route.nonzero().flatten(), e)
        return out


def _routed_run(call_expert_when_empty, mismatch_step=None):
    model = Routed(call_expert_when_empty)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pre = KFACPreconditioner(model, lr=0.1, damping=0.01, factor_update_steps=1, inv_update_steps=1)
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(5):
            x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
            route = torch.zeros(8, dtype=torch.bool) if step in (1, 3) else torch.arange(8) % 2 == 0
            opt.zero_grad()
            F.cross_entropy(model(x, route, use_expert=step != mismatch_step), y).backward()
            pre.step()
            opt.step()
    calls = [str(w.message) for w in seen if "call(s)" in str(w.message)]
    return model, pre, calls


def test_a_layer_with_an_empty_input_contributes_nothing_that_step_quietly():
    model, pre, calls = _routed_run(call_expert_when_empty=True)
    ref_model, ref_pre, _ = _routed_run(call_expert_when_empty=False)  # the expert not called at all
    assert calls == []
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    ta, tb = kfac_tensors(pre.state_dict()), kfac_tensors(ref_pre.state_dict())
    assert ta.keys() == tb.keys() and ("expert", "A") in ta
    for key in ta:
        torch.testing.assert_close(ta[key], tb[key], rtol=1e-6, atol=1e-6)


def test_a_real_call_mismatch_still_warns_after_empty_steps():
    # Step 4: the expert runs on rows but its output is not used (no gradient): that is a real mismatch.
    _, _, calls = _routed_run(call_expert_when_empty=True, mismatch_step=4)
    assert len(calls) == 1, calls
    assert "'expert': 1 forward call(s) but 0 backward call(s)" in calls[0]


# ----------------------------------------------------------------------------------------- item 12 (b)
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints after 6 steps (an epoch) of Plain with K-FAC, for each inverse method."""
    tmp = tmp_path_factory.mktemp("lifecycle_ckpt")
    for method in ("cholesky", "eigen"):
        t = trainer(max_epochs=1, callbacks=[KFAC(**KW, inverse_method=method)])
        t.fit(Plain())
        t.save_checkpoint(tmp / f"{method}.ckpt")
    return tmp


def _negated(t):
    return -t


def _asymmetric(t):
    return t + torch.triu(torch.ones_like(t), 1) * t.abs().max()


def _negative_eigenvalue(t):
    t = t.clone()
    t[-1, 0] = -t[-1].abs().max() - 1.0
    return t


def _not_orthonormal(t):
    t = t.clone()
    t[:-1] = t[:-1] * 3.0 + 1.0
    return t


@pytest.mark.parametrize("method, layer, key, tamper, expected", [
    ("cholesky", "net.0", "A", _negated, r"layer 'net\.0': A has a negative diagonal entry"),
    ("cholesky", "net.2", "G", _asymmetric, r"layer 'net\.2': G is not symmetric"),
    ("cholesky", "net.2", "A_inv", _negated, r"layer 'net\.2': A_inv has a diagonal entry <= 0"),
    ("cholesky", "net.0", "G_inv", _asymmetric, r"layer 'net\.0': G_inv is not symmetric"),
    ("eigen", "net.0", "A_inv", _negative_eigenvalue, r"layer 'net\.0': A_inv \(an eigen payload\) has a negative "
                                                      r"eigenvalue"),
    ("eigen", "net.2", "G_inv", _not_orthonormal, r"layer 'net\.2': G_inv \(an eigen payload\) does not hold "
                                                  r"orthonormal eigenvectors"),
])
def test_a_checkpoint_with_impossible_factors_or_inverses_is_refused_naming_the_layer(
        saved, tmp_path, method, layer, key, tamper, expected):
    ckpt = torch.load(saved / f"{method}.ckpt", weights_only=False)
    entry = ckpt["callbacks"]["KFAC"]["layers"][layer]
    entry[key] = tamper(entry[key])
    torch.save(ckpt, tmp_path / "tampered.ckpt")
    model = Plain()
    before = params(model)
    t = trainer(max_epochs=2, callbacks=[KFAC(**KW, inverse_method=method)])
    with pytest.raises(ValueError, match=expected):
        t.fit(model, ckpt_path=tmp_path / "tampered.ckpt")
    assert all(torch.equal(a, b) for a, b in zip(params(model), before))  # nothing was restored
    assert t.global_step == 0


@pytest.mark.parametrize("method", ["cholesky", "eigen"])
def test_a_genuine_checkpoint_still_resumes_exactly(saved, method):
    model, cb = Plain(), KFAC(**KW, inverse_method=method)
    trainer(max_epochs=2, callbacks=[cb]).fit(model, ckpt_path=saved / f"{method}.ckpt")
    ref_model, ref_cb = one_fit(12, inverse_method=method)
    assert_same_run(model, cb, ref_model, ref_cb)
