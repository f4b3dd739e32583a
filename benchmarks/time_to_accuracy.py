"""Time to target: K-FAC with its library defaults against honestly tuned first-order baselines.

Run ``python benchmarks/time_to_accuracy.py`` (``--help`` for options; ``--quick`` for a smoke run of about a
minute). Everything runs offline on the CPU, one torch thread by default. The recorded runs' commands and
results: docs/results/time-to-accuracy.md.

Workloads (the package's demo models and data, nothing downloaded):

* ``digits``: the CNN of configs/digits.yaml on scikit-learn's 8x8 digits; target val acc 0.97.
* ``resnet``: the ResNet-8 of configs/resnet_cifar.yaml on CIFAR-shaped digits (8x8 upsampled to
  3x32x32, NOT CIFAR-10); target val acc 0.97.
* ``textlm``: the TinyGPT of configs/transformer_lm*.yaml on the stdlib sources, with the plain per-token
  mean loss (``loss_scale=1``); target val loss 2.0 nats/token (configs/transformer_lm_adamw.yaml's
  sweep reaches 1.98 at AdamW lr 0.003 and 1.85 at its best lr in 500 steps).
* ``transformer`` (issue 18): TinyGPT as people build one now, ``nn.MultiheadAttention``, the head tied to
  the token ``nn.Embedding``, the plain per-token mean loss, 500 optimizer steps, validated every 50; the
  target is tuned AdamW's own result, the median over seeds of the final val loss at its best lr.
* ``autoencoder``: a deep MLP autoencoder on the flattened digits, 64-256-128-32-128-256-64 with tanh,
  MSE reconstruction (defined here); target val MSE 0.005 (AdamW lr 3e-3 reaches it in about 10 epochs;
  SGD plateaus near 0.022 at every lr tried).
* ``depthwise`` (issue 27): a MobileNet-style CNN of depthwise-separable convolutions (``DepthwiseCNN``: 3x3
  depthwise ``groups=channels`` + 1x1 pointwise, BatchNorm) on the ResNet's CIFAR-shaped digits, 6 epochs;
  target val acc 0.97 (a screen: tuned AdamW reaches it in about 4-5 epochs).
* ``gpt2`` (issues 26, 27): the ``transformers`` GPT-2 of examples/hf_gpt2.py (``bench_model``/``bench_data``,
  imported: 2 layers x 64, the 50257-token tied head, byte data, 10 optimizer steps an "epoch"), 4 epochs (40
  steps, about a minute a run on one thread; ``--budget 8`` is configs/hf_gpt2*.yaml's 80). Target: tuned
  AdamW's median final val loss, as for ``transformer``.
* ``gpt2_long`` (issue 37): ``gpt2``'s model and data with 20 steps an epoch, 20 epochs: 400 optimizer steps,
  validated every 20, so that the target (tuned AdamW's, as for ``gpt2``) is not on a plateau and methods that
  differ by less than an epoch of ``gpt2`` can be told apart (about 7 CPU-minutes a run on one thread).
* ``resnet18w`` (issue 37): ResNet-18's widths (64-128-256-512, BasicBlocks, BatchNorm), one block a stage and a
  stride-2 stem, on the ResNet's CIFAR-shaped digits, 4 epochs; target val acc 0.97. On one CPU thread
  ``torch.optim.Muon`` cannot run it: its bfloat16 Newton-Schulz takes about 11 s for one 512 x 4608 filter.

Baselines (``--optimizers``): SGD, AdamW, Muon, SOAP, Shampoo (benchmarks/_tta_optimizers.py). The protocol
(baseline sweeps, winners, the K-FAC phase), what counts as diverged and what is timed:
docs/results/time-to-accuracy.md, "How the benchmark works".

Output (``--out``, a fresh folder; default ``benchmarks/results/run-<stamp>-time_to_accuracy/``): ``results.json``
with every run's per-epoch history (metric, train loss, seconds), the summaries and the printed tables;
``time_to_target.png`` with the median curve (metric against seconds) per optimizer and workload.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from _common import bench_parser, env_info, format_table, out_dir, parse, pyplot, save_png, set_threads
from _tta_optimizers import BASELINE_OPTIMIZERS, KFAC_BASE_OPTIMIZERS, build_optimizer, optimizer_class
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from lightning_spdkfac import KFAC
from lightning_spdkfac.demo import DigitsCNN, DigitsDataModule
from lightning_spdkfac.demo.cifar import ResNetCIFAR, SmallImagesDataModule
from lightning_spdkfac.demo.textlm import StdlibTextDataModule, TinyGPT
from lightning_spdkfac.kfac import auto_damping
from lightning_spdkfac.kfac.options import KFACOptions


def default_damping(optimizer: str, opts: dict[str, Any] | None = None) -> float:
    """The damping ``KFAC()`` (``damping="auto"``) uses on this baseline optimizer (kfac/auto_damping.py)."""
    opts = opts or {}
    if "damping" in opts:
        return opts["damping"]
    return auto_damping.resolve_class(optimizer_class(optimizer), opts.get("update", "kfac"))[0]


DAMPINGS = (1e-4, 1e-3, 1e-2, 1e-1)
LR_FACTORS = (1 / 3, 1.0, 3.0)
# Keys of a --candidates entry that are not K-FAC options: the lr as a factor of the best SGD/AdamW baseline's (or,
# with "lr_from", of that swept optimizer's winner, e.g. "muon"), and the base optimizer (any of
# BASELINE_OPTIMIZERS; default: the best SGD/AdamW baseline).
CANDIDATE_KEYS = ("lr_factor", "optimizer", "lr_from")
# The K-FAC phase's optional rows (--kfac-rows); the baseline re-runs and K-FAC() at its defaults always run.
KFAC_ROWS = ("reduce", "damping")


# ------------------------------------------------------------------------------ optimizers
def cosine_optimizer(module: pl.LightningModule, name: str, lr: float, weight_decay: float) -> dict[str, Any]:
    """``name`` (_tta_optimizers.BASELINE_OPTIMIZERS: SGD with momentum 0.9 and coupled L2, AdamW, Muon + AdamW,
    SOAP, Shampoo, the last four with decoupled decay) at peak ``lr``, cosine to 0 per step over the fit."""
    opt = build_optimizer(module, name, lr, weight_decay)
    total = max(1, int(module.trainer.estimated_stepping_batches))

    def factor(step: int) -> float:
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, step / total)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


# SGD: the configs' value (coupled); AdamW: torch's default (decoupled), also Muon's, SOAP's and Shampoo's.
WEIGHT_DECAY = {"sgd": 5e-4, "adamw": 1e-2, "muon": 1e-2, "soap": 1e-2, "shampoo": 1e-2}


# ------------------------------------------------------------------------------ K-FAC's loss parts
# Every benchmark module has ``kfac_loss_parts(batch) -> (forward, loss)``, which K-FAC's step-size rule calls
# (duck-typed): ``loss(forward())`` is the training step's loss on the batch from the current parameters
# (tests/test_time_to_accuracy_bench.py checks it on one batch of every workload). The rule itself restores the
# buffers (BatchNorm's running statistics) that its extra forwards update.
class _ClassifierLossParts:
    """``kfac_loss_parts`` of a classifier whose training step is ``F.cross_entropy(self(x), y)``."""

    def kfac_loss_parts(self, batch: tuple[torch.Tensor, torch.Tensor]
                        ) -> tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
        x, y = batch
        return (lambda: self(x)), (lambda z: F.cross_entropy(z, y))  # type: ignore[operator]


class BenchDigitsCNN(DigitsCNN):  # DigitsCNN has kfac_loss_parts
    """configs/digits.yaml's CNN with the optimizer chosen by the benchmark."""

    def __init__(self, opt_name: str, lr: float, seed: int = 0) -> None:
        super().__init__(lr=lr, channels=(16, 32), hidden=64)
        self.opt_name = opt_name

    def configure_optimizers(self) -> Any:
        return cosine_optimizer(self, self.opt_name, self.hparams.lr, WEIGHT_DECAY[self.opt_name])


