"""Model setups that K-FAC used to crash on or get silently wrong, each checked from the user's side.

- ``channels_last`` convolutions (and a Linear whose weight is stored column-major): their gradients are
  not contiguous; a channels_last model trains exactly like the same model in the contiguous format.
- Activation checkpointing with a training-mode pass under ``torch.no_grad()`` in the same step
  (pseudo-labels, EMA-style targets): every call is counted once; the run equals one without checkpointing.
- One Parameter in two modules: modules sharing all their parameters are one K-FAC block, equal to one
  module called twice (and to a dense reference for convolutions of different strides); any other sharing
  is skipped with one warning naming the modules, and those gradients reach the optimizer untouched.
- A trainable layer inside a submodule kept in ``eval()`` (a frozen-BatchNorm backbone) is preconditioned
  like the same layer in training mode; validation inside fit (inference_mode or no_grad) adds nothing,
  nor does an evaluation forward with grad enabled that is never back-propagated.
- ``weight_norm`` / ``spectral_norm`` layers (parametrizations and the old hooks): skipped at setup with one
  warning each, their gradients untouched.
- A layer put into the model after the preconditioner was built: one RuntimeError naming it; a layer frozen
  at setup that trains later: one warning naming it.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import pytorch_lightning as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers.checkpointed import Checkpointed
from helpers.dense_reference import a_rows, assert_close, d_rows, damped_invs, grad_matrix
from helpers.lightning_models import trainer
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from lightning_spdkfac import KFAC, KFACPreconditioner
from lightning_spdkfac.comm.scheduler import SPDDistributor, SPDOptions
from lightning_spdkfac.multiprocess import run_distributed

DAMPING = 0.05


def kfac(model, **kw):
    """Factors and inverses every step (not the defaults, 5 and 50): runs are compared step by step."""
    kw = {"factor_decay": 0.5, "damping": DAMPING, "factor_update_steps": 1, "inv_update_steps": 1, "lr": 0.1,
          **kw}
    return KFACPreconditioner(model, **kw)


def kfac_warnings(record):
    return [str(w.message) for w in record if "K-FAC" in str(w.message)]


def assert_same(got, ref, atol):
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=atol)


def batches(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


# --------------------------------------------------------------------------- channels_last
class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.c1 = nn.Conv2d(3, 6, 3, padding=1)
        self.c2 = nn.Conv2d(6, 6, 3, stride=2)  # no padding
        self.c3 = nn.Conv2d(6, 5, 3, padding="same", padding_mode="reflect", dilation=2, bias=False)
        self.c4 = nn.Conv2d(5, 4, 1)
        self.fc = nn.Linear(4, 3)
        # stored column-major: the Linear's gradient is not contiguous either
        self.fc.weight = nn.Parameter(self.fc.weight.detach().t().contiguous().t())

    def forward(self, x):
        for conv in (self.c1, self.c2, self.c3, self.c4):
            x = torch.tanh(conv(x))
        # (B, H, W, C): contiguous for a channels_last x, a strided view for a contiguous one
        return self.fc(x.permute(0, 2, 3, 1)).mean((1, 2))


@pytest.mark.parametrize("factor_approx", ["expand", "reduce"])
def test_channels_last_cnn_trains_like_the_contiguous_one(factor_approx):
    runs = []
    for fmt in (torch.contiguous_format, torch.channels_last):
        model = CNN().to(memory_format=fmt)
        pre = kfac(model, factor_approx=factor_approx, kl_clip=1e-2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            x = torch.randn(4, 3, 10, 10, generator=g).contiguous(memory_format=fmt)
            y = torch.randint(0, 3, (4,), generator=g)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            if fmt == torch.channels_last:  # the premise: the gradients that used to crash the step
                assert not model.c1.weight.grad.is_contiguous() and not model.fc.weight.grad.is_contiguous()
            pre.step()
            opt.step()
        assert model.c1.weight.is_contiguous(memory_format=fmt)
        runs.append((model, pre))
    (plain, p_plain), (cl, p_cl) = runs
    assert_same(cl.parameters(), plain.parameters(), atol=1e-5)
    for name, layer in p_plain.layers.items():
        assert_same([p_cl.layers[name].A, p_cl.layers[name].G], [layer.A, layer.G], atol=1e-5)
    assert not torch.allclose(plain.c1.weight, CNN().c1.weight)  # it trained


# --------------------------------------------------------------------------- checkpointing + no_grad passes
def train_with_no_grad_passes(mode, steps=3, micro_batches=2, ddp=None, distributor=None, seed=6):
    """Each micro-batch: soft pseudo-labels from a training-mode pass under no_grad, then the loss; after the
    backward passes, one more no_grad pass (as an EMA-target or logging pass would)."""
    model = Checkpointed(mode)
    net = model if ddp is None else ddp(model)
    pre = kfac(model, distributor=distributor)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "3 forward call(s) but 2 backward call(s)" must not happen
        # torch's own note on reentrant checkpointing under no_grad (nothing to differentiate there)
        warnings.filterwarnings("ignore", "None of the inputs have requires_grad")
        for _ in range(steps):
            opt.zero_grad()
            for mb in range(micro_batches):
                pre.final_micro_batch = mb == micro_batches - 1
                x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
                with torch.no_grad():
                    soft = model(x).softmax(1)
                sync = ddp is None or pre.final_micro_batch
                with contextlib.nullcontext() if sync else net.no_sync():
                    out = net(x)
                    loss = F.cross_entropy(out, y) + F.cross_entropy(out, soft)
                    (loss / micro_batches).backward()
            with torch.no_grad():
                model(torch.randn(8, 6, generator=g))
            pre.step()
            opt.step()
    return model, pre


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpointing_with_no_grad_training_passes_counts_each_call_once(use_reentrant):
    plain, p_plain = train_with_no_grad_passes(None)
    ckpt, p_ckpt = train_with_no_grad_passes(use_reentrant)
    for name, lp in p_plain.layers.items():
        lc = p_ckpt.layers[name]
        assert lc.A is not None, f"{name} never got factors"
        assert_same([lc.A, lc.G], [lp.A, lp.G], atol=1e-6)
        assert lc.calls_per_micro_batch == lp.calls_per_micro_batch == (2 if name == "block.b" else 1)
    assert_same(ckpt.parameters(), plain.parameters(), atol=1e-6)
    assert p_ckpt.skipped_factor_steps == 0 and p_ckpt.steps == 3


def _no_grad_passes_on_ranks(rank, world):
    """Per rank, under DDP and pipelined SPD-KFAC: the plain, non-reentrant and reentrant checkpointed runs."""
    torch.set_num_threads(1)
    out = {}
    for mode in (None, False, True):
        distributor = SPDDistributor(SPDOptions.from_schedule("spd", profile_steps=(1, 2)),
                                     process_group=dist.new_group())
        model, pre = train_with_no_grad_passes(mode, steps=5, ddp=DDP, distributor=distributor, seed=10 + rank)
        assert distributor.pipelined  # steps 0-2 profile (factors held to step()), steps 3-4 pipelined
        out[mode] = ({n: (ly.A.clone(), ly.G.clone()) for n, ly in pre.layers.items()},
                     [p.detach().clone() for p in model.parameters()])
    return out


def test_checkpointing_with_no_grad_passes_on_two_ranks_with_pipelined_spd():
    runs = run_distributed(_no_grad_passes_on_ranks, 2, timeout=180)
    for out in runs:
        plain_f, plain_p = out[None]
        for mode in (False, True):
            factors, params = out[mode]
            for name, (A, G) in plain_f.items():
                assert_same(factors[name], [A, G], atol=1e-6)
            assert_same(params, plain_p, atol=1e-6)
    for mode in (False, True):
        assert all(torch.equal(a, b) for a, b in zip(runs[0][mode][1], runs[1][mode][1]))  # the replicas agree


# --------------------------------------------------------------------------- shared parameters
class TwoLinears(nn.Module):
    """``a`` then ``second``: a module sharing a's weight and bias (tied=True), or ``a`` itself again."""

    def __init__(self, tied):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, 5)
        self.a = nn.Linear(5, 5)
        self.head = nn.Linear(5, 3)
        self.tied = tied
        if tied:
            self.b = nn.Linear(5, 5)
            self.b.weight, self.b.bias = self.a.weight, self.a.bias

    def forward(self, x):
        h = torch.tanh(self.a(torch.tanh(self.inp(x))))
        return self.head(torch.tanh((self.b if self.tied else self.a)(h)))


