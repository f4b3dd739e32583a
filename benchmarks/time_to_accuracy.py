"""Time to target: K-FAC with its library defaults against honestly tuned first-order baselines.

Run ``python benchmarks/time_to_accuracy.py`` (``--help`` for options; ``--quick`` for a smoke run of a
few minutes). Everything runs offline on the CPU, one torch thread by default.

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

Protocol, per workload:

1. Baseline sweep: SGD (momentum 0.9, coupled weight decay) and AdamW, each over a log grid of peak lrs,
   the same schedule for both (cosine to 0 over the budget; TinyGPT: its own warmup + cosine). The runs
   are interleaved seed by seed (seed 0: SGD lr1, AdamW lr1, SGD lr2, ...; then seed 1, ...), so a
   slow spell of the machine hits every optimizer alike.
2. The winner of each baseline is the lr with the lowest median (over seeds) time to target; a seed
   that never reaches the target counts as infinite time, and configurations whose median is infinite
   rank after the others by their median final metric. The best tuned baseline is the better of the
   two winners.
3. K-FAC phase, again interleaved seed by seed: the best baseline re-run (so that the ratio compares
   runs timed side by side), ``KFAC()`` with the library defaults on top of the best baseline's
   optimizer and lr (no K-FAC-specific tuning), ``KFAC(factor_approx="reduce")`` likewise, and a
   damping sweep (damping x base lr in {lr/3, lr, 3 lr}; its point at the library's default damping and
   the base lr is the defaults run, not run twice). The tuned-K-FAC row is the damping sweep's best
   point. ``--candidates`` adds named K-FAC configurations (the evidence for the defaults; besides K-FAC
   options an entry may set ``lr_factor``, a factor of the best baseline's lr, and ``optimizer``, the base
   optimizer), and
   ``--baselines-from`` reuses an earlier run's recorded baseline sweep (the winner is still re-run
   beside K-FAC, interleaved, and every ratio is taken against that re-run).

A run has diverged when its last training loss (epoch mean) is above its first logged one (the loss
of the first batch), when a loss or the validation metric was non-finite (the run is then stopped), or
when it raised (e.g. K-FAC's ``max_bad_steps``). Times are wall-clock seconds from just before
``trainer.fit`` to the end of each validation (one per epoch), so setup, K-FAC's included, and
validation count for every optimizer.

Output (``--out``, a fresh folder; default ``benchmarks/results/tta_<timestamp>/``): ``results.json``
with every run's per-epoch history (metric, train loss, seconds), the summaries and the printed tables;
``time_to_target.png`` with the median curve (metric against seconds) per optimizer and workload.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
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
from _common import env_info, format_table
from torch import nn

from lightning_spdkfac import KFAC
from lightning_spdkfac.demo import DigitsCNN, DigitsDataModule
from lightning_spdkfac.demo.cifar import ResNetCIFAR, SmallImagesDataModule
from lightning_spdkfac.demo.textlm import StdlibTextDataModule, TinyGPT
from lightning_spdkfac.kfac.options import KFACOptions

DEFAULT_DAMPING = KFACOptions().damping  # what KFAC() uses
DAMPINGS = (1e-4, 1e-3, 1e-2, 1e-1)
LR_FACTORS = (1 / 3, 1.0, 3.0)
# Keys of a --candidates entry that are not K-FAC options: the lr as a factor of the best baseline's, and the
# base optimizer ("sgd" or "adamw"; default: the best baseline's).
CANDIDATE_KEYS = ("lr_factor", "optimizer")


# ------------------------------------------------------------------------------ optimizers
def cosine_optimizer(module: pl.LightningModule, name: str, lr: float, weight_decay: float) -> dict[str, Any]:
    """SGD (momentum 0.9, coupled L2) or AdamW (decoupled), peak ``lr``, cosine to 0 per step over the fit."""
    params = [p for p in module.parameters() if p.requires_grad]
    opt: torch.optim.Optimizer
    if name == "sgd":
        opt = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)
    elif name == "adamw":
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    else:
        raise ValueError(f"unknown optimizer {name!r}")
    total = max(1, int(module.trainer.estimated_stepping_batches))

    def factor(step: int) -> float:
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, step / total)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


WEIGHT_DECAY = {"sgd": 5e-4, "adamw": 1e-2}  # SGD: the configs' value; AdamW: torch's default


class BenchDigitsCNN(DigitsCNN):
    """configs/digits.yaml's CNN with the optimizer chosen by the benchmark."""

    def __init__(self, opt_name: str, lr: float, seed: int = 0) -> None:
        super().__init__(lr=lr, channels=(16, 32), hidden=64)
        self.opt_name = opt_name

    def configure_optimizers(self) -> Any:
        return cosine_optimizer(self, self.opt_name, self.hparams.lr, WEIGHT_DECAY[self.opt_name])