class BenchResNet(_ClassifierLossParts, ResNetCIFAR):
    """configs/resnet_cifar.yaml's ResNet-8 with the optimizer chosen by the benchmark."""

    def __init__(self, opt_name: str, lr: float, seed: int = 0) -> None:
        super().__init__(lr=lr, widths=(16, 32, 64), blocks=(1, 1, 1), stem_stride=1, batch_norm=True)
        self.opt_name = opt_name

    def configure_optimizers(self) -> Any:
        return cosine_optimizer(self, self.opt_name, self.hparams.lr, WEIGHT_DECAY[self.opt_name])


class BenchResNet18W(BenchResNet):
    """Issue 37's CNN: ResNet-18's widths (64-128-256-512, BasicBlocks, BatchNorm) with one block per stage and a
    stride-2 stem (32x32 inputs, stages at 16/8/4/2 pixels), so that the convolutions, not K-FAC's factor work,
    set a step's cost and a run of a few epochs fits a CPU."""

    def __init__(self, opt_name: str, lr: float, seed: int = 0) -> None:
        ResNetCIFAR.__init__(self, lr=lr, widths=(64, 128, 256, 512), blocks=(1, 1, 1, 1), stem_stride=2,
                             batch_norm=True)
        self.opt_name = opt_name


class DigitsAutoencoder(pl.LightningModule):
    """A deep MLP autoencoder on the flattened 8x8 digits (pixels in [0, 1]): MSE reconstruction.

    ``dims`` are the widths from input to output (the ends must be 64); every Linear but the last is
    followed by ``activation``. Logs ``train_loss`` and ``val_mse`` (mean squared error per pixel).
    """

    def __init__(self, opt_name: str = "sgd", lr: float = 0.1, seed: int = 0,
                 dims: tuple[int, ...] = (64, 256, 128, 32, 128, 256, 64), activation: str = "tanh") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.opt_name = opt_name
        act = {"tanh": nn.Tanh, "relu": nn.ReLU}[activation]
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
            layers.append(nn.Linear(a, b))
            if i < len(dims) - 2:
                layers.append(act())
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x = batch[0].flatten(1)
        loss = F.mse_loss(self(x), x)
        self.log("train_loss", loss, on_step=False, on_epoch=True, batch_size=len(x))
        return loss

    def kfac_loss_parts(self, batch: tuple[torch.Tensor, torch.Tensor]
                        ) -> tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
        """forward(): the reconstructions (B, 64); loss(z): their mean squared error to the flattened inputs."""
        x = batch[0].flatten(1)
        return (lambda: self(x)), (lambda z: F.mse_loss(z, x))

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x = batch[0].flatten(1)
        self.log("val_mse", F.mse_loss(self(x), x), on_epoch=True, batch_size=len(x))

    def configure_optimizers(self) -> Any:
        return cosine_optimizer(self, self.opt_name, self.hparams.lr, WEIGHT_DECAY[self.opt_name])


class DepthwiseCNN(_ClassifierLossParts, pl.LightningModule):
    """A small MobileNet-style CNN for 3x32x32 images: depthwise-separable convolutions.

    stem ``conv3x3(3 -> c0, stride 2) - BN - ReLU``, then per entry ``(cout, stride)`` of ``blocks`` a
    depthwise-separable block ``conv3x3(c, c, groups=c, stride) - BN - ReLU - conv1x1(c -> cout) - BN - ReLU``,
    global average pooling and ``Linear(c_last -> 10)``. Convolutions have no bias (BatchNorm follows each).
    Logs ``train_loss``, ``val_loss`` and ``val_acc``.
    """

    def __init__(self, opt_name: str = "adamw", lr: float = 3e-3, seed: int = 0, stem: int = 16,
                 blocks: tuple[tuple[int, int], ...] = ((32, 1), (64, 2), (64, 1), (128, 2))) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.opt_name = opt_name
        layers: list[nn.Module] = [nn.Conv2d(3, stem, 3, 2, 1, bias=False), nn.BatchNorm2d(stem), nn.ReLU()]
        c = stem
        for cout, stride in blocks:
            layers += [nn.Conv2d(c, c, 3, stride, 1, groups=c, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
                       nn.Conv2d(c, cout, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
            c = cout
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(c, 10)
        self.val_acc = MulticlassAccuracy(num_classes=10, average="micro")
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).mean((2, 3)))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, batch_size=len(y))
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val_loss", F.cross_entropy(logits, y), on_epoch=True, batch_size=len(y))
        self.log("val_acc", self.val_acc, on_epoch=True, batch_size=len(y))

    def configure_optimizers(self) -> Any:
        return cosine_optimizer(self, self.opt_name, self.hparams.lr, WEIGHT_DECAY[self.opt_name])


class _LMBench:
    """Mixin for TinyGPT and its subclasses (GPT2LM): the benchmark's optimizer under TinyGPT's own schedule
    (linear warmup, cosine to ``min_lr_ratio``), and ``kfac_loss_parts``. ``opt_name`` is set by the factory."""

    opt_name: str

    def configure_optimizers(self) -> Any:
        base = super().configure_optimizers()  # type: ignore[misc]  # SGD/AdamW per hparams, and the schedule
        if self.opt_name in ("sgd", "adamw"):
            return base
        h = self.hparams  # type: ignore[attr-defined]
        factor = base["lr_scheduler"]["scheduler"].lr_lambdas[0]  # TinyGPT's warmup + cosine, not a copy
        # TinyGPT's groups: its weight decay (decoupled, AdamW's 0.1) on the matrices, none on biases and norms
        opt = build_optimizer(self, self.opt_name, h.lr, h.weight_decay, groups=self.param_groups(),  # type: ignore
                              betas=tuple(h.betas))
        return {"optimizer": opt,
                "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, factor), "interval": "step"}}

    def kfac_loss_parts(self, batch: tuple[torch.Tensor, torch.Tensor]
                        ) -> tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
        """forward(): the logits (B, T, V); loss(logits): the per-token mean cross-entropy times ``loss_scale``
        (TinyGPT.training_step's loss)."""
        x, y = batch
        scale = self.hparams.loss_scale  # type: ignore[attr-defined]

        def loss(z: torch.Tensor) -> torch.Tensor:
            out = F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1))
            return out * scale if scale != 1.0 else out

        return (lambda: self(x)), loss  # type: ignore[operator]


class BenchTinyGPT(_LMBench, TinyGPT):
    """TinyGPT with the benchmark's optimizer and ``kfac_loss_parts``."""


@functools.cache
def _bench_gpt2_class() -> type:
    # examples/hf_gpt2.py imports transformers (seconds): only when the gpt2 workload is built
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
    from examples.hf_gpt2 import GPT2LM

    return type("BenchGPT2", (_LMBench, GPT2LM), {"__doc__": "GPT2LM with the benchmark's optimizer."})


class _ShuffleSeed:
    """Mixin: the train/val split from ``seed`` 0 on every run, the shuffling from ``shuffle_seed``."""

    def __init__(self, shuffle_seed: int, **kwargs: Any) -> None:
        super().__init__(seed=0, **kwargs)  # type: ignore[call-arg]
        self.shuffle_seed = shuffle_seed

    def train_dataloader(self):  # noqa: D102
        gen = torch.Generator().manual_seed(self.shuffle_seed)
        return torch.utils.data.DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True,
                                           generator=gen, num_workers=self.num_workers)


class DigitsData(_ShuffleSeed, DigitsDataModule):
    pass


class SmallImagesData(_ShuffleSeed, SmallImagesDataModule):
    pass


def digits_data(seed: int) -> pl.LightningDataModule:
    return DigitsData(seed, batch_size=64, val_fraction=0.2)


def small_images_data(seed: int) -> pl.LightningDataModule:
    return SmallImagesData(seed, batch_size=64, val_fraction=0.2, image_size=32, normalize=True)


def _bench_tinygpt(opt_name: str, lr: float, seed: int, tie_weights: bool, attention: str) -> pl.LightningModule:
    # TinyGPT's own optimizer argument is "adamw" or "sgd"; Muon, SOAP and Shampoo take the AdamW config's
    # decoupled weight decay 0.1 (on the matrices) and betas (0.9, 0.95), and their lr from the benchmark.
    m = BenchTinyGPT(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=64, mlp_ratio=4, dropout=0.0,
                     bias=True, tie_weights=tie_weights, attention=attention, lr=lr, momentum=0.9, betas=(0.9, 0.95),
                     warmup_steps=50, min_lr_ratio=0.1, init_seed=seed, loss_scale=1.0,
                     optimizer=opt_name if opt_name in ("sgd", "adamw") else "adamw",
                     weight_decay=5e-4 if opt_name == "sgd" else 0.1)
    m.opt_name = opt_name
    return m