def test_modules_sharing_all_parameters_train_like_one_module_called_twice():
    runs = []
    for tied in (True, False):
        model = TwoLinears(tied)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing to warn about: the shared block is supported
            pre = kfac(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            g = torch.Generator().manual_seed(3)
            for micro_batches in (1, 2, 1):
                opt.zero_grad()
                for _ in range(micro_batches):
                    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
                    (F.cross_entropy(model(x), y) / micro_batches).backward()
                pre.step()
                opt.step()
        runs.append((model, pre))
    (tied, p_tied), (twice, p_twice) = runs
    assert list(p_tied.layers) == list(p_twice.layers) == ["inp", "a", "head"]  # one block for a and b
    assert p_tied.layers["a"].calls_per_micro_batch == 2
    for name in p_twice.layers:
        assert_same([p_tied.layers[name].A, p_tied.layers[name].G],
                    [p_twice.layers[name].A, p_twice.layers[name].G], atol=1e-6)
    assert_same([tied.inp.weight, tied.a.weight, tied.a.bias, tied.head.weight],
                [twice.inp.weight, twice.a.weight, twice.a.bias, twice.head.weight], atol=1e-6)
    assert tied.b.weight is tied.a.weight


def test_convolutions_sharing_parameters_with_other_strides_match_the_dense_reference():
    torch.manual_seed(0)
    fine, coarse = nn.Conv2d(2, 3, 3, padding=1), nn.Conv2d(2, 3, 3, stride=2)
    coarse.weight, coarse.bias = fine.weight, fine.bias
    model = nn.ModuleDict({"fine": fine, "coarse": coarse})
    pre = kfac(model, kl_clip=None, factor_approx="expand")
    assert list(pre.layers) == ["fine"]
    inputs, gouts = [], []

    def capture(module, args, out):
        inputs.append((module, args[0].detach()))
        out.register_hook(lambda g: gouts.append((module, g.detach())))

    for m in (fine, coarse):
        m.register_forward_hook(capture)
    img = torch.randn(4, 2, 7, 7, generator=torch.Generator().manual_seed(4))
    (fine(img).pow(2).mean() + coarse(img).tanh().sum((2, 3)).pow(2).mean()).backward()
    raw = grad_matrix(fine)  # the shared parameters' gradient: both modules' parts
    pre.step()
    a = torch.cat([a_rows(m, x) for m, x in inputs])
    d = torch.cat([d_rows(m, g) for m, g in gouts])
    A, G = a.T @ a / a.shape[0], 4 * (d.T @ d)  # the 4 images counted once, like one layer called twice
    layer = pre.layers["fine"]
    assert_close(layer.A, A, 1e-5)
    assert_close(layer.G, G, 1e-5)
    A_inv, G_inv = damped_invs(A, G, DAMPING)
    assert_close(grad_matrix(fine), G_inv @ raw @ A_inv, 1e-4)


def _weight_only(model):
    model.b = nn.Linear(5, 5)
    model.b.weight = model.a.weight
    return ["a", "b"], "some but not all"


def _bias_only(model):
    model.b = nn.Linear(5, 5)
    model.b.bias = model.a.bias
    return ["a", "b"], "some but not all"


def _held_elsewhere(model):
    model.holder = nn.Module()
    model.holder.w = model.head.weight  # a module K-FAC does not handle uses it (a tied embedding: test_layer_coverage)
    return ["head"], "'holder' (Module)"


def _skipped_twin(model):
    model.b = nn.Linear(5, 5)
    model.b.weight, model.b.bias = model.a.weight, model.a.bias
    return ["a"], "'b' (Linear)"


@pytest.mark.parametrize("share", [_weight_only, _bias_only, _held_elsewhere, _skipped_twin])
def test_other_parameter_sharing_is_skipped_with_one_warning_and_left_untouched(share):
    model = TwoLinears(False)
    names, reason = share(model)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        pre = kfac(model, skip_layers=["^b$"] if share is _skipped_twin else [])
    msgs = kfac_warnings(record)
    assert len(msgs) == 1 and reason in msgs[0] and all(repr(n) in msgs[0] for n in names), msgs
    assert not set(names) & set(pre.layers) and all(n in pre.skipped for n in names)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(5))
    out = model(x) + (model.b(x[:, :5]).sum() if hasattr(model, "b") else 0)
    if hasattr(model, "holder"):
        out = out + model.holder.w.sum()
    out.pow(2).mean().backward()
    skipped = [p for n in names for p in getattr(model, n).parameters()]
    raw = [p.grad.clone() for p in skipped]
    other = [p for n in pre.layers for p in getattr(model, n).parameters()]
    raw_other = [p.grad.clone() for p in other]
    pre.step()
    assert all(torch.equal(p.grad, r) for p, r in zip(skipped, raw))  # the optimizer gets them untouched
    assert not any(torch.equal(p.grad, r) for p, r in zip(other, raw_other))  # the others: preconditioned