class BenchResNet(ResNetCIFAR):
    """configs/resnet_cifar.yaml's ResNet-8 with the optimizer chosen by the benchmark."""

    def __init__(self, opt_name: str, lr: float, seed: int = 0) -> None:
        super().__init__(lr=lr, widths=(16, 32, 64), blocks=(1, 1, 1), stem_stride=1, batch_norm=True)
        self.opt_name = opt_name

    def configure_optimizers(self) -> Any:
        return cosine_optimizer(self, self.opt_name, self.hparams.lr, WEIGHT_DECAY[self.opt_name])


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

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x = batch[0].flatten(1)
        self.log("val_mse", F.mse_loss(self(x), x), on_epoch=True, batch_size=len(x))

    def configure_optimizers(self) -> Any:
        return cosine_optimizer(self, self.opt_name, self.hparams.lr, WEIGHT_DECAY[self.opt_name])


class _ShuffleSeed:
    """Mixin: the train/val split from ``seed`` 0 on every run, the shuffling from ``shuffle_seed``."""

    shuffle_seed = 0

    def train_dataloader(self):  # noqa: D102
        assert self.train_set is not None
        gen = torch.Generator().manual_seed(self.shuffle_seed)
        return torch.utils.data.DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True,
                                           generator=gen, num_workers=self.num_workers)


class DigitsData(_ShuffleSeed, DigitsDataModule):
    pass


class SmallImagesData(_ShuffleSeed, SmallImagesDataModule):
    pass


def digits_data(seed: int) -> pl.LightningDataModule:
    d = DigitsData(batch_size=64, val_fraction=0.2, seed=0)
    d.shuffle_seed = seed
    return d


def small_images_data(seed: int) -> pl.LightningDataModule:
    d = SmallImagesData(batch_size=64, val_fraction=0.2, seed=0, image_size=32, normalize=True)
    d.shuffle_seed = seed
    return d


def tinygpt(opt_name: str, lr: float, seed: int = 0) -> pl.LightningModule:
    # configs/transformer_lm*.yaml, but a plain per-token mean loss (loss_scale 1). Weight decay: the
    # AdamW config's 0.1 (decoupled) or the SGD config's 5e-4 (coupled).
    return TinyGPT(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=64, mlp_ratio=4, dropout=0.0,
                   bias=True, tie_weights=False, attention="linear", optimizer=opt_name, lr=lr,
                   weight_decay=0.1 if opt_name == "adamw" else 5e-4, momentum=0.9, betas=(0.9, 0.95),
                   warmup_steps=50, min_lr_ratio=0.1, init_seed=seed, loss_scale=1.0)