def tinygpt(opt_name: str, lr: float, seed: int = 0) -> pl.LightningModule:
    # configs/transformer_lm*.yaml, but a plain per-token mean loss (loss_scale 1). Weight decay: the
    # AdamW config's 0.1 (decoupled) or the SGD config's 5e-4 (coupled).
    return _bench_tinygpt(opt_name, lr, seed, tie_weights=False, attention="linear")


def transformer(opt_name: str, lr: float, seed: int = 0) -> pl.LightningModule:
    # Issue 18's workload: TinyGPT as people build one now, nn.MultiheadAttention, the head tied to the token
    # embedding, the plain per-token mean loss; the sizes, schedule and weight decays of ``tinygpt``.
    return _bench_tinygpt(opt_name, lr, seed, tie_weights=True, attention="mha")


def gpt2(opt_name: str, lr: float, seed: int = 0) -> pl.LightningModule:
    """examples/hf_gpt2.py's ``bench_model`` (configs/hf_gpt2*.yaml: GPT2LMHeadModel 2 x 64, vocabulary 50257,
    tied head, AdamW wd 0.1 betas 0.9/0.95, 10 warmup steps then cosine to lr/10) with the benchmark's optimizer;
    Muon, SOAP and Shampoo take AdamW's settings."""
    cls = _bench_gpt2_class()  # also puts the repository root on sys.path
    from examples.hf_gpt2 import bench_model

    m = bench_model(opt_name if opt_name in ("sgd", "adamw") else "adamw", lr, seed)
    m.__class__ = cls  # BenchGPT2 adds methods only (no state): bench_model's instance, the benchmark's optimizer
    m.opt_name = opt_name
    return m


def gpt2_data(seed: int) -> pl.LightningDataModule:
    _bench_gpt2_class()  # the repository root on sys.path
    from examples.hf_gpt2 import bench_data

    return bench_data(seed)


def gpt2_long_data(seed: int) -> pl.LightningDataModule:
    """examples/hf_gpt2.py's ``bench_data`` with 20 optimizer steps an epoch (validation every 20 steps), the rest
    (16 x 64 bytes a step, 32 fixed validation windows, the split) unchanged."""
    return StdlibTextDataModule(**{**gpt2_data(seed).hparams, "batches_per_epoch": 20})


def depthwise(opt_name: str, lr: float, seed: int = 0) -> pl.LightningModule:
    return DepthwiseCNN(opt_name, lr, seed)


def transformer_data(seed: int) -> pl.LightningDataModule:
    # validation every 50 optimizer steps (500 steps = 10 "epochs"): times to target at a finer grain
    return StdlibTextDataModule(block_size=64, batch_size=32, max_bytes=2_000_000, seed=seed,
                                val_fraction=0.1, val_windows=256, batches_per_epoch=50)


def text_data(seed: int) -> pl.LightningDataModule:
    return StdlibTextDataModule(block_size=64, batch_size=32, max_bytes=2_000_000, seed=seed,
                                val_fraction=0.1, val_windows=256, batches_per_epoch=100)


# ------------------------------------------------------------------------------ workloads
@dataclass
class Workload:
    name: str
    title: str
    model: Callable[[str, float, int], pl.LightningModule]  # (optimizer, lr, seed)
    data: Callable[[int], pl.LightningDataModule]
    monitor: str
    mode: str  # "max" (accuracy) or "min" (loss)
    target: float
    budget: int  # epochs (TinyGPT: epochs of 100 optimizer steps)
    lrs: dict[str, list[float]]
    quick_budget: int
    quick_lrs: dict[str, list[float]] = field(default_factory=dict)
    # "adamw": the target is set after the sweep, to the median final metric (over the seeds) of the AdamW lr
    # with the best one: "reach tuned AdamW's result at the end of the budget"; ``target`` is then a placeholder.
    target_from: str | None = None

    def reached(self, value: float) -> bool:
        return math.isfinite(value) and (value >= self.target if self.mode == "max" else value <= self.target)


# Muon (lr relation: AdamW's, see _tta_optimizers), SOAP and Shampoo start from the AdamW grid of each workload;
# run_workload's --widen extends a grid whose winner sits at its edge.
WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("digits", "digits CNN (configs/digits.yaml), val acc", BenchDigitsCNN, digits_data,
             "val_acc", "max", 0.97, budget=8,
             lrs={"sgd": [0.0125, 0.025, 0.05, 0.1, 0.2, 0.4], "adamw": [4e-3, 8e-3, 1.6e-2, 3.2e-2, 6.4e-2],
                  **dict.fromkeys(("muon", "soap", "shampoo"), [4e-3, 8e-3, 1.6e-2, 3.2e-2, 6.4e-2])},
             quick_budget=4, quick_lrs={"sgd": [0.05, 0.2], "adamw": [1e-3, 4e-3]}),
    Workload("resnet", "ResNet-8 on CIFAR-shaped digits, val acc", BenchResNet, small_images_data,
             "val_acc", "max", 0.97, budget=6,
             lrs={"sgd": [0.05, 0.1, 0.2, 0.4, 0.8], "adamw": [5e-4, 1e-3, 2e-3, 4e-3, 8e-3],
                  **dict.fromkeys(("muon", "soap", "shampoo"), [1e-3, 3e-3, 1e-2])},
             quick_budget=1, quick_lrs={"sgd": [0.2], "adamw": [2e-3]}),
    Workload("textlm", "TinyGPT on stdlib sources (loss_scale 1), val loss", tinygpt, text_data,
             "val_loss", "min", 2.0, budget=5,
             lrs={"sgd": [0.1, 0.3, 1.0, 3.0], "adamw": [1.5e-3, 3e-3, 6e-3, 1.3e-2],
                  **dict.fromkeys(("muon", "soap", "shampoo"), [1e-3, 3e-3, 1e-2])},
             quick_budget=1, quick_lrs={"sgd": [1.0], "adamw": [1.3e-2]}),
    Workload("transformer", "TinyGPT, nn.MultiheadAttention, tied embedding, per-token mean loss, val loss",
             transformer, transformer_data, "val_loss", "min", math.nan, budget=10,
             lrs={"sgd": [0.3, 1.0], "adamw": [1.5e-3, 3e-3, 6e-3, 1.2e-2],
                  **dict.fromkeys(("muon", "soap", "shampoo"), [2e-3, 6e-3, 1.8e-2])},
             quick_budget=2, quick_lrs={"sgd": [1.0], "adamw": [6e-3]}, target_from="adamw"),
    Workload("autoencoder", "MLP autoencoder 64-256-128-32-128-256-64 (tanh) on digits, val MSE",
             DigitsAutoencoder, digits_data, "val_mse", "min", 0.005, budget=30,
             lrs={"sgd": [0.03, 0.1, 0.3, 1.0, 3.0], "adamw": [3e-4, 1e-3, 3e-3, 1e-2, 3e-2],
                  **dict.fromkeys(("muon", "soap", "shampoo"), [3e-4, 1e-3, 3e-3, 1e-2, 3e-2])},
             quick_budget=10, quick_lrs={"sgd": [0.3, 1.0], "adamw": [1e-3, 1e-2]}),
    # Depthwise-separable CNN (DepthwiseCNN, MobileNet-style, BatchNorm) on the ResNet's data. Target 0.97: in a
    # screen (seed 0, 8 epochs) AdamW reached 0.969 at epoch 4 at lr 1e-2 and 3e-2 and 0.978-0.994 by epoch 8, so
    # tuned AdamW reaches 0.97 in about 4-5 of the 6 epochs and slower optimizers can still be ranked by time.
    Workload("depthwise", "MobileNet-style depthwise-separable CNN on CIFAR-shaped digits, val acc", depthwise,
             small_images_data, "val_acc", "max", 0.97, budget=6,
             lrs={"sgd": [0.03, 0.1, 0.3, 1.0], "adamw": [1e-3, 3e-3, 1e-2, 3e-2],
                  **dict.fromkeys(("muon", "soap", "shampoo"), [1e-3, 3e-3, 1e-2, 3e-2])},
             quick_budget=1, quick_lrs={"sgd": [0.1], "adamw": [1e-2]}),
    # examples/hf_gpt2.py's GPT-2 (vocabulary 50257, tied head) and data: 4 epochs of 10 steps by default (about 60 s
    # a run on 1 thread), --budget 8 for the configs' 80 steps. Target: tuned AdamW's median final val loss.
    Workload("gpt2", "transformers GPT-2 2x64, vocab 50257, tied head, 10 steps an epoch, val loss", gpt2, gpt2_data,
             "val_loss", "min", math.nan, budget=4,
             lrs={"sgd": [0.3, 1.0, 3.0], "adamw": [3e-3, 1e-2, 3e-2],
                  **dict.fromkeys(("muon", "soap", "shampoo"), [3e-3, 1e-2, 3e-2])},
             quick_budget=1, quick_lrs={"sgd": [1.0], "adamw": [1e-2]}, target_from="adamw"),
    # Issue 37: the same GPT-2 and data, long enough that the target is not on a plateau: 20 epochs of 20 steps (400
    # optimizer steps, validation every 20), warmup 10 then cosine over the 400. Target: tuned AdamW's median final
    # val loss. Grids of 4-5 half-decade points around "gpt2"'s winners (AdamW 1e-2, Muon 3e-2 at its edge), so that
    # --widen can show a winner inside its grid.
    Workload("gpt2_long", "transformers GPT-2 2x64, vocab 50257, tied head, 400 steps, val every 20, val loss", gpt2,
             gpt2_long_data, "val_loss", "min", math.nan, budget=20,
             lrs={"sgd": [0.3, 1.0, 3.0], "adamw": [1e-3, 3e-3, 1e-2, 3e-2],
                  "muon": [3e-3, 1e-2, 3e-2, 1e-1], **dict.fromkeys(("soap", "shampoo"), [1e-3, 3e-3, 1e-2, 3e-2])},
             quick_budget=1, quick_lrs={"sgd": [1.0], "adamw": [1e-2]}, target_from="adamw"),
    # Issue 37: a ResNet-18-width CNN (BenchResNet18W: 64-128-256-512, one BasicBlock a stage, stride-2 stem) on the
    # CIFAR-shaped digits, 4 epochs of 23 steps (batch 64), validation every epoch; target val acc 0.97 as "resnet".
    Workload("resnet18w", "ResNet-18-width CNN (64-128-256-512, 1 block a stage) on CIFAR-shaped digits, val acc",
             BenchResNet18W, small_images_data, "val_acc", "max", 0.97, budget=4,
             lrs={"sgd": [0.025, 0.05, 0.1, 0.2, 0.4], "adamw": [2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3],
                  "muon": [1e-3, 3e-3, 1e-2, 3e-2], **dict.fromkeys(("soap", "shampoo"), [3e-4, 1e-3, 3e-3, 1e-2])},
             quick_budget=1, quick_lrs={"sgd": [0.1], "adamw": [1e-3]}),
)}