# --------------------------------------------------------------------------- eval-mode submodules
class FrozenNormBackbone(pl.LightningModule):
    """A backbone whose BatchNorm keeps its (pretrained) running statistics: ``eval_whole_backbone`` puts the
    whole backbone in eval mode (the usual ``backbone.eval()``), otherwise only the BatchNorm; the forward is
    the same, and so must training be."""

    def __init__(self, eval_whole_backbone):
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh())
        self.head = nn.Linear(8, 3)
        with torch.no_grad():
            self.backbone[1].running_mean.uniform_(-0.5, 0.5)
            self.backbone[1].running_var.uniform_(0.5, 2.0)
        self.eval_whole_backbone = eval_whole_backbone
        self.linear_modes = set()  # backbone[0].training in each training step

    def on_train_epoch_start(self):  # (Lightning restores these modes after each validation)
        (self.backbone if self.eval_whole_backbone else self.backbone[1]).eval()

    def forward(self, x):
        return self.head(self.backbone(x))

    def training_step(self, batch, _):
        self.linear_modes.add(self.backbone[0].training)
        return F.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch, _):
        self.log("val_loss", F.cross_entropy(self(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(TensorDataset(*map(torch.cat, zip(*batches()))), batch_size=8)

    def val_dataloader(self):
        return DataLoader(TensorDataset(*map(torch.cat, zip(*batches(2, seed=1)))), batch_size=8)


def fit_backbone(eval_whole_backbone, validate=False, inference_mode=True, **kfac_kw):
    model = FrozenNormBackbone(eval_whole_backbone)
    callback = KFAC(damping=DAMPING, factor_update_steps=1, inv_update_steps=1, **kfac_kw)
    extra = dict(val_check_interval=2, num_sanity_val_steps=1) if validate else dict(limit_val_batches=0)
    trainer(max_steps=4, callbacks=[callback], inference_mode=inference_mode, **extra).fit(model)
    return model, callback.state_dict()


@pytest.mark.parametrize("inference_mode", [True, False])
def test_trainable_layer_in_an_eval_mode_backbone_is_preconditioned_and_validation_adds_nothing(inference_mode):
    evaluated, state = fit_backbone(True, validate=True, inference_mode=inference_mode)
    reference, ref_state = fit_backbone(False)
    assert evaluated.linear_modes == {False} and reference.linear_modes == {True}  # the premise
    assert_same(evaluated.parameters(), reference.parameters(), atol=1e-6)
    assert set(state["layers"]) == set(ref_state["layers"]) == {"backbone.0", "head"}
    for name, factors in ref_state["layers"].items():
        for key, ref in factors.items():
            if isinstance(ref, torch.Tensor):
                assert_same([state["layers"][name][key]], [ref], atol=1e-6)
    # and K-FAC did act on it: without K-FAC on the backbone, training ends elsewhere
    unpreconditioned, _ = fit_backbone(False, skip_layers=["backbone"])
    assert not torch.allclose(unpreconditioned.backbone[0].weight, reference.backbone[0].weight, atol=1e-4)


def test_an_eval_forward_with_grad_enabled_that_is_not_back_propagated_adds_nothing():
    runs = []
    for evaluate in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        pre = kfac(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for x, y in batches():
                if evaluate:  # an evaluation written without no_grad
                    model.eval()
                    F.cross_entropy(model(x), y).item()
                    model.train()
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                pre.step()
                opt.step()
        runs.append((model, pre))
    (plain, p_plain), (evaluated, p_eval) = runs
    assert torch.equal(p_eval.layers["0"].A, p_plain.layers["0"].A)
    assert_same(evaluated.parameters(), plain.parameters(), atol=0)


# --------------------------------------------------------------------------- weight_norm / spectral_norm
def normed_model():
    torch.manual_seed(0)
    P = torch.nn.utils.parametrizations
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.nn.utils.weight_norm is deprecated
        old_wn = torch.nn.utils.weight_norm(nn.Linear(8, 8))
    return nn.Sequential(
        nn.Linear(6, 8), nn.Tanh(),
        P.weight_norm(nn.Linear(8, 8)), nn.Tanh(),
        P.spectral_norm(nn.Linear(8, 8)), nn.Tanh(),
        old_wn, nn.Tanh(),
        torch.nn.utils.spectral_norm(nn.Linear(8, 8)), nn.Tanh(),
        nn.Linear(8, 3),
    )


def test_weight_norm_and_spectral_norm_layers_are_skipped_with_one_warning_each():
    model = normed_model()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        pre = kfac(model)
    msgs = kfac_warnings(record)
    normed = ["2", "4", "6", "8"]
    assert len(msgs) == 4
    for name, msg, how in zip(normed, msgs, ["_WeightNorm", "_SpectralNorm", "WeightNorm", "SpectralNorm"]):
        assert f"'{name}'" in msg and "computed from other parameters" in msg and how in msg, msg
    assert list(pre.layers) == ["0", "10"]  # no factor work is spent on the others
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "The .grad attribute of a Tensor that is not a leaf"
        for x, y in batches(2):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            skipped = [p for n in normed for p in model[int(n)].parameters()]
            raw = [p.grad.clone() for p in skipped]
            pre.step()
            assert all(torch.equal(p.grad, r) for p, r in zip(skipped, raw))
            opt.step()
    assert pre.layers["0"].A is not None and pre.layers["10"].A is not None


# --------------------------------------------------------------------------- layers changed after setup
def test_a_layer_replaced_after_the_preconditioner_was_built_fails_naming_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    pre = kfac(model)
    x, y = batches(1)[0]
    F.cross_entropy(model(x), y).backward()
    pre.step()
    model[2] = nn.Linear(8, 3)  # e.g. a new head for fine-tuning
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match=r"layer\(s\) '2' joined the model after the KFACPreconditioner was "
                                           r"built.*Build the preconditioner once the model is final"):
        pre.step()


def test_layers_added_after_setup_that_do_not_train_are_fine():
    torch.manual_seed(0)
    model = nn.Module()
    model.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    pre = kfac(model)
    model.teacher = copy.deepcopy(model.net)  # used only under no_grad: its parameters get no gradient
    model.frozen = nn.Linear(3, 3).requires_grad_(False)
    model.net[1] = nn.Identity()  # a registered module replaced by a kind K-FAC does not handle
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for x, _ in batches(2):
            model.zero_grad()
            with torch.no_grad():
                target = model.teacher(x).softmax(1)
            F.cross_entropy(model.frozen(model.net(x)), target).backward()
            pre.step()
    assert pre.layers["net.0"].A is not None


class ChangesItsHead(pl.LightningModule):
    """Puts a new head in place during fit (``on_train_start``), or creates its head in ``configure_model``
    (which Lightning calls after the callbacks' ``setup``, where KFAC builds its preconditioner)."""

    def __init__(self, hook):
        super().__init__()
        torch.manual_seed(0)
        self.hook = hook
        self.body = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3) if hook == "on_train_start" else None

    def on_train_start(self):
        if self.hook == "on_train_start":
            self.head = nn.Linear(8, 3)

    def configure_model(self):
        if self.hook == "configure_model" and self.head is None:
            self.head = nn.Linear(8, 3)

    def training_step(self, batch, _):
        return F.cross_entropy(self.head(torch.tanh(self.body(batch[0]))), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(*map(torch.cat, zip(*batches()))), batch_size=8)


@pytest.mark.parametrize("hook", ["on_train_start"])  # (configure_model layers get K-FAC: test_lifecycle.py)
def test_a_lightning_module_changing_a_layer_after_kfac_setup_gets_one_clear_error(hook):
    with pytest.raises(RuntimeError, match=r"'head' joined the model after the KFACPreconditioner was built"):
        trainer(max_steps=2, callbacks=[KFAC(factor_update_steps=1)]).fit(ChangesItsHead(hook))


def test_a_layer_frozen_at_setup_gets_kfac_once_unfrozen():
    """Frozen when the preconditioner is built (a fine-tuning warm-up): left alone while frozen, then
    preconditioned like a layer that was never frozen (its factors start when it first trains)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    ref = copy.deepcopy(model)
    model[0].requires_grad_(False)
    pre = kfac(model)
    data = batches(4)
    ref_pre = None
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for step, (x, y) in enumerate(data):
            if step == 2:  # unfrozen: from here on, a twin built now (from the same weights) is the reference
                model[0].requires_grad_(True)
                ref.load_state_dict(model.state_dict())
                ref_pre = kfac(ref)
                ref_pre.steps = pre.steps
                for name, layer in ref_pre.layers.items():  # the head's factors carry over; layer 0 has none yet
                    # (nor is it registered yet: a layer frozen at setup is, when the model next runs with it trainable)
                    layer.A, layer.G = ((None, None) if name == "0"
                                        else (pre.layers[name].A.clone(), pre.layers[name].G.clone()))
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            frozen = model[0].weight.detach().clone()
            pre.step()
            if step < 2:
                assert model[0].weight.grad is None and torch.equal(model[0].weight, frozen)
            else:
                ref.zero_grad()
                F.cross_entropy(ref(x), y).backward()
                ref_pre.step()
                for a, b in zip(model.parameters(), ref.parameters()):
                    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)
                assert pre.layers["0"].A is not None  # collected and preconditioned
    assert not kfac_warnings(record), kfac_warnings(record)