def transformer(opt_name: str, lr: float, seed: int = 0) -> pl.LightningModule:
    # Issue 18's workload: TinyGPT as people build one now, nn.MultiheadAttention, the head tied to the token
    # embedding, the plain per-token mean loss; the sizes, schedule and weight decays of ``tinygpt``.
    return TinyGPT(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=64, mlp_ratio=4, dropout=0.0,
                   bias=True, tie_weights=True, attention="mha", optimizer=opt_name, lr=lr,
                   weight_decay=0.1 if opt_name == "adamw" else 5e-4, momentum=0.9, betas=(0.9, 0.95),
                   warmup_steps=50, min_lr_ratio=0.1, init_seed=seed, loss_scale=1.0)


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

    def better(self, a: float, b: float) -> bool:
        return a > b if self.mode == "max" else a < b

    def reached(self, value: float) -> bool:
        return math.isfinite(value) and (value >= self.target if self.mode == "max" else value <= self.target)


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("digits", "digits CNN (configs/digits.yaml), val acc", BenchDigitsCNN, digits_data,
             "val_acc", "max", 0.97, budget=8,
             lrs={"sgd": [0.0125, 0.025, 0.05, 0.1, 0.2, 0.4], "adamw": [4e-3, 8e-3, 1.6e-2, 3.2e-2, 6.4e-2]},
             quick_budget=4, quick_lrs={"sgd": [0.05, 0.2], "adamw": [1e-3, 4e-3]}),
    Workload("resnet", "ResNet-8 on CIFAR-shaped digits, val acc", BenchResNet, small_images_data,
             "val_acc", "max", 0.97, budget=6,
             lrs={"sgd": [0.05, 0.1, 0.2, 0.4, 0.8], "adamw": [5e-4, 1e-3, 2e-3, 4e-3, 8e-3]},
             quick_budget=1, quick_lrs={"sgd": [0.2], "adamw": [2e-3]}),
    Workload("textlm", "TinyGPT on stdlib sources (loss_scale 1), val loss", tinygpt, text_data,
             "val_loss", "min", 2.0, budget=5,
             lrs={"sgd": [0.1, 0.3, 1.0, 3.0], "adamw": [1.5e-3, 3e-3, 6e-3, 1.3e-2]},
             quick_budget=1, quick_lrs={"sgd": [1.0], "adamw": [1.3e-2]}),
    Workload("transformer", "TinyGPT, nn.MultiheadAttention, tied embedding, per-token mean loss, val loss",
             transformer, transformer_data, "val_loss", "min", math.nan, budget=10,
             lrs={"sgd": [0.3, 1.0], "adamw": [1.5e-3, 3e-3, 6e-3, 1.2e-2]},
             quick_budget=2, quick_lrs={"sgd": [1.0], "adamw": [6e-3]}, target_from="adamw"),
    Workload("autoencoder", "MLP autoencoder 64-256-128-32-128-256-64 (tanh) on digits, val MSE",
             DigitsAutoencoder, digits_data, "val_mse", "min", 0.005, budget=30,
             lrs={"sgd": [0.03, 0.1, 0.3, 1.0, 3.0], "adamw": [3e-4, 1e-3, 3e-3, 1e-2, 3e-2]},
             quick_budget=10, quick_lrs={"sgd": [0.3, 1.0], "adamw": [1e-3, 1e-2]}),
)}


# ------------------------------------------------------------------------------ one run
class History(pl.Callback):
    """Per-epoch (metric, train loss, seconds since ``t0``); stops a run whose loss goes non-finite."""

    def __init__(self, monitor: str, t0: float) -> None:
        self.monitor = monitor
        self.t0 = t0
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
                             "seconds": round(time.perf_counter() - self.t0, 4)})
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
    t0 = time.perf_counter()
    hist = History(w.monitor, t0)
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
    seconds = next((r["seconds"] for r in h if w.reached(r[w.monitor])), None)
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
def recorded_sweep(path: str, name: str) -> dict[str, Any]:
    """The baseline sweep of workload ``name`` from an earlier results.json (``--baselines-from``)."""
    with open(path) as f:
        payload = json.load(f)
    for res in payload["workloads"]:
        if res["workload"] == name:
            return {"path": path, "sweep": res["sweep"], "winners": res["winners"],
                    "winner_at_grid_edge": res["winner_at_grid_edge"], "best_baseline": res["best_baseline"],
                    "epochs": res["epochs"], "seeds": res["seeds"]}
    raise SystemExit(f"--baselines-from {path}: no workload {name!r} in it")