# ------------------------------------------------------------------------------ one run
# What "time" is (--clock): "wall", wall-clock seconds (the default, as ever), or "cpu", the process's CPU seconds
# (time.process_time(), all its threads), for a machine shared with other work, where one-thread runs wait for a
# core and wall-clock times grow with the neighbours' load. Every history records both.
CLOCK = "wall"


def _clock(entry: dict[str, Any]) -> float:
    """An epoch record's time under CLOCK (a record without CPU seconds, from before they were kept, gives its
    wall-clock seconds)."""
    return entry.get("cpu_seconds", entry["seconds"]) if CLOCK == "cpu" else entry["seconds"]


class History(pl.Callback):
    """Per-epoch (metric, train loss, seconds since ``t0``); stops a run whose loss goes non-finite."""

    def __init__(self, monitor: str, t0: float, cpu0: float | None = None) -> None:
        self.monitor = monitor
        self.t0 = t0
        self.cpu0 = time.process_time() if cpu0 is None else cpu0
        self.history: list[dict[str, Any]] = []
        self.first_loss: float | None = None
        self.nonfinite = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        value = float(loss.detach()) if torch.is_tensor(loss) else float("nan")
        if self.first_loss is None:
            self.first_loss = value
        if not math.isfinite(value):
            self.nonfinite = True
            trainer.should_stop = True

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        value = trainer.callback_metrics.get(self.monitor)
        metric = float(value) if value is not None else float("nan")
        self.history.append({"epoch": trainer.current_epoch + 1, "step": trainer.global_step,
                             self.monitor: metric, "train_loss": None,
                             "seconds": round(time.perf_counter() - self.t0, 4),
                             "cpu_seconds": round(time.process_time() - self.cpu0, 4)})
        if not math.isfinite(metric):
            self.nonfinite = True
            trainer.should_stop = True

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        value = trainer.callback_metrics.get("train_loss")
        if value is not None and self.history and self.history[-1]["epoch"] == trainer.current_epoch + 1:
            self.history[-1]["train_loss"] = float(value)
            if not math.isfinite(float(value)):
                self.nonfinite = True
                trainer.should_stop = True


def run_one(w: Workload, opt_name: str, lr: float, seed: int, epochs: int, kfac: dict | None) -> dict[str, Any]:
    """Train one configuration; returns its record (history, time to target, divergence)."""
    pl.seed_everything(seed, verbose=False)
    model = w.model(opt_name, lr, seed)
    data = w.data(seed)
    t0, cpu0 = time.perf_counter(), time.process_time()
    hist = History(w.monitor, t0, cpu0)
    callbacks: list[pl.Callback] = [hist]
    if kfac is not None:
        callbacks.insert(0, KFAC(**kfac))
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, callbacks=callbacks,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    error = None
    try:
        trainer.fit(model, datamodule=data)
    except Exception as e:  # noqa: BLE001 - a failed run is recorded, not fatal (K-FAC's max_bad_steps, ...)
        error = f"{type(e).__name__}: {e}"[:500]
    wall = time.perf_counter() - t0
    h = hist.history
    seconds = next((_clock(r) for r in h if w.reached(r[w.monitor])), None)
    epoch = next((r["epoch"] for r in h if w.reached(r[w.monitor])), None)
    final = h[-1][w.monitor] if h else float("nan")
    last_loss = next((r["train_loss"] for r in reversed(h) if r["train_loss"] is not None), None)
    first = hist.first_loss
    diverged = bool(error or hist.nonfinite or not h or not math.isfinite(final)
                    or (first is not None and last_loss is not None and last_loss > first))
    return {"workload": w.name, "optimizer": opt_name, "lr": lr, "seed": seed, "kfac": kfac,
            "epochs": epochs, "reached": seconds is not None, "seconds_to_target": seconds,
            "epoch_to_target": epoch, "final_metric": final, "first_loss": first, "last_train_loss": last_loss,
            "diverged": diverged, "error": error, "wall_seconds": round(wall, 3), "history": h}


# ------------------------------------------------------------------------------ summaries
def summarize(w: Workload, runs: list[dict]) -> dict[str, Any]:
    """Median time to target [min-max of the seeds that reached it], k of n, median final metric."""
    times = [r["seconds_to_target"] if r["reached"] else math.inf for r in runs]
    reached = [t for t in times if math.isfinite(t)]
    worst = -math.inf if w.mode == "max" else math.inf  # a non-finite final metric ranks last
    finals = [r["final_metric"] if math.isfinite(r["final_metric"]) else worst for r in runs]
    median = statistics.median(times) if times else math.inf
    return {
        "median_s": median if math.isfinite(median) else None,
        "min_s": min(reached) if reached else None,
        "max_s": max(reached) if reached else None,
        "reached": len(reached), "n": len(runs),
        "final": statistics.median(finals) if finals else float("nan"),
        "diverged": sum(r["diverged"] for r in runs),
        "wall_s": sum(r["wall_seconds"] for r in runs),
    }


