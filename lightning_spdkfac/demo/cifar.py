"""CIFAR-shaped demo pieces: a small ResNet for 3x32x32 images and two data modules that need no download.

- :class:`ResNetCIFAR`: a CIFAR-style ResNet (3x3 stem, stages of basic blocks, global average
  pool, one linear classifier), trained with SGD (momentum) and the same LR schedules as
  :class:`~lightning_spdkfac.demo.DigitsCNN`. K-FAC preconditions its ``Conv2d`` and ``Linear``
  layers; the ``BatchNorm2d`` layers are not supported by K-FAC and keep their plain gradients.
- :class:`SmallImagesDataModule`: REAL images that ship inside scikit-learn, made CIFAR-shaped.
  These are scikit-learn's 1797 8x8 handwritten digits (``load_digits``), upsampled to 32x32
  (bilinear) and repeated to 3 channels. **This is not CIFAR-10**: nothing may be downloaded
  here, so the digits stand in for it, with CIFAR's tensor shapes and 10 classes.
- :class:`SyntheticCIFARDataModule`: fixed random 3x32x32 tensors with random labels, for timing
  and smoke runs (there is nothing to learn: validation accuracy stays near chance).
"""

from __future__ import annotations

from typing import Any, Literal

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from .digits import (
    NUM_CLASSES,
    DigitsDataModule,
    _sgd_with_schedule,
    load_digits_tensors,
    seeded_loader,
    stratified_split,
)


# ------------------------------------------------------------------------------ model
class BasicBlock(nn.Module):
    """``relu(shortcut(x) + bn2(conv2(relu(bn1(conv1(x))))))``: the ResNet basic block (He et al. 2016).

    The shortcut is the identity, or a 1x1 convolution (+ BatchNorm) where the block changes the
    width or the resolution. With ``batch_norm=False`` the BatchNorms are left out and the
    convolutions get biases.
    """

    def __init__(self, cin: int, cout: int, stride: int = 1, batch_norm: bool = True) -> None:
        super().__init__()
        bias = not batch_norm
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=bias)
        self.bn1 = nn.BatchNorm2d(cout) if batch_norm else nn.Identity()
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=bias)
        self.bn2 = nn.BatchNorm2d(cout) if batch_norm else nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut: nn.Module = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=bias),
                nn.BatchNorm2d(cout) if batch_norm else nn.Identity(),
            )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(self.shortcut(x) + y)


class ResNetCIFAR(pl.LightningModule):
    """A small CIFAR-style ResNet for ``(B, 3, 32, 32)`` images, trained with SGD (momentum).

    ``conv3x3(in -> widths[0], stride stem_stride) - BN - ReLU - stage 1 - ... - stage S -
    global average pool - linear(widths[-1] -> num_classes)``. Stage ``i`` has ``blocks[i]``
    basic blocks of width ``widths[i]``; every stage after the first halves the resolution in
    its first block. ``widths=(16, 32, 64), blocks=(3, 3, 3)`` is ResNet-20 of He et al. (2016);
    the default, one block per stage, is a ResNet-8 that trains on a CPU in minutes.

    The optimizer, the LR schedules and the logged metrics (``train_loss``, ``val_loss``,
    ``val_acc``) are those of :class:`~lightning_spdkfac.demo.DigitsCNN`.

    Args:
        lr: peak learning rate of SGD.
        momentum: SGD momentum.
        weight_decay: L2 weight decay (coupled, as in ``torch.optim.SGD``; BatchNorm included).
        nesterov: use Nesterov momentum.
        lr_schedule: "cosine" (per step, from ``lr`` down to 0 at the end of ``max_epochs``),
            "step" (multiply by ``gamma`` every ``step_epochs`` epochs) or "constant".
        warmup_epochs: linear warmup from 0 over this many epochs (may be fractional; 0 = none).
        step_epochs: period of the "step" schedule, in epochs.
        gamma: factor of the "step" schedule.
        widths: channels of each stage (the stem has ``widths[0]``).
        blocks: basic blocks per stage; as many entries as ``widths``.
        stem_stride: stride of the stem convolution (1 as in CIFAR ResNets; 2 quarters the cost).
        batch_norm: BatchNorm after every convolution (K-FAC leaves the BatchNorm layers alone).
        num_classes: outputs of the classifier.
        in_channels: channels of the input images.
    """

    def __init__(
        self,
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        nesterov: bool = False,
        lr_schedule: Literal["cosine", "step", "constant"] = "cosine",
        warmup_epochs: float = 0.0,
        step_epochs: int = 5,
        gamma: float = 0.1,
        widths: tuple[int, ...] = (16, 32, 64),
        blocks: tuple[int, ...] = (1, 1, 1),
        stem_stride: int = 1,
        batch_norm: bool = True,
        num_classes: int = NUM_CLASSES,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        widths, blocks = tuple(widths), tuple(blocks)
        if not widths or len(widths) != len(blocks):
            raise ValueError(
                f"widths and blocks need one entry per stage, got widths={widths!r}, blocks={blocks!r}"
            )
        if any(w <= 0 for w in widths) or any(b <= 0 for b in blocks):
            raise ValueError(f"widths and blocks must be positive, got widths={widths!r}, blocks={blocks!r}")
        if stem_stride <= 0:
            raise ValueError(f"stem_stride must be a positive integer, got {stem_stride!r}")
        self.save_hyperparameters()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, widths[0], 3, stem_stride, 1, bias=not batch_norm),
            nn.BatchNorm2d(widths[0]) if batch_norm else nn.Identity(),
            nn.ReLU(),
        )
        stages = []
        cin = widths[0]
        for i, (width, n) in enumerate(zip(widths, blocks, strict=True)):
            stride = 1 if i == 0 else 2
            stage = [BasicBlock(cin, width, stride, batch_norm)]
            stage += [BasicBlock(width, width, 1, batch_norm) for _ in range(n - 1)]
            stages.append(nn.Sequential(*stage))
            cin = width
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(widths[-1], num_classes)
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(x.mean((2, 3)))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, batch_size=len(y), sync_dist=True)
        return loss

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
        # The optimizer and schedules of DigitsCNN: they read only hyperparameters both modules
        # share (lr, momentum, weight_decay, nesterov, lr_schedule, warmup_epochs, step_epochs,
        # gamma), self.parameters() and self.trainer.
        return _sgd_with_schedule(self)