def run_workload(w: Workload, seeds: list[int], quick: bool, budget: int | None, log: Callable[[str], None],
                 candidates: dict[str, dict] | None = None, recorded: dict[str, Any] | None = None,
                 sweep_seeds: list[int] | None = None) -> dict:
    candidates = candidates or {}
    sweep_seeds = seeds if sweep_seeds is None else sweep_seeds
    epochs = budget or (w.quick_budget if quick else w.budget)
    lrs = w.quick_lrs if quick else w.lrs
    dampings = (1e-3, 1e-1) if quick else DAMPINGS
    lr_factors = (1.0, 3.0) if quick else LR_FACTORS
    runs: list[dict] = []

    def do(opt_name: str, lr: float, seed: int, kfac: dict | None, tag: str) -> dict:
        r = run_one(w, opt_name, lr, seed, epochs, kfac)
        r["tag"] = tag
        runs.append(r)
        t = f"{r['seconds_to_target']:.2f}s" if r["reached"] else "not reached"
        log(f"  [{w.name}] seed {seed} {tag:<28} lr {lr:<8.3g} target: {t:<12} final {r['final_metric']:.4f}"
            f"  wall {r['wall_seconds']:.1f}s{'  DIVERGED' if r['diverged'] else ''}"
            f"{'  ' + r['error'] if r['error'] else ''}")
        return r

    # untimed warm-up (imports, allocator, first-call costs) so that the first timed run is not penalized
    run_one(w, "sgd", lrs["sgd"][0], 0, 1, None)
    run_one(w, "sgd", lrs["sgd"][0], 0, 1, {"log_step_time": False})

    # 1. baseline sweep, interleaved seed by seed and optimizer by optimizer (or a recorded one)
    if recorded is not None:
        sweep, winners, edge = recorded["sweep"], recorded["winners"], recorded["winner_at_grid_edge"]
        best_opt, best_lr = recorded["best_baseline"]["optimizer"], recorded["best_baseline"]["lr"]
        lrs = {o: [r["lr"] for r in rows] for o, rows in sweep.items()}
        log(f"  [{w.name}] baseline sweep from {recorded['path']} ({recorded['epochs']} epochs, seeds "
            f"{recorded['seeds']}); the best baseline is re-run below beside K-FAC")
    else:
        sweep, winners, edge, best_opt, best_lr = _sweep(w, lrs, seeds, do, runs)
    if w.target_from is not None:
        w, sweep, winners, edge, best_opt, best_lr = _target_from_baseline(w, lrs, runs)
        log(f"  [{w.name}] target: {w.target:.4f}, the median final {w.monitor} of tuned {w.target_from}")
    log(f"  [{w.name}] winners: " + ", ".join(f"{o} lr {winners[o]['lr']:g}" for o in winners)
        + f"; best baseline {best_opt} lr {best_lr:g}")

    # 2. K-FAC on top of the best baseline, the baseline re-run beside it, candidate configurations
    #    (--candidates), and the damping sweep
    kfac_default = {"log_step_time": False}
    kfac_reduce = {"log_step_time": False, "factor_approx": "reduce"}
    grid = [(d, f) for f in lr_factors for d in dampings if not (d == DEFAULT_DAMPING and f == 1.0)]
    for seed in seeds:
        do(best_opt, best_lr, seed, None, f"rerun {best_opt}")
        do(best_opt, best_lr, seed, kfac_default, "kfac defaults")
        do(best_opt, best_lr, seed, kfac_reduce, "kfac reduce")
        for cname, opts in candidates.items():
            do(opts.get("optimizer", best_opt), best_lr * opts.get("lr_factor", 1.0), seed,
               {"log_step_time": False, **{k: v for k, v in opts.items() if k not in CANDIDATE_KEYS}}, f"kfac {cname}")
        if seed in sweep_seeds:
            for d, f in grid:
                do(best_opt, best_lr * f, seed, {"log_step_time": False, "damping": d}, f"kfac damping {d:g}")

    def pick(tag: str, lr: float | None = None) -> list[dict]:
        return [r for r in runs if r["tag"] == tag and (lr is None or math.isclose(r["lr"], lr))]

    rerun = summarize(w, pick(f"rerun {best_opt}"))
    kd = summarize(w, pick("kfac defaults"))
    kr = summarize(w, pick("kfac reduce"))
    cand = {c: summarize(w, pick(f"kfac {c}")) for c in candidates}
    damping_rows = []
    for f in lr_factors:
        for d in dampings:
            rs = pick("kfac defaults") if (d == DEFAULT_DAMPING and f == 1.0) else pick(f"kfac damping {d:g}", best_lr * f)
            s = summarize(w, rs)
            damping_rows.append({"damping": d, "lr_factor": f, "lr": best_lr * f, **s,
                                 "divergent_seeds": [r["seed"] for r in rs if r["diverged"]]})

    # tables
    sweep_rows = [row(f"{o}{' *' if s is winners[o] else ''}", s["lr"], s) for o, rows in sweep.items() for s in rows]
    main_rows = [row(f"{o} (tuned)", winners[o]["lr"], winners[o]) for o in winners]
    main_rows.append(row(f"{best_opt} re-run", best_lr, rerun))
    main_rows.append(row(f"K-FAC() on {best_opt}", best_lr, kd, DEFAULT_DAMPING))
    main_rows.append(row(f"K-FAC(reduce) on {best_opt}", best_lr, kr, DEFAULT_DAMPING))
    for c, opts in candidates.items():
        main_rows.append(row(f"K-FAC {c} on {opts.get('optimizer', best_opt)}", best_lr * opts.get("lr_factor", 1.0), cand[c],
                             opts.get("damping", DEFAULT_DAMPING)))
    tuned = min(damping_rows, key=lambda s: rank_key(w, s))
    main_rows.append(row(f"K-FAC tuned (damping sweep best) on {best_opt}", tuned["lr"], tuned, tuned["damping"]))
    d_rows = [row(f"K-FAC on {best_opt}", s["lr"], s, s["damping"]) for s in damping_rows]

    def ratio(a: dict, b: dict) -> float | None:
        return a["median_s"] / b["median_s"] if a["median_s"] and b["median_s"] else None

    ratios = {"kfac_defaults_over_best_baseline_sweep": ratio(kd, winners[best_opt]),
              "kfac_defaults_over_best_baseline_rerun": ratio(kd, rerun),
              "kfac_reduce_over_best_baseline_rerun": ratio(kr, rerun),
              "kfac_tuned_over_best_baseline_rerun": ratio(tuned, rerun),
              **{f"kfac_{c}_over_best_baseline_rerun": ratio(cand[c], rerun) for c in candidates}}
    unit = "higher is better" if w.mode == "max" else "lower is better"
    lines = [f"== {w.name}: {w.title} {'>=' if w.mode == 'max' else '<='} {w.target:g} ({unit}), {epochs} epochs,"
             f" seeds {seeds}",
             "-- lr sweep (* = winner, lowest median time to target):", format_table(sweep_rows, COLUMNS),
             "-- tuned baselines and K-FAC (library defaults) on the best one:", format_table(main_rows, COLUMNS)]
    for o, at_edge in edge.items():
        if at_edge:
            lines.append(f"   note: the {o} winner lr {winners[o]['lr']:g} is at the edge of its grid")
    fmt = {k: (f"{v:.2f}" if v is not None else "n/a (target not reached by the median seed)") for k, v in ratios.items()}
    lines.append(f"   ratio K-FAC() / best tuned baseline (median time to target): {fmt['kfac_defaults_over_best_baseline_rerun']}"
                 f" (vs its sweep runs: {fmt['kfac_defaults_over_best_baseline_sweep']});"
                 f" K-FAC(reduce) / baseline: {fmt['kfac_reduce_over_best_baseline_rerun']};"
                 f" tuned K-FAC / baseline: {fmt['kfac_tuned_over_best_baseline_rerun']}")
    for c in candidates:
        lines.append(f"   ratio K-FAC {c} / baseline: {fmt[f'kfac_{c}_over_best_baseline_rerun']}")
    lines.append(f"-- K-FAC damping sweep on {best_opt} (base lr x {{1/3, 1, 3}}), seeds {sweep_seeds}; diverged = last"
                 " train loss above the first, non-finite, or an error:")
    lines.append(format_table(d_rows, COLUMNS))
    div = [f"damping {s['damping']:g} lr {s['lr']:.3g}: seeds {s['divergent_seeds']}" for s in damping_rows
           if s["divergent_seeds"]]
    lines.append("   divergences: " + ("; ".join(div) if div else "none"))
    return {"workload": w.name, "title": w.title, "monitor": w.monitor, "mode": w.mode, "target": w.target,
            "epochs": epochs, "lrs": lrs, "seeds": seeds, "sweep": sweep, "winners": winners,
            "winner_at_grid_edge": edge, "best_baseline": {"optimizer": best_opt, "lr": best_lr},
            "rerun": rerun, "kfac_defaults": kd, "kfac_reduce": kr, "kfac_tuned": tuned, "candidates": cand,
            "candidate_options": candidates, "baseline_sweep_from": recorded and recorded["path"],
            "kfac_defaults_options": KFACOptions().__dict__, "damping_sweep": damping_rows,
            "ratios": ratios, "damping_sweep_seeds": sweep_seeds, "table": "\n".join(lines), "runs": runs}


