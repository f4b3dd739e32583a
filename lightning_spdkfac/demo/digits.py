"""Digits demo pieces: a data module, a small CNN and a time-to-accuracy callback.

The data is scikit-learn's bundled ``load_digits()`` (1797 grayscale 8x8 images of the digits
0-9, shipped inside the scikit-learn wheel), so nothing is downloaded and an epoch takes well
under a second on a laptop CPU.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator, Sized
from typing import Any, Literal, cast

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.utilities import AttributeDict
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

NUM_CLASSES = 10
_NO_SKLEARN = (
    "the digits demo needs scikit-learn (its bundled 8x8 digits and the stratified split), which is not "
    "installed: pip install 'lightning-spdkfac[demo]' (or `make demo`, or pip install scikit-learn)"
)


def _sklearn(module: str) -> Any:
    """``sklearn.<module>``, or an ImportError that says which extra installs it."""
    import importlib

    try:
        return importlib.import_module(f"sklearn.{module}")
    except ModuleNotFoundError as e:
        if e.name is not None and e.name.split(".")[0] == "sklearn":
            raise ModuleNotFoundError(_NO_SKLEARN, name="sklearn") from e
        raise


def load_digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1797 digits as ``(N, 1, 8, 8)`` float32 images in [0, 1] and ``(N,)`` int64 labels."""
    digits = _sklearn("datasets").load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # pixels are 0..16
    y = torch.tensor(digits.target, dtype=torch.int64)
    return x, y


