"""SPDKFACDeepSpeedStrategy at ZeRO stage 3 on 2 gloo processes, on CPU: K-FAC under ZeRO-3 trains exactly as
under ZeRO-2 (the reference: the same seed, data and global batch at stage 2, whose gradient access is tested
against DDP in test_deepspeed.py), through the fused gather and through DeepSpeed's per-parameter accessor;
and what stage 3 refuses, by name."""

from __future__ import annotations

import os
import warnings

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

pytest.importorskip("deepspeed")

from helpers.lightning_models import KW, trainer  # noqa: E402

from lightning_spdkfac import KFAC, SPDKFACDeepSpeedStrategy  # noqa: E402
from lightning_spdkfac.multiprocess import run_distributed  # noqa: E402

STEPS = 7  # factors every step, inverses at steps 0, 3 and 6 (KW)


class TokenMLP(pl.LightningModule):
    """An Embedding, a Linear with a bias and 7 rows (uneven over 2 ranks: stage 3 pads the last slice), a Linear
    without one; rank r of W reads samples r, r+W, ... so that one step sees the same joint batch at any stage."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Embedding(11, 5), nn.Flatten(), nn.Linear(10, 7), nn.Tanh(),
                                 nn.Linear(7, 3, bias=False))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, _):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        ds = TensorDataset(torch.randint(0, 11, (64, 2), generator=g), torch.randint(0, 3, (64,), generator=g))
        return DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, shuffle=False))


class Access(pl.Callback):
    """Which gradient access the preconditioner got, and whether a Linear's weight is partitioned after the step."""

    def __init__(self, kfac):
        self.kfac, self.kind, self.partitioned_after_step = kfac, None, []

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.kind = type(self.kfac.preconditioner.grad_access).__name__
        if hasattr(pl_module.net[2].weight, "ds_id"):
            self.partitioned_after_step.append(str(pl_module.net[2].weight.ds_status))


def z3_fit(rank, world, steps, *, stage, fused=True, ckpt_dir=None, resume=None, precision="32-true", **strategy_kw):
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    model = TokenMLP()
    strategy = SPDKFACDeepSpeedStrategy(stage=stage, profile_steps=(1, 3), fused_grad_gather=fused,
                                        logging_batch_size_per_gpu=4, **strategy_kw)
    cb = KFAC(**KW)
    access = Access(cb)
    callbacks = [cb, access]
    if ckpt_dir:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=8, save_top_k=-1))
    t = trainer(max_steps=steps, devices=world, strategy=strategy, callbacks=callbacks,
                use_distributed_sampler=False, enable_checkpointing=bool(ckpt_dir), precision=precision)
    t.fit(model, ckpt_path=resume)
    params = list(model.net.parameters())
    if stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            full = [p.detach().float().clone() for p in params]
    else:
        full = [p.detach().float().clone() for p in params]
    return dict(params=full, access=access.kind, kfac_steps=cb.state_dict()["steps"],
                optimizer=type(t.strategy.deepspeed_engine.optimizer).__name__,
                status=sorted(set(access.partitioned_after_step)))


@pytest.fixture(scope="module")
def zero2():
    return run_distributed(z3_fit, 2, STEPS, stage=2, timeout=240)[0]


def _assert_same(a, b):
    for x, y in zip(a, b, strict=True):
        assert x.shape == y.shape
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_zero3_equals_zero2(zero2):  # (13 s with its ZeRO-2 reference on 2 idle cores; 30 s on busy ones)
    # No parameter persists between forwards (DeepSpeed keeps small ones, all of these by default, gathered): the
    # K-FAC step gathers them, and partitions them again.
    r = run_distributed(z3_fit, 2, STEPS, stage=3, config=PARTITIONED, timeout=240)[0]
    assert r["optimizer"] == "DeepSpeedZeroOptimizer_Stage3" and r["access"] == "DeepSpeedZero3GradAccess"
    assert zero2["access"] == "DeepSpeedGradAccess"
    assert r["kfac_steps"] == zero2["kfac_steps"] == STEPS
    assert r["status"] == ["ZeroParamStatus.NOT_AVAILABLE"]
    _assert_same(r["params"], zero2["params"])


PARTITIONED = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
               "zero_allow_untested_optimizer": True}


@pytest.mark.slow
def test_zero3_dpkfac_equals_zero2(zero2):
    # Each rank inverts and preconditions its own layers; the gradients are gathered on every rank all the same.
    r = run_distributed(z3_fit, 2, STEPS, stage=3, schedule="dpkfac", config=PARTITIONED, timeout=240)[0]
    _assert_same(r["params"], zero2["params"])


@pytest.mark.slow
def test_zero3_checkpoint_resume_equals_uninterrupted(tmp_path):
    # Saved at step 8, the end of the first epoch (8 steps of 2 x 4 samples): a mid-epoch resume would restart
    # the plain DataLoader's epoch, at any stage.
    full = run_distributed(z3_fit, 2, 12, stage=3, config=PARTITIONED, ckpt_dir=str(tmp_path), timeout=240)[0]
    ckpt = tmp_path / "epoch=0-step=8.ckpt"
    assert ckpt.exists(), sorted(p.name for p in tmp_path.iterdir())
    resumed = run_distributed(z3_fit, 2, 12, stage=3, config=PARTITIONED, resume=str(ckpt), timeout=240)[0]
    _assert_same(resumed["params"], full["params"])