def _sweep(w: Workload, lrs: dict[str, list[float]], seeds: list[int], do: Callable[..., dict],
           runs: list[dict]) -> tuple[dict, dict, dict, str, float]:
    """Run the baseline lr sweep; (sweep, winners, winner-at-grid-edge, best optimizer, its lr)."""
    n_lr = max(len(v) for v in lrs.values())
    for seed in seeds:
        for i in range(n_lr):
            for opt_name, grid in lrs.items():
                if i < len(grid):
                    do(opt_name, grid[i], seed, None, f"sweep {opt_name}")
    return _rank_sweep(w, lrs, runs)


def _rank_sweep(w: Workload, lrs: dict[str, list[float]], runs: list[dict]) -> tuple[dict, dict, dict, str, float]:
    """The sweep's summaries per optimizer and lr, the winners, winner-at-grid-edge, best optimizer, its lr."""
    sweep: dict[str, list[dict]] = {}
    for opt_name, grid in lrs.items():
        for lr in grid:
            s = summarize(w, [r for r in runs if r["tag"] == f"sweep {opt_name}" and r["lr"] == lr])
            sweep.setdefault(opt_name, []).append({"lr": lr, **s})
    winners = {o: min(rows, key=lambda s: rank_key(w, s)) for o, rows in sweep.items()}
    edge = {o: winners[o]["lr"] in (lrs[o][0], lrs[o][-1]) and len(lrs[o]) > 1 for o in winners}
    best_opt = min(winners, key=lambda o: rank_key(w, winners[o]))
    return sweep, winners, edge, best_opt, winners[best_opt]["lr"]