def stratified_split(
    y: torch.Tensor, val_fraction: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and validation indices with the class proportions of ``y``, deterministic in ``seed``."""
    idx = torch.arange(len(y)).numpy()
    train_idx, val_idx = _sklearn("model_selection").train_test_split(
        idx, test_size=val_fraction, stratify=y.numpy(), random_state=seed, shuffle=True
    )
    return torch.as_tensor(train_idx), torch.as_tensor(val_idx)


class EpochSeededSampler(RandomSampler):
    """A ``RandomSampler`` whose order in epoch ``e`` is a function of ``(seed, e)`` alone.

    Epoch ``e`` yields the ``(e+1)``-th pass of one stream seeded with ``seed``, so an uninterrupted fit
    sees the batches it saw before this class existed, and a fit resumed from a checkpoint continues the
    same sequence: Lightning calls :meth:`set_epoch` with the restored epoch before each epoch, and the
    sampler replays the earlier passes of its stream (index draws only) instead of restarting it.
    With ``loader_draw`` each pass is preceded by the one int64 that ``DataLoader(shuffle=True,
    generator=g)`` draws from ``g`` per epoch, so the order is exactly that loader's. Under DDP Lightning
    replaces a ``RandomSampler`` (this one included) by its ``DistributedSampler``, which is already a
    function of (seed, epoch).
    """

    def __init__(
        self,
        data_source: Sized,
        seed: int,
        replacement: bool = False,
        num_samples: int | None = None,
        loader_draw: bool = False,
    ) -> None:
        super().__init__(data_source, replacement=replacement, num_samples=num_samples)
        self.seed = seed
        self.loader_draw = loader_draw
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def _pass(self) -> Iterator[int]:
        if self.loader_draw:
            torch.empty((), dtype=torch.int64).random_(generator=self.generator)
        yield from super().__iter__()

    def __iter__(self) -> Iterator[int]:
        self.generator = torch.Generator().manual_seed(self.seed)
        for _ in range(self.epoch):  # replay the passes of the earlier epochs
            for _ in self._pass():
                pass
        yield from self._pass()


def seeded_loader(data: TensorDataset, batch_size: int, seed: int, num_workers: int) -> DataLoader:
    """The shuffling training loader of the demo data modules: epoch ``e``'s order is a function of
    ``(seed, e)`` (:class:`EpochSeededSampler`), equal to ``DataLoader(shuffle=True, generator=seed)``'s."""
    sampler = EpochSeededSampler(data, seed, loader_draw=True)
    # The loader's own generator only seeds workers; giving one keeps the global RNG untouched.
    gen = torch.Generator().manual_seed(seed)
    return DataLoader(data, batch_size=batch_size, sampler=sampler, generator=gen, num_workers=num_workers)


class DigitsDataModule(pl.LightningDataModule):
    """scikit-learn's 8x8 digits as ``(N, 1, 8, 8)`` tensors with a stratified train/val split.

    Args:
        batch_size: training batch size (validation uses the whole split in one batch).
        val_fraction: fraction of the 1797 images held out for validation, in (0, 1).
        seed: seed of the train/val split and of the training-set shuffling (the order of epoch ``e``
            is a function of ``(seed, e)``: see :class:`EpochSeededSampler`).
        num_workers: DataLoader workers (0 is fastest for this tiny in-memory data set).
    """

    def __init__(
        self, batch_size: int = 64, val_fraction: float = 0.2, seed: int = 0, num_workers: int = 0
    ) -> None:
        super().__init__()
        if batch_size <= 0:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
        self.save_hyperparameters()
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.seed = seed
        self.num_workers = num_workers
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        x, y = load_digits_tensors()
        train_idx, val_idx = stratified_split(y, self.val_fraction, self.seed)
        self.train_set = TensorDataset(x[train_idx], y[train_idx])
        self.val_set = TensorDataset(x[val_idx], y[val_idx])

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None  # built by setup(), which Lightning calls first
        # The order of epoch e depends on (seed, e) alone, so a resumed fit continues the sequence.
        return seeded_loader(self.train_set, self.batch_size, self.seed, self.num_workers)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None  # built by setup(), which Lightning calls first
        return DataLoader(self.val_set, batch_size=len(self.val_set), num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        """The held-out split again, for ``spdkfac test``: the demo data has no third split (carving one
        out would change the training set of the published runs)."""
        return self.val_dataloader()


class DigitsCNN(pl.LightningModule):
    """A small CNN for 8x8 digits, trained with SGD (momentum) and an optional LR schedule.

    ``conv(1->c1) - ReLU - conv(c1->c2) - ReLU - maxpool 2 - flatten - linear(16*c2 -> hidden) - ReLU - linear(-> 10)``

    Args:
        lr: peak learning rate of SGD.
        momentum: SGD momentum.
        weight_decay: L2 weight decay (coupled, as in ``torch.optim.SGD``).
        nesterov: use Nesterov momentum.
        lr_schedule: "cosine" (per step, from ``lr`` down to 0 at the end of ``max_epochs``),
            "step" (multiply by ``gamma`` every ``step_epochs`` epochs) or "constant".
        warmup_epochs: linear warmup from 0 over this many epochs (may be fractional; 0 = none).
        step_epochs: period of the "step" schedule, in epochs.
        gamma: factor of the "step" schedule.
        channels: output channels of the two convolutions.
        hidden: width of the hidden linear layer.
        shard: shard the model with FSDP2 in ``configure_model`` (``fully_shard`` on each layer with parameters,
            then on the whole network, over the strategy's data-parallel mesh): for
            ``ModelParallelStrategy(tensor_parallel_size=1)`` (configs/digits_fsdp2.yaml); K-FAC then runs
            owner-based on the DTensor gradients (docs/guide/fsdp.md).
    """

    def __init__(
        self,
        lr: float = 0.15,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        nesterov: bool = False,
        lr_schedule: Literal["cosine", "step", "constant"] = "cosine",
        warmup_epochs: float = 0.0,
        step_epochs: int = 5,
        gamma: float = 0.1,
        channels: tuple[int, int] = (16, 32),
        hidden: int = 64,
        shard: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.shard = shard
        c1, c2 = channels
        self.net = nn.Sequential(
            nn.Conv2d(1, c1, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(c1, c2, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(c2 * 4 * 4, hidden),
            nn.ReLU(),
            nn.Linear(hidden, NUM_CLASSES),
        )
        self.val_acc = MulticlassAccuracy(num_classes=NUM_CLASSES, average="micro")

    def configure_model(self) -> None:
        if not self.shard:
            return
        mesh = self.device_mesh
        if mesh is None or "data_parallel" not in (mesh.mesh_dim_names or ()):
            strategy = type(getattr(self._trainer, "strategy", None)).__name__
            raise ValueError(f"DigitsCNN(shard=True) shards with FSDP2 over the strategy's data-parallel mesh, and "
                             f"the strategy ({strategy}) gave none: use Trainer(strategy="
                             "ModelParallelStrategy(data_parallel_size=..., tensor_parallel_size=1)) "
                             "(configs/digits_fsdp2.yaml), or shard=False")
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(self.net, FSDPModule):  # (a second fit of the same model: sharded already)
            return
        for layer in self.net:
            if any(True for _ in layer.parameters(recurse=False)):
                fully_shard(layer, mesh=mesh["data_parallel"])
        fully_shard(self.net, mesh=mesh["data_parallel"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, batch_size=len(y), sync_dist=True)
        return loss

    def kfac_loss_parts(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[Any, Any]:
        """The training loss as a function of the outputs, for ``KFAC(step_size=..., adapt_damping=...)``."""
        x, y = batch
        return (lambda: self(x)), (lambda logits: F.cross_entropy(logits, y))

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val_loss", F.cross_entropy(logits, y), on_epoch=True, batch_size=len(y), sync_dist=True)
        self.log("val_acc", self.val_acc, on_epoch=True, batch_size=len(y))

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        # For ``spdkfac test``: the loss and accuracy on the data module's test loader (the held-out split).
        x, y = batch
        logits = self(x)
        self.log("test_loss", F.cross_entropy(logits, y), on_epoch=True, batch_size=len(y), sync_dist=True)
        self.log("test_acc", (logits.argmax(-1) == y).float().mean(), on_epoch=True, batch_size=len(y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return _sgd_with_schedule(self)


def _sgd_with_schedule(module: pl.LightningModule) -> dict[str, Any]:
    """The optimizer and LR schedule of :class:`DigitsCNN` (and of ``ResNetCIFAR``) for ``module``.

    Reads only the hyperparameters ``lr``, ``momentum``, ``weight_decay``, ``nesterov``, ``lr_schedule``,
    ``warmup_epochs``, ``step_epochs`` and ``gamma`` of ``module``, its parameters and its trainer.
    """
    h = cast(AttributeDict, module.hparams)  # what save_hyperparameters() stores
    opt = torch.optim.SGD(
        module.parameters(), lr=h.lr, momentum=h.momentum, weight_decay=h.weight_decay, nesterov=h.nesterov
    )
    trainer = module.trainer
    total = trainer.estimated_stepping_batches  # also loads the train dataloader
    if not math.isfinite(total):
        if h.lr_schedule == "cosine":
            raise ValueError("lr_schedule='cosine' needs a finite run: set trainer.max_epochs or max_steps")
        total = 0
    total = max(1, int(total))
    # (DeepSpeed calls this in its setup, where a run bounded by max_steps has not counted its batches yet: inf)
    batches = trainer.num_training_batches
    per_epoch = max(1, math.ceil(batches / trainer.accumulate_grad_batches)) if math.isfinite(batches) else total
    warmup = int(round(h.warmup_epochs * per_epoch))
    schedule, step_epochs, gamma = h.lr_schedule, h.step_epochs, h.gamma

    def factor(step: int) -> float:  # multiplier of the peak lr at optimizer step `step`
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "cosine":
            t = (step - warmup) / max(1, total - warmup)
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, t)))
        if schedule == "step":
            return gamma ** (step // (step_epochs * per_epoch))
        return 1.0

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class JSONRecord(pl.Callback):
    """Base of the run-record callbacks: keeps :attr:`results` and writes them atomically as JSON.

    Args:
        path: where to write the JSON, or None to keep it in memory only. A relative path is taken
            relative to ``trainer.default_root_dir`` (the current directory unless set), so
            ``--trainer.default_root_dir`` moves it too; with a logger, a copy of a relative path's
            file also goes to the logger's versioned folder (``trainer.log_dir``), kept per run.
            Only global rank 0 writes.
    """

    def __init__(self, path: str | None = None) -> None:
        super().__init__()
        self.path = path
        self.results: dict[str, Any] = {}
        self._t0 = 0.0

    def resolved_path(self, trainer: pl.Trainer) -> str | None:
        if self.path is None:
            return None
        path = os.path.expanduser(self.path)
        return path if os.path.isabs(path) else os.path.join(trainer.default_root_dir, path)

    def _write(self, trainer: pl.Trainer) -> None:
        path = self.resolved_path(trainer)
        if path is None or not trainer.is_global_zero:
            return
        paths = [path]
        # With a logger, a copy goes to the run's own versioned folder (lightning_logs/version_N) too:
        # `path` holds the latest run's record, the version folder keeps every run's.
        # (the logger's own log_dir: trainer.log_dir is a collective broadcast, and only rank 0 is here)
        loggers = getattr(trainer, "loggers", None)  # (a stand-in trainer may have none)
        log_dir = loggers[0].log_dir if loggers else None
        if log_dir and not os.path.isabs(os.path.expanduser(self.path or "")) and \
                os.path.abspath(log_dir) != os.path.abspath(os.path.dirname(path)):
            paths.append(os.path.join(log_dir, os.path.basename(path)))
        for out in paths:
            os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
            tmp = out + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.results, f, indent=2)
            os.replace(tmp, out)


class TimeToAccuracy(JSONRecord):
    """Record when validation accuracy first reaches a target, and the final and best accuracy.

    After every validation run of ``fit`` (the sanity check excluded) it reads ``monitor`` from
    the logged metrics. The result (also kept in :attr:`results`) is::

        {"target": 0.97, "reached": true, "epoch": 7, "seconds": 4.1, "cpu_seconds": 4.0,
         "final_val_acc": 0.98, "best_val_acc": 0.985, "best_epoch": 9, "epochs": 10,
         "total_seconds": 6.3, "history": [{"epoch": 1, "val_acc": 0.80, "seconds": 0.6}, ...]}

    ``epoch`` is 1-based; ``seconds`` is wall-clock time since fit start, validation included;
    ``cpu_seconds`` the CPU time of this process over the same span (what the demo's verdict compares: on a
    shared machine wall-clock time measures the neighbours too), ``total_cpu_seconds`` over the whole fit;
    ``epoch``, ``seconds`` and ``cpu_seconds`` are null when the target was not reached.

    Args:
        target: accuracy to reach, in (0, 1].
        path: where to write the JSON (after each validation and at fit end), or None to only
            keep it in memory. A relative path is taken relative to ``trainer.default_root_dir``
            (the current directory unless set), so ``--trainer.default_root_dir`` moves it too.
        monitor: name of the logged accuracy metric.
    """

    def __init__(self, target: float = 0.97, path: str | None = None, monitor: str = "val_acc") -> None:
        if not 0.0 < target <= 1.0:
            raise ValueError(f"target must be in (0, 1], got {target!r}")
        super().__init__(path)
        self.target = target
        self.monitor = monitor

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._t0 = time.perf_counter()
        self._cpu0 = time.process_time()
        self.results = {
            "target": self.target,
            "monitor": self.monitor,
            "reached": False,
            "epoch": None,
            "seconds": None,
            "cpu_seconds": None,
            "final_val_acc": None,
            "best_val_acc": None,
            "best_epoch": None,
            "epochs": 0,
            "total_seconds": None,
            "total_cpu_seconds": None,
            "history": [],
        }

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or not self.results:
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            raise KeyError(
                f"TimeToAccuracy: metric {self.monitor!r} was not logged; "
                f"logged: {sorted(trainer.callback_metrics)}"
            )
        acc = float(value)
        seconds = time.perf_counter() - self._t0
        epoch = trainer.current_epoch + 1
        r = self.results
        r["history"].append({"epoch": epoch, self.monitor: acc, "seconds": round(seconds, 4)})
        r["epochs"] = epoch
        r["final_val_acc"] = acc
        if r["best_val_acc"] is None or acc > r["best_val_acc"]:
            r["best_val_acc"], r["best_epoch"] = acc, epoch
        if not r["reached"] and acc >= self.target:
            r.update(reached=True, epoch=epoch, seconds=round(seconds, 4),
                     cpu_seconds=round(time.process_time() - self._cpu0, 4))
        self._write(trainer)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.results:
            return
        self.results["total_seconds"] = round(time.perf_counter() - self._t0, 4)
        self.results["total_cpu_seconds"] = round(time.process_time() - self._cpu0, 4)
        self._write(trainer)