def rank_key(w: Workload, s: dict) -> tuple:
    """Lower is better: finite median time first (by time), then the rest by their median final metric."""
    final = s["final"] if not math.isnan(s["final"]) else (-math.inf if w.mode == "max" else math.inf)
    if s["median_s"] is not None:
        return (0, s["median_s"], 0.0)
    return (1, 0.0, -final if w.mode == "max" else final)


def row(label: str, lr: float, s: dict, damping: float | None = None) -> dict[str, Any]:
    span = f"[{s['min_s']:.1f}-{s['max_s']:.1f}]" if s["min_s"] is not None else "[-]"
    return {"optimizer": label, "lr": lr, "damping": damping, "median_s": s["median_s"], "span": span,
            "reached": f"{s['reached']}/{s['n']}", "final": s["final"],
            "diverged": f"{s['diverged']}/{s['n']}", "wall_s": s["wall_s"]}


COLUMNS = [("optimizer", "optimizer", ""), ("lr", "lr", ".3g"), ("damping", "damping", ".0e"),
           ("median_s", "median s to target", ".2f"), ("span", "[min-max]", ""), ("reached", "reached", ""),
           ("final", "final metric", ".4f"), ("diverged", "diverged", ""), ("wall_s", "wall s (all seeds)", ".1f")]


# ------------------------------------------------------------------------------ the benchmark
def recorded_sweep(paths: str | list[str], name: str) -> dict[str, Any]:
    """The baseline sweeps of workload ``name`` from earlier results.json files (``--baselines-from``, comma-separated).

    Per optimizer and lr, the first file that swept it wins; its sweep runs are re-scored here (a ``target_from``
    workload's target is recomputed from the merged runs). All files must have the workload's same number of
    epochs, and its runs (results.json files from before 2026-11-24 kept only summaries). A ``runs.jsonl``
    (the run-by-run log every invocation writes beside its results.json) gives the sweep runs it holds: what an
    interrupted invocation finished.
    """
    paths = [x for x in paths.split(",") if x] if isinstance(paths, str) else list(paths)
    runs: list[dict] = []
    have: set[tuple[str, float]] = set()
    epochs: set[int] = set()
    seeds: dict[str, list[int]] = {}
    found = False
    for path in paths:
        with open(path) as f:
            payload = _payload_from_jsonl(f, name) if path.endswith(".jsonl") else json.load(f)
        res = next((r for r in payload["workloads"] if r["workload"] == name), None)
        if res is None:
            continue
        found = True
        epochs.add(res["epochs"])
        sweep_runs = [r for r in res.get("runs", []) if r["tag"].startswith("sweep ")]
        for opt_name, opt_rows in res["sweep"].items():
            for srow in opt_rows:
                key = (opt_name, float(srow["lr"]))
                if key in have:
                    continue
                have.add(key)
                mine = [r for r in sweep_runs if r["tag"] == f"sweep {opt_name}" and math.isclose(r["lr"], key[1])]
                if not mine:
                    raise SystemExit(f"--baselines-from {path}: its {name} sweep of {opt_name} lr {key[1]:g} has no"
                                     " runs recorded (an old summary-only file): sweep again")
                runs += [{**r, "from": path} for r in mine]
                seeds.setdefault(path, res["seeds"])
    if not found:
        raise SystemExit(f"--baselines-from {paths}: no workload {name!r} in them")
    if len(epochs) > 1:
        raise SystemExit(f"--baselines-from {paths}: workload {name!r} was run for different epochs {sorted(epochs)}")
    return {"path": ",".join(paths), "runs": runs, "epochs": epochs.pop(), "seeds": seeds}


def _payload_from_jsonl(f: Any, name: str) -> dict[str, Any]:
    """A results.json-like payload of workload ``name``'s sweep runs in a runs.jsonl (one run record a line)."""
    runs = [r for r in map(json.loads, filter(str.strip, f)) if r["workload"] == name and r["tag"].startswith("sweep ")]
    if not runs:
        return {"workloads": []}
    sweep: dict[str, list[dict]] = {}
    for r in runs:
        o = r["tag"].split(" ", 1)[1]
        if not any(math.isclose(x["lr"], r["lr"]) for x in sweep.get(o, [])):
            sweep.setdefault(o, []).append({"lr": r["lr"]})
    return {"workloads": [{"workload": name, "epochs": runs[0]["epochs"], "seeds": sorted({r["seed"] for r in runs}),
                           "sweep": sweep, "runs": runs}]}


def _recorded_lrs(recorded: dict[str, Any]) -> dict[str, list[float]]:
    opts = dict.fromkeys(r["tag"].split(" ", 1)[1] for r in recorded["runs"])  # in recorded order
    return {o: sorted({float(r["lr"]) for r in recorded["runs"] if r["tag"] == f"sweep {o}"}) for o in opts}