def _retarget(w: Workload, runs: list[dict]) -> None:
    """Recompute each run's time to target from its history under ``w.target``."""
    for r in runs:
        hit = next((h for h in r["history"] if w.reached(h[w.monitor])), None)
        r["reached"] = hit is not None
        r["seconds_to_target"] = hit["seconds"] if hit else None
        r["epoch_to_target"] = hit["epoch"] if hit else None


def _target_from_baseline(w: Workload, lrs: dict[str, list[float]], runs: list[dict]
                          ) -> tuple[Workload, dict, dict, dict, str, float]:
    """``w.target_from``'s lr with the best median final metric sets the target (its median final metric over
    seeds); every sweep run is re-scored against it and the winners re-ranked by time to it."""
    ref = w.target_from
    finals = {lr: [r["final_metric"] for r in runs if r["tag"] == f"sweep {ref}" and r["lr"] == lr] for lr in lrs[ref]}
    medians = {lr: statistics.median(v) for lr, v in finals.items() if v and all(math.isfinite(x) for x in v)}
    if not medians:
        raise SystemExit(f"[{w.name}] no {ref} run of the sweep finished: no target")
    pick = min if w.mode == "min" else max
    best = pick(medians, key=lambda lr: medians[lr])
    w = dataclasses.replace(w, target=medians[best])
    _retarget(w, runs)
    return (w, *_rank_sweep(w, lrs, runs))