# ------------------------------------------------------------------------------ data
def cifar_shaped_digits(size: int = 32, channels: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 1797 8x8 digits as ``(N, channels, size, size)`` images in [0, 1], and labels.

    Each image is upsampled bilinearly from 8x8 to ``size x size`` and repeated over the channels:
    real images of CIFAR's shape, NOT CIFAR-10.
    """
    x, y = load_digits_tensors()  # (N, 1, 8, 8) in [0, 1]
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False).clamp_(0.0, 1.0)
    return x.repeat(1, channels, 1, 1).contiguous(), y


class SmallImagesDataModule(DigitsDataModule):
    """Real small images without a download: scikit-learn's digits made CIFAR-shaped (NOT CIFAR-10).

    The 1797 8x8 grayscale digits bundled with scikit-learn (``load_digits``) are upsampled to
    ``image_size x image_size`` (bilinear), repeated to 3 channels and normalized with the mean and
    standard deviation of the training split, so a CIFAR model takes them unchanged. The split
    (stratified by class), the shuffling and the loaders are those of
    :class:`~lightning_spdkfac.demo.DigitsDataModule`: 1437 train / 360 validation images with
    ``val_fraction=0.2``, validation in one batch.

    Args:
        batch_size: training batch size (validation uses the whole split in one batch).
        val_fraction: fraction of the 1797 images held out for validation, in (0, 1).
        seed: seed of the train/val split and of the training-set shuffling.
        num_workers: DataLoader workers (0 is fastest for this in-memory data set).
        image_size: side of the upsampled images (32: CIFAR's).
        normalize: subtract the training split's mean and divide by its standard deviation.
    """

    def __init__(
        self,
        batch_size: int = 64,
        val_fraction: float = 0.2,
        seed: int = 0,
        num_workers: int = 0,
        image_size: int = 32,
        normalize: bool = True,
    ) -> None:
        if image_size < 8:
            raise ValueError(f"image_size must be at least 8 (the digits are 8x8), got {image_size!r}")
        super().__init__(batch_size=batch_size, val_fraction=val_fraction, seed=seed, num_workers=num_workers)
        self.image_size = image_size
        self.normalize = normalize

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        x, y = cifar_shaped_digits(self.image_size)
        train_idx, val_idx = stratified_split(y, self.val_fraction, self.seed)
        if self.normalize:
            # Statistics of the training images only (all channels are equal copies).
            train = x[train_idx]
            x = (x - train.mean()) / train.std()
        self.train_set = TensorDataset(x[train_idx], y[train_idx])
        self.val_set = TensorDataset(x[val_idx], y[val_idx])


class SyntheticCIFARDataModule(pl.LightningDataModule):
    """Fixed random ``(3, 32, 32)`` standard-normal images with uniformly random labels.

    For timing and smoke runs: the tensors are drawn once from ``seed`` (the same on every run
    and rank), and there is nothing to learn, so validation accuracy stays near ``1/num_classes``.

    Args:
        num_train: training images (``ceil(num_train / batch_size)`` steps per epoch).
        num_val: validation images.
        batch_size: batch size of both loaders.
        num_classes: labels are drawn from ``0 .. num_classes - 1``.
        image_size: side of the images.
        channels: channels of the images.
        seed: seed of the tensors and of the training-set shuffling.
        num_workers: DataLoader workers.
    """

    def __init__(
        self,
        num_train: int = 512,
        num_val: int = 128,
        batch_size: int = 32,
        num_classes: int = NUM_CLASSES,
        image_size: int = 32,
        channels: int = 3,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (("num_train", num_train), ("num_val", num_val), ("batch_size", batch_size),
                            ("num_classes", num_classes), ("image_size", image_size), ("channels", channels)):
            if value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.save_hyperparameters()
        self.num_train = num_train
        self.num_val = num_val
        self.batch_size = batch_size
        self.num_classes = num_classes
        self.image_size = image_size
        self.channels = channels
        self.seed = seed
        self.num_workers = num_workers
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        g = torch.Generator().manual_seed(self.seed)
        shape = (self.channels, self.image_size, self.image_size)
        n = self.num_train + self.num_val
        x = torch.randn(n, *shape, generator=g)
        y = torch.randint(0, self.num_classes, (n,), generator=g)
        self.train_set = TensorDataset(x[: self.num_train], y[: self.num_train])
        self.val_set = TensorDataset(x[self.num_train :], y[self.num_train :])

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None  # built by setup(), which Lightning calls first
        # The order of epoch e depends on (seed, e) alone, so a resumed fit continues the sequence.
        return seeded_loader(self.train_set, self.batch_size, self.seed, self.num_workers)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None  # built by setup(), which Lightning calls first
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        """The held-out split again, for ``spdkfac test``: the demo data has no third split (carving one
        out would change the training set of the published runs)."""
        return self.val_dataloader()