def run_workload(w: Workload, seeds: list[int], quick: bool, budget: int | None, log: Callable[[str], None],
                 candidates: dict[str, dict] | None = None, recorded: dict[str, Any] | None = None,
                 sweep_seeds: list[int] | None = None, optimizers: list[str] | None = None,
                 kfac_phase: bool = True, widen: int = 0, extra_lrs: dict[str, list[float]] | None = None,
                 runs_log: str | None = None, kfac_rows: tuple[str, ...] = KFAC_ROWS, reruns: bool = True) -> dict:
    """Sweep the baselines (``optimizers`` not in ``recorded``), widen edge winners' grids up to ``widen`` times,
    then (``kfac_phase``) run K-FAC on the best SGD/AdamW baseline beside re-runs of it and of the best of all
    (``reruns=False``: no re-runs, K-FAC is compared with the winners' sweep runs, for a machine that cannot
    afford them)."""
    candidates = candidates or {}
    sweep_seeds = seeds if sweep_seeds is None else sweep_seeds
    epochs = budget or (w.quick_budget if quick else w.budget)
    optimizers = list(optimizers or BASELINE_OPTIMIZERS)
    dampings = (1e-3, 1e-1) if quick else DAMPINGS
    lr_factors = (1.0, 3.0) if quick else LR_FACTORS
    runs: list[dict] = []

    def do(opt_name: str, lr: float, seed: int, kfac: dict | None, tag: str) -> dict:
        r = run_one(w, opt_name, lr, seed, epochs, kfac)
        r["tag"] = tag
        runs.append(r)
        if runs_log:  # run by run: what an interrupted invocation finished survives (--baselines-from takes it)
            with open(runs_log, "a") as f:
                f.write(json.dumps(r, default=str) + "\n")
        t = f"{r['seconds_to_target']:.2f}s" if r["reached"] else "not reached"
        log(f"  [{w.name}] seed {seed} {tag:<28} lr {lr:<8.3g} target: {t:<12} final {r['final_metric']:.4f}"
            f"  wall {r['wall_seconds']:.1f}s{'  DIVERGED' if r['diverged'] else ''}"
            f"{'  ' + r['error'] if r['error'] else ''}")
        return r

    # 1. baseline sweep, interleaved seed by seed and optimizer by optimizer, of the optimizers not recorded
    lrs: dict[str, list[float]] = {}
    if recorded is not None:
        if recorded["epochs"] != epochs:
            raise SystemExit(f"[{w.name}] --baselines-from ran {recorded['epochs']} epochs, this run {epochs}")
        runs += recorded["runs"]
        _retarget(w, runs)  # re-scored under this run's clock (and target)
        if CLOCK == "cpu" and any("cpu_seconds" not in h for r in recorded["runs"] for h in r["history"]):
            log(f"  [{w.name}] note: recorded runs without CPU seconds are timed by their wall-clock seconds")
        lrs.update(_recorded_lrs(recorded))
        log(f"  [{w.name}] baseline sweeps of {sorted(lrs)} from {recorded['path']} ({recorded['epochs']} epochs)")
    to_sweep = {}
    for o in optimizers:
        if o in lrs:
            continue
        grid = (extra_lrs or {}).get(o) or (w.quick_lrs.get(o) if quick else None) or w.lrs[o]
        if quick and o not in w.quick_lrs and not (extra_lrs or {}).get(o):
            grid = [grid[len(grid) // 2]]  # --quick: the middle of the grid
        to_sweep[o] = sorted(grid)
    # untimed warm-up (imports, allocator, first-call costs) so that the first timed run is not penalized
    for o in to_sweep:
        run_one(w, o, to_sweep[o][0], 0, 1, None)
    if kfac_phase:
        if "sgd" not in to_sweep:
            run_one(w, "sgd", w.lrs["sgd"][0], 0, 1, None)
        run_one(w, "sgd", w.lrs["sgd"][0], 0, 1, {"log_step_time": False})
    _sweep(w, to_sweep, seeds, do, runs)
    lrs.update(to_sweep)

    def rank() -> tuple[Workload, dict, dict, dict]:
        nonlocal w
        if w.target_from is not None:
            w = _target_from_baseline(w, lrs, runs)
        sweep, winners, edge = _rank_sweep(w, lrs, runs)
        return w, sweep, winners, edge

    w, sweep, winners, edge = rank()
    widened: dict[str, list[float]] = {}
    for _ in range(widen):  # extend every swept grid whose winner is at its edge by one more point, all seeds
        grow = {}
        for o, grid in to_sweep.items():
            if not edge.get(o):
                continue
            ratio = grid[-1] / grid[-2]
            grow[o] = grid[0] / (grid[1] / grid[0]) if math.isclose(winners[o]["lr"], grid[0]) else grid[-1] * ratio
        if not grow:
            break
        for seed in seeds:
            for o, lr in grow.items():
                do(o, lr, seed, None, f"sweep {o}")
        for o, lr in grow.items():
            to_sweep[o] = lrs[o] = sorted([*to_sweep[o], lr])
            widened.setdefault(o, []).append(lr)
            log(f"  [{w.name}] widened the {o} grid to {lr:.3g} (its winner was at the edge)")
        w, sweep, winners, edge = rank()
    if w.target_from is not None:
        log(f"  [{w.name}] target: {w.target:.4f}, the median final {w.monitor} of tuned {w.target_from}")
    best_all = min(winners, key=lambda o: rank_key(w, winners[o]))
    bases = [o for o in KFAC_BASE_OPTIMIZERS if o in winners]
    best_opt = min(bases, key=lambda o: rank_key(w, winners[o])) if bases else None
    best_lr = winners[best_opt]["lr"] if best_opt else None
    log(f"  [{w.name}] winners: " + ", ".join(f"{o} lr {winners[o]['lr']:g}" for o in winners)
        + f"; best baseline {best_all} lr {winners[best_all]['lr']:g}"
        + (f"; best SGD/AdamW (K-FAC's base) {best_opt} lr {best_lr:g}" if best_opt else ""))
    sweep_rows = [row(f"{o}{' *' if s is winners[o] else ''}", s["lr"], s) for o, rs in sweep.items() for s in rs]
    unit = "higher is better" if w.mode == "max" else "lower is better"
    head = (f"== {w.name}: {w.title} {'>=' if w.mode == 'max' else '<='} {w.target:g} ({unit}), {epochs} epochs,"
            f" seeds {seeds}, time = {CLOCK} seconds")
    lines = [head, "-- lr sweep (* = winner, lowest median time to target):", format_table(sweep_rows, COLUMNS)]
    for o, at_edge in edge.items():
        if at_edge:
            lines.append(f"   note: the {o} winner lr {winners[o]['lr']:g} is at the edge of its grid")
    for o, added in widened.items():
        lines.append(f"   the {o} grid was widened by {', '.join(f'{x:.3g}' for x in added)}")
    result = {"workload": w.name, "title": w.title, "monitor": w.monitor, "mode": w.mode, "target": w.target,
              "epochs": epochs, "lrs": lrs, "seeds": seeds, "sweep": sweep, "winners": winners,
              "winner_at_grid_edge": edge, "widened": widened,
              "best_overall": {"optimizer": best_all, "lr": winners[best_all]["lr"]},
              "best_baseline": {"optimizer": best_opt, "lr": best_lr} if best_opt else None,
              "baseline_sweep_from": recorded and recorded["path"], "kfac_phase": kfac_phase, "clock": CLOCK}
    if not kfac_phase:
        result.update(table="\n".join(lines), runs=runs)
        return result
    if best_opt is None:
        raise SystemExit(f"[{w.name}] the K-FAC phase needs an SGD or AdamW sweep (run it, or --baselines-from one)")

    # 2. K-FAC on top of the best SGD/AdamW baseline, that baseline re-run beside it (and the best of all
    #    baselines when it is another one), candidate configurations (--candidates), and the damping sweep
    kfac_default = {"log_step_time": False}
    kfac_reduce = {"log_step_time": False, "factor_approx": "reduce"}
    grid = [(d, f) for f in lr_factors for d in dampings if not (d == default_damping(best_opt) and f == 1.0)]

    def cand_lr(opts: dict[str, Any]) -> float:
        src = opts.get("lr_from")
        if src is not None and src not in winners:
            raise SystemExit(f"[{w.name}] a candidate's lr_from {src!r} was not swept (swept: {sorted(winners)})")
        return (winners[src]["lr"] if src is not None else best_lr) * opts.get("lr_factor", 1.0)

    for opts in candidates.values():  # an lr_from that was not swept stops here, before any K-FAC run
        cand_lr(opts)
    for seed in seeds:
        if reruns:
            do(best_opt, best_lr, seed, None, f"rerun {best_opt}")
        if best_all != best_opt and reruns:
            do(best_all, winners[best_all]["lr"], seed, None, f"rerun {best_all}")
        do(best_opt, best_lr, seed, kfac_default, "kfac defaults")
        if "reduce" in kfac_rows:
            do(best_opt, best_lr, seed, kfac_reduce, "kfac reduce")
        for cname, opts in candidates.items():
            do(opts.get("optimizer", best_opt), cand_lr(opts), seed,
               candidate_kfac_options(opts), f"kfac {cname}")
        if seed in sweep_seeds and "damping" in kfac_rows:
            for d, f in grid:
                do(best_opt, best_lr * f, seed, {"log_step_time": False, "damping": d}, f"kfac damping {d:g}")

    def pick(tag: str, lr: float | None = None) -> list[dict]:
        return [r for r in runs if r["tag"] == tag and (lr is None or math.isclose(r["lr"], lr))]

    # without re-runs the winners' sweep runs stand in for them (the ratios "..._rerun" are then over those)
    rerun = summarize(w, pick(f"rerun {best_opt}")) if reruns else winners[best_opt]
    rerun_all = summarize(w, pick(f"rerun {best_all}")) if reruns else winners[best_all]
    kd = summarize(w, pick("kfac defaults"))
    main_rows = [row(f"{o} (tuned)", winners[o]["lr"], winners[o]) for o in winners]
    if reruns:
        main_rows.append(row(f"{best_opt} re-run", best_lr, rerun))
    if best_all != best_opt and reruns:
        main_rows.append(row(f"{best_all} re-run (best of all)", winners[best_all]["lr"], rerun_all))
    main_rows.append(row(f"K-FAC() on {best_opt}", best_lr, kd, default_damping(best_opt)))
    # the K-FAC rows compared with the baselines: name -> summary (ratios "kfac_<name>_over_...")
    kfac_sums: dict[str, dict] = {"defaults": kd}
    if "reduce" in kfac_rows:
        kfac_sums["reduce"] = kr = summarize(w, pick("kfac reduce"))
        main_rows.append(row(f"K-FAC(reduce) on {best_opt}", best_lr, kr, default_damping(best_opt)))
    for c, opts in candidates.items():
        kfac_sums[c] = summarize(w, pick(f"kfac {c}"))
        main_rows.append(row(f"K-FAC {c} on {opts.get('optimizer', best_opt)}", cand_lr(opts),
                             kfac_sums[c], default_damping(opts.get("optimizer", best_opt), opts)))
    damping_rows = []
    if "damping" in kfac_rows:
        for f in lr_factors:
            for d in dampings:
                rs = (pick("kfac defaults") if (d == default_damping(best_opt) and f == 1.0)
                      else pick(f"kfac damping {d:g}", best_lr * f))
                damping_rows.append({"damping": d, "lr_factor": f, "lr": best_lr * f, **summarize(w, rs),
                                     "divergent_seeds": [r["seed"] for r in rs if r["diverged"]]})
        kfac_sums["tuned"] = tuned = min(damping_rows, key=lambda s: rank_key(w, s))
        main_rows.append(row(f"K-FAC tuned (damping sweep best) on {best_opt}", tuned["lr"], tuned, tuned["damping"]))

    def ratio(a: dict, b: dict) -> float | None:
        return a["median_s"] / b["median_s"] if a["median_s"] and b["median_s"] else None

    ratios = {"kfac_defaults_over_best_baseline_sweep": ratio(kd, winners[best_opt])}
    for k, s in kfac_sums.items():
        ratios[f"kfac_{k}_over_best_baseline_rerun"] = ratio(s, rerun)
        ratios[f"kfac_{k}_over_best_overall_rerun"] = ratio(s, rerun_all)
    lines += ["-- tuned baselines and K-FAC (library defaults) on the best SGD/AdamW one"
              + ("" if reruns else " (no re-runs: ratios are over the winners' sweep runs)") + ":",
              format_table(main_rows, COLUMNS)]
    fmt = {k: (f"{v:.2f}" if v is not None else "n/a (target not reached by the median seed)") for k, v in ratios.items()}
    lines.append(f"   ratio K-FAC() / best tuned SGD/AdamW (median time to target): "
                 f"{fmt['kfac_defaults_over_best_baseline_rerun']} (vs its sweep runs: "
                 f"{fmt['kfac_defaults_over_best_baseline_sweep']}); / best of all tuned baselines ({best_all}): "
                 f"{fmt['kfac_defaults_over_best_overall_rerun']}")
    for k in list(kfac_sums)[1:]:
        lines.append(f"   ratio K-FAC {k} / baseline: {fmt[f'kfac_{k}_over_best_baseline_rerun']};"
                     f" / best of all: {fmt[f'kfac_{k}_over_best_overall_rerun']}")
    if damping_rows:
        lines.append(f"-- K-FAC damping sweep on {best_opt} (base lr x {{1/3, 1, 3}}), seeds {sweep_seeds}; diverged ="
                     " last train loss above the first, non-finite, or an error:")
        lines.append(format_table([row(f"K-FAC on {best_opt}", s["lr"], s, s["damping"]) for s in damping_rows],
                                  COLUMNS))
        div = [f"damping {s['damping']:g} lr {s['lr']:.3g}: seeds {s['divergent_seeds']}" for s in damping_rows
               if s["divergent_seeds"]]
        lines.append("   divergences: " + ("; ".join(div) if div else "none"))
    result.update(rerun=rerun, rerun_best_overall=rerun_all, kfac_defaults=kd, kfac_reduce=kfac_sums.get("reduce"),
                  kfac_tuned=kfac_sums.get("tuned"), candidates={c: kfac_sums[c] for c in candidates},
                  candidate_options=candidates, kfac_defaults_options=KFACOptions().__dict__, kfac_rows=list(kfac_rows),
                  damping_sweep=damping_rows, ratios=ratios, damping_sweep_seeds=sweep_seeds, reruns=reruns,
                  table="\n".join(lines), runs=runs)
    return result


def candidate_kfac_options(opts: dict[str, Any]) -> dict[str, Any]:
    """A --candidates entry's KFAC() keyword arguments: every key but CANDIDATE_KEYS, passed unchanged (any
    option KFAC() accepts, new ones included), with ``log_step_time`` off unless the entry sets it."""
    return {"log_step_time": False, **{k: v for k, v in opts.items() if k not in CANDIDATE_KEYS}}


def _sweep(w: Workload, lrs: dict[str, list[float]], seeds: list[int], do: Callable[..., dict],
           runs: list[dict]) -> None:
    """Run the baseline lr sweep, interleaved: seed by seed, lr index by lr index, optimizer by optimizer."""
    n_lr = max((len(v) for v in lrs.values()), default=0)
    for seed in seeds:
        for i in range(n_lr):
            for opt_name, grid in lrs.items():
                if i < len(grid):
                    do(opt_name, grid[i], seed, None, f"sweep {opt_name}")


def _rank_sweep(w: Workload, lrs: dict[str, list[float]], runs: list[dict]) -> tuple[dict, dict, dict]:
    """The sweep's summaries per optimizer and lr, the winners (lowest rank_key per optimizer) and whether each
    winner is at the edge of its grid."""
    sweep: dict[str, list[dict]] = {}
    for opt_name, grid in lrs.items():
        for lr in grid:
            rs = [r for r in runs if r["tag"] == f"sweep {opt_name}" and math.isclose(r["lr"], lr)]
            if rs:
                sweep.setdefault(opt_name, []).append({"lr": lr, **summarize(w, rs)})
    winners = {o: min(rs, key=lambda s: rank_key(w, s)) for o, rs in sweep.items()}
    edge = {o: len(sweep[o]) > 1 and any(math.isclose(winners[o]["lr"], x) for x in (sweep[o][0]["lr"], sweep[o][-1]["lr"]))
            for o in winners}
    return sweep, winners, edge


def _retarget(w: Workload, runs: list[dict]) -> None:
    """Recompute each run's time to target from its history under ``w.target``."""
    for r in runs:
        hit = next((h for h in r["history"] if w.reached(h[w.monitor])), None)
        r["reached"] = hit is not None
        r["seconds_to_target"] = _clock(hit) if hit else None
        r["epoch_to_target"] = hit["epoch"] if hit else None


def _target_from_baseline(w: Workload, lrs: dict[str, list[float]], runs: list[dict]) -> Workload:
    """``w.target_from``'s lr with the best median final metric sets the target (its median final metric over
    seeds); every run is re-scored against it (the caller re-ranks the sweep)."""
    ref = w.target_from
    finals = {lr: [r["final_metric"] for r in runs if r["tag"] == f"sweep {ref}" and math.isclose(r["lr"], lr)]
              for lr in lrs.get(ref, [])}
    medians = {lr: statistics.median(v) for lr, v in finals.items() if v and all(math.isfinite(x) for x in v)}
    if not medians:
        raise SystemExit(f"[{w.name}] no {ref} run of the sweep finished (sweep {ref}, or --baselines-from a run"
                         f" that did): no target")
    pick = min if w.mode == "min" else max
    best = pick(medians, key=lambda lr: medians[lr])
    w = dataclasses.replace(w, target=medians[best])
    _retarget(w, runs)
    return w


def median_curve(w_runs: list[dict], monitor: str) -> tuple[list[float], list[float]]:
    """Per-epoch medians over seeds of seconds and metric (epochs present in every seed's history)."""
    n = min(len(r["history"]) for r in w_runs) if w_runs else 0
    xs = [statistics.median(_clock(r["history"][i]) for r in w_runs) for i in range(n)]
    ys = [statistics.median(r["history"][i][monitor] for r in w_runs) for i in range(n)]
    return xs, ys


def _defaults_label(res: dict) -> str:
    """'K-FAC() defaults' and the defaults that run had (they changed between releases)."""
    o = res.get("kfac_defaults_options")
    if not o:
        return "K-FAC() defaults"
    return (f"K-FAC() defaults ({o['factor_approx']}, factors/inverses every "
            f"{o['factor_update_steps']}/{o['inv_update_steps']})")


def plot(results: list[dict], path: str) -> None:
    if not results:
        return
    fig, axes = pyplot().subplots(1, len(results), figsize=(5.2 * len(results), 4.2), squeeze=False)
    for ax, res in zip(axes[0], results, strict=True):
        runs, best = res["runs"], res["best_baseline"]
        curves = [(f"{o} lr {res['winners'][o]['lr']:g} (sweep)",
                   [r for r in runs if r["tag"] == f"sweep {o}" and math.isclose(r["lr"], res["winners"][o]["lr"])])
                  for o in res["winners"]]
        if best and res.get("kfac_phase", True):
            curves += [(f"{best['optimizer']} lr {best['lr']:g} (re-run)",
                        [r for r in runs if r["tag"] == f"rerun {best['optimizer']}"]),
                       (_defaults_label(res), [r for r in runs if r["tag"] == "kfac defaults"]),
                       ("K-FAC(factor_approx='reduce')", [r for r in runs if r["tag"] == "kfac reduce"])]
        for label, rs in curves:
            xs, ys = median_curve(rs, res["monitor"])
            if xs:
                ax.plot(xs, ys, marker="o", ms=3, label=label)
        ax.axhline(res["target"], color="gray", ls="--", lw=1, label=f"target {res['target']:g}")
        if res["mode"] == "min":
            ax.set_yscale("log")
        ax.set_title(f"{res['workload']}: median over seeds {res['seeds']}", fontsize=9)
        ax.set_xlabel(("CPU" if CLOCK == "cpu" else "wall-clock") + " seconds (1 thread)")
        ax.set_ylabel(res["monitor"])
        if res["mode"] == "max":
            ax.set_ylim(top=1.0)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    save_png(fig, path, dpi=120)


# --quick: one small workload, two optimizers, one seed, the workload's short budget and grids (seconds; CI runs it)
QUICK = {"workloads": "digits", "seeds": "0", "optimizers": "sgd,adamw"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = bench_parser(__doc__, quick="smoke run: " + ", ".join(f"--{k} {v}" for k, v in QUICK.items())
                     + ", short budgets, 2 lrs, a 2x2 damping grid (seconds; CI runs it)",
                     out="a fresh output folder (default: benchmarks/results/run-<stamp>-time_to_accuracy/)", threads=1)
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated subset of {','.join(WORKLOADS)}")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (init weights and data order)")
    p.add_argument("--budget", default=None,
                   help="epochs per workload: one number for all, or name=epochs,... (default: per workload)")
    p.add_argument("--baselines-from", default=None, metavar="RESULTS_JSON,...",
                   help="reuse the baseline lr sweeps of earlier results.json files (comma-separated; per optimizer "
                        "and lr the first file wins): only --optimizers they lack are swept; the winners are still "
                        "re-run beside K-FAC, interleaved")
    p.add_argument("--optimizers", default=",".join(BASELINE_OPTIMIZERS),
                   help=f"baselines to sweep (of {','.join(BASELINE_OPTIMIZERS)}); K-FAC runs on the best of sgd/adamw")
    p.add_argument("--lrs", default=None, metavar="JSON",
                   help='lr grids replacing the workloads\' own: {"muon": [0.001, 0.003], ...}')
    p.add_argument("--widen", type=int, default=2,
                   help="extend a swept grid whose winner is at its edge by one point, up to this many times")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="time to target in wall-clock seconds, or in the process's CPU seconds (a shared machine)")
    p.add_argument("--no-kfac", action="store_true",
                   help="the baseline sweeps only (a later run takes them with --baselines-from)")
    p.add_argument("--sweep-seeds", default=None,
                   help="seeds of the damping sweep (default: all of --seeds); the other rows run every seed")
    p.add_argument("--kfac-rows", default=",".join(KFAC_ROWS),
                   help="the K-FAC phase's optional rows, of reduce,damping, or none (the baseline re-runs and "
                        "K-FAC() at its defaults always run)")
    p.add_argument("--no-rerun", action="store_true",
                   help="the K-FAC phase without re-running the winning baselines beside it: K-FAC is compared with "
                        "their sweep runs (same seeds; for a machine that cannot afford the re-runs)")
    p.add_argument("--plot-from", default=None, metavar="RESULTS_JSON,...",
                   help="run nothing: plot and print the workloads of earlier results.json files into --out")
    p.add_argument("--candidates", default=None, metavar="JSON",
                   help='further K-FAC rows: {"name": {KFAC option: value, ..., "lr_factor": x, "optimizer": base, '
                        '"lr_from": swept optimizer whose winning lr lr_factor multiplies}, ...}')
    args = parse(p, argv, QUICK)
    split = lambda text: [x.strip() for x in (text or "").split(",") if x.strip()]  # noqa: E731
    args.workloads, args.optimizers = split(args.workloads), split(args.optimizers)
    args.kfac_rows = [] if args.kfac_rows.strip() in ("", "none") else split(args.kfac_rows)
    args.seeds = [int(x) for x in split(args.seeds)]
    args.sweep_seeds = [int(x) for x in split(args.sweep_seeds)] if args.sweep_seeds else None
    for flag, given, known in (("--workloads", args.workloads, WORKLOADS), ("--optimizers", args.optimizers,
                               BASELINE_OPTIMIZERS), ("--kfac-rows", args.kfac_rows, KFAC_ROWS)):
        if set(given) - set(known):
            p.error(f"{flag}: unknown {sorted(set(given) - set(known))}; known: {','.join(known)}")
    args.candidates = json.loads(args.candidates) if args.candidates else {}
    for cname, opts in args.candidates.items():
        if cname in ("defaults", "reduce", "tuned"):  # the K-FAC phase's own rows carry these names
            p.error(f"--candidates: {cname!r} names one of the K-FAC phase's own rows; give the candidate another name")
        try:  # fail now, not after hours of runs: every key but lr_factor/optimizer must be a KFAC() option
            KFAC(**candidate_kfac_options(opts))
        except (TypeError, ValueError) as e:
            p.error(f"--candidates {cname!r}: KFAC() refuses {candidate_kfac_options(opts)}: {e}")
    args.lrs = {k: [float(x) for x in v] for k, v in json.loads(args.lrs).items()} if args.lrs else None
    budget = args.budget or ""
    args.budget = ({k.strip(): int(v) for k, v in (item.split("=") for item in split(budget))} if "=" in budget
                   else dict.fromkeys(args.workloads, int(budget)) if budget else {})
    return args


def main(argv: list[str] | None = None) -> None:
    global CLOCK
    args = parse_args(argv)
    CLOCK = args.clock
    set_threads(args.threads)
    out = out_dir(args, "time_to_accuracy", empty=True)  # runs.jsonl is appended to
    if args.plot_from:
        results = []
        for path in args.plot_from.split(","):
            with open(path) as f:
                results += [r for r in json.load(f)["workloads"] if r["workload"] in args.workloads]
        plot(results, os.path.join(out, "time_to_target.png"))
        print("\n\n".join(r["table"] for r in results) + f"\n\nwrote {out}/time_to_target.png from {args.plot_from}")
        return
    quiet_lightning()
    print(f"time_to_accuracy: workloads {args.workloads}, seeds {args.seeds}, quick={args.quick}, threads "
          f"{args.threads}, out {out}", flush=True)
    payload: dict[str, Any] = {"args": vars(args), "argv": sys.argv, "env": env_info(), "workloads": []}
    t_all = time.perf_counter()
    for name in args.workloads:
        t_w = time.perf_counter()
        recorded = recorded_sweep(args.baselines_from, name) if args.baselines_from else None
        res = run_workload(WORKLOADS[name], args.seeds, args.quick,
                           args.budget.get(name) or (recorded and recorded["epochs"]), log, args.candidates,
                           recorded, args.sweep_seeds, optimizers=args.optimizers, kfac_phase=not args.no_kfac,
                           widen=0 if args.quick else args.widen, extra_lrs=args.lrs,
                           runs_log=os.path.join(out, "runs.jsonl"), kfac_rows=tuple(args.kfac_rows),
                           reruns=not args.no_rerun)
        res["wall_seconds"] = round(time.perf_counter() - t_w, 1)
        payload["workloads"].append(res)
        payload["wall_seconds"] = round(time.perf_counter() - t_all, 1)
        with open(os.path.join(out, "results.json"), "w") as f:  # after every workload: partial results survive
            json.dump(payload, f, indent=1, default=str)
        log("\n" + res["table"] + f"\n   workload wall time {res['wall_seconds']:.0f} s\n")
    plot(payload["workloads"], os.path.join(out, "time_to_target.png"))
    log("\n\n".join(r["table"] for r in payload["workloads"]))
    log(f"\nwrote {out}/results.json and {out}/time_to_target.png ({payload['wall_seconds']:.0f} s in all)")


def log(msg: str) -> None:
    print(msg, flush=True)


def quiet_lightning() -> None:
    """Lightning's per-fit chatter (hundreds of fits) off: its info logs and three warnings that say nothing here."""
    for pattern in (".*does not have many workers.*", ".*GPU available but not used.*", ".*LeafSpec.*"):
        warnings.filterwarnings("ignore", pattern)
    for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)


if __name__ == "__main__":
    main()