@pytest.mark.slow
def test_zero3_per_parameter_accessor_equals_zero2(zero2):
    r = run_distributed(z3_fit, 2, STEPS, stage=3, fused=False, timeout=240)[0]  # (parameters persist: the default)
    assert r["status"] == ["ZeroParamStatus.AVAILABLE"]
    _assert_same(r["params"], zero2["params"])


def test_stage_3_is_accepted_and_its_offload_refused_by_name(tmp_path):
    t = pl.Trainer(strategy=SPDKFACDeepSpeedStrategy(stage=3), accelerator="cpu", devices=1, logger=False)
    assert t.strategy.config["zero_optimization"]["stage"] == 3
    t = pl.Trainer(strategy="spdkfac_deepspeed_stage_3", accelerator="cpu", devices=1, logger=False)
    assert isinstance(t.strategy, SPDKFACDeepSpeedStrategy) and t.strategy.config["zero_optimization"]["stage"] == 3
    assert SPDKFACDeepSpeedStrategy(config={"zero_optimization": {"stage": 3}}).config["zero_optimization"]["stage"] == 3
    with pytest.raises(ValueError, match=r"offload_optimizer.. must be absent.*ZeRO stage 3.*offload_optimizer=True.*"
                                         r"Fix: remove 'offload_optimizer'.*offload_optimizer=False.*stage=2"):
        SPDKFACDeepSpeedStrategy(stage=3, offload_optimizer=True)
    with pytest.raises(ValueError, match=r"offload_param.*offload_parameters=True.*Fix:.*offload_parameters=False"):
        SPDKFACDeepSpeedStrategy(stage=3, offload_parameters=True)
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}')
    with pytest.raises(ValueError, match=r"offload_param'\] must be absent.*got device 'cpu'.*in config="):
        SPDKFACDeepSpeedStrategy(config=str(path))
    # offload "none" is no offload; and stage 2 keeps its offload as before
    SPDKFACDeepSpeedStrategy(config={"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none"}}})
    SPDKFACDeepSpeedStrategy(stage=2, offload_optimizer=True)


class _FakeZ3Optimizer:
    """Stage 3's layout of fp32 gradients: rank r holds elements [r*s, (r+1)*s) of the flattened gradient, s the
    size rounded up to a multiple of the world size, the last slice padded (here with 123, to see it is left)."""

    def __init__(self, full, rank, world):
        self.slices = {}
        for key, g in full.items():
            size = -(-g.numel() // world)
            padded = torch.full((size * world,), 123.0)
            padded[:g.numel()] = g.reshape(-1)
            self.slices[key] = padded[rank * size:(rank + 1) * size].clone()

    def _get_fp32_grad_state_partition(self, param, release_swap_buffers):
        return self.slices[param.key], 0


class _FakeZ3Param:
    def __init__(self, key, shape, optimizer):
        self.key, self.ds_shape, self.ds_numel = key, torch.Size(shape), torch.Size(shape).numel()
        self._z3_optimizer, self.ds_process_group = optimizer, torch.distributed.group.WORLD


def slices_on_ranks(rank, world):
    from lightning_spdkfac.lightning.deepspeed_zero3 import _gather_slices, _write_slice

    g = torch.Generator().manual_seed(0)
    shapes = {"w": (7, 3), "b": (7,), "e": (4, 4), "one": (1,)}  # 21, 7, 1: uneven over 2 ranks; 16: even
    full = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    new = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    opt = _FakeZ3Optimizer(full, rank, world)
    params = [_FakeZ3Param(k, s, opt) for k, s in shapes.items()]
    gathered = _gather_slices(params)
    same = all(torch.equal(gathered[p], full[p.key]) for p in params)
    for p in params:
        _write_slice(p, new[p.key])
    expected = _FakeZ3Optimizer(new, rank, world).slices  # (the same padding: 123, untouched)
    written = all(torch.equal(opt.slices[k], expected[k]) for k in shapes)
    return same, written


def test_the_slice_gather_and_write_follow_stage_3s_layout():
    assert run_distributed(slices_on_ranks, 2, timeout=60) == [(True, True), (True, True)]


@pytest.mark.slow
def test_zero3_bf16_equals_zero2_bf16():
    # bf16 parameters, fp32 master gradients: the stage-3 slices are read and written in fp32 as at stage 2.
    zero2 = run_distributed(z3_fit, 2, STEPS, stage=2, precision="bf16-mixed", timeout=240)[0]
    r = run_distributed(z3_fit, 2, STEPS, stage=3, precision="bf16-mixed", config=PARTITIONED, timeout=240)[0]
    assert r["kfac_steps"] == STEPS
    _assert_same(r["params"], zero2["params"])