def median_curve(w_runs: list[dict], monitor: str) -> tuple[list[float], list[float]]:
    """Per-epoch medians over seeds of seconds and metric (epochs present in every seed's history)."""
    n = min(len(r["history"]) for r in w_runs) if w_runs else 0
    xs = [statistics.median(r["history"][i]["seconds"] for r in w_runs) for i in range(n)]
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.2 * len(results), 4.2), squeeze=False)
    for ax, res in zip(axes[0], results, strict=True):
        runs, best = res["runs"], res["best_baseline"]
        curves = [(f"{o} lr {res['winners'][o]['lr']:g} (sweep)",
                   [r for r in runs if r["tag"] == f"sweep {o}" and math.isclose(r["lr"], res["winners"][o]["lr"])])
                  for o in res["winners"]]
        curves += [(f"{best['optimizer']} lr {best['lr']:g} (re-run)", [r for r in runs if r["tag"] == f"rerun {best['optimizer']}"]),
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
        ax.set_xlabel("wall-clock seconds (1 thread)")
        ax.set_ylabel(res["monitor"])
        if res["mode"] == "max":
            ax.set_ylim(top=1.0)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workloads", default="digits,resnet,textlm,transformer,autoencoder",
                   help=f"comma-separated subset of {','.join(WORKLOADS)}")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (init weights and data order)")
    p.add_argument("--budget", default=None,
                   help="epochs per workload: one number for all, or name=epochs,... (default: per workload)")
    p.add_argument("--quick", action="store_true", help="smoke run: shorter budgets, 2 lrs, 2x2 damping grid")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="a fresh output folder (default benchmarks/results/tta_<timestamp>)")
    p.add_argument("--baselines-from", default=None, metavar="RESULTS_JSON",
                   help="skip the baseline lr sweep: take its table and winner from an earlier results.json "
                        "(the winner is still re-run beside K-FAC, interleaved)")
    p.add_argument("--sweep-seeds", default=None,
                   help="seeds of the damping sweep (default: all of --seeds); the other rows run every seed")
    p.add_argument("--plot-from", default=None, metavar="RESULTS_JSON,...",
                   help="run nothing: plot and print the workloads of earlier results.json files into --out")
    p.add_argument("--candidates", default=None, metavar="JSON",
                   help='further K-FAC rows: {"name": {KFAC option: value, ..., "lr_factor": x}, ...}')
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        p.error(f"unknown workloads {unknown}; known: {list(WORKLOADS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    budgets: dict[str, int] = {}
    if args.budget:
        if "=" in args.budget:
            for item in args.budget.split(","):
                k, v = item.split("=")
                budgets[k.strip()] = int(v)
        else:
            budgets = dict.fromkeys(names, int(args.budget))
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   time.strftime("tta_%Y%m%d_%H%M%S"))
    if os.path.exists(out) and os.listdir(out):
        p.error(f"--out {out} exists and is not empty: give a fresh folder")
    os.makedirs(out, exist_ok=True)
    if args.plot_from:
        results = []
        for path in args.plot_from.split(","):
            with open(path) as f:
                results += [r for r in json.load(f)["workloads"] if r["workload"] in names]
        plot(results, os.path.join(out, "time_to_target.png"))
        print("\n\n".join(r["table"] for r in results))
        print(f"\nwrote {out}/time_to_target.png from {args.plot_from}")
        return
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*GPU available but not used.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")  # a deprecation inside Lightning, once per fit
    import logging

    for name in ("pytorch_lightning", "lightning.pytorch", "pytorch_lightning.utilities.rank_zero",
                 "lightning.pytorch.utilities.rank_zero", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)

    def log(msg: str) -> None:
        print(msg, flush=True)

    log(f"time_to_accuracy: workloads {names}, seeds {seeds}, quick={args.quick}, threads {args.threads}, out {out}")
    payload: dict[str, Any] = {"args": vars(args), "argv": sys.argv, "env": env_info(), "workloads": []}
    results = []
    t_all = time.perf_counter()
    for name in names:
        t_w = time.perf_counter()
        recorded = recorded_sweep(args.baselines_from, name) if args.baselines_from else None
        res = run_workload(WORKLOADS[name], seeds, args.quick, budgets.get(name) or (recorded and recorded["epochs"]),
                           log, json.loads(args.candidates) if args.candidates else None, recorded,
                           [int(x) for x in args.sweep_seeds.split(",")] if args.sweep_seeds else None)
        res["wall_seconds"] = round(time.perf_counter() - t_w, 1)
        results.append(res)
        payload["workloads"].append(res)
        payload["wall_seconds"] = round(time.perf_counter() - t_all, 1)
        with open(os.path.join(out, "results.json"), "w") as f:  # after every workload: partial results survive
            json.dump(payload, f, indent=1, default=str)
        log("\n" + res["table"] + f"\n   workload wall time {res['wall_seconds']:.0f} s\n")
    plot(results, os.path.join(out, "time_to_target.png"))
    log("\n\n".join(r["table"] for r in results))
    log(f"\nwrote {out}/results.json and {out}/time_to_target.png ({payload['wall_seconds']:.0f} s in all)")


if __name__ == "__main__":
    main()
