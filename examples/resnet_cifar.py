"""K-FAC on a small ResNet with CIFAR-shaped inputs, in plain Python (the run of configs/resnet_cifar.yaml).

    python examples/resnet_cifar.py                 # K-FAC, 6 epochs, about 1-2 minutes on one CPU thread
    python examples/resnet_cifar.py --no-kfac       # plain SGD at its best lr (configs/resnet_cifar_sgd.yaml)
    python examples/resnet_cifar.py --max-steps 3   # a smoke run: 3 optimizer steps, then one validation

It trains ResNetCIFAR (a ResNet-8: 3x3 stem, three stages of one basic block with BatchNorm, 16/32/64
channels) with SGD + momentum and a cosine lr schedule, with or without the KFAC callback, and prints
the final validation accuracy and when it first reached 98%. K-FAC preconditions the gradients of the
8 Conv2d layers and the Linear classifier; the BatchNorm layers keep their plain gradients. The
images are NOT CIFAR-10 (nothing is downloaded): they are scikit-learn's bundled 8x8 digits,
upsampled to 32x32 and repeated to 3 channels (SmallImagesDataModule), so an epoch is 23 steps.
"""

from __future__ import annotations

import argparse

import pytorch_lightning as pl
import torch

from lightning_spdkfac import KFAC
from lightning_spdkfac.demo import TimeToAccuracy
from lightning_spdkfac.demo.cifar import ResNetCIFAR, SmallImagesDataModule


def main(kfac: bool = True, epochs: int = 6, max_steps: int = -1, lr: float | None = None) -> float:
    """Train, print the final validation accuracy and return it (in [0, 1])."""
    pl.seed_everything(0)
    if lr is None:  # each optimizer's best peak lr, as in the two configs (see their comments)
        lr = 0.1 if kfac else 0.4
    model = ResNetCIFAR(
        lr=lr, momentum=0.9, weight_decay=5e-4, lr_schedule="cosine",
        widths=(16, 32, 64), blocks=(1, 1, 1),
    )
    data = SmallImagesDataModule(batch_size=64, val_fraction=0.2, seed=0)
    timer = TimeToAccuracy(target=0.98)
    callbacks: list[pl.Callback] = [timer]
    if kfac:
        # Preconditions every Conv2d/Linear gradient before each SGD step; lr=None (the default)
        # makes the KL clip follow the optimizer's scheduled lr.
        callbacks.insert(0, KFAC(damping=0.03, kl_clip=1e-3, factor_decay=0.95, inv_update_steps=5,
                                 log_step_time=False))
    trainer = pl.Trainer(
        max_epochs=epochs,
        max_steps=max_steps,  # -1: no limit (the cosine schedule then spans max_epochs)
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data)

    name = "K-FAC" if kfac else "SGD"
    r = timer.results
    if r["epochs"]:
        print(f"{name}: best val acc {r['best_val_acc']:.2%} at epoch {r['best_epoch']} of {r['epochs']}, "
              f"fit {r['total_seconds']:.1f} s")
        if r["reached"]:
            print(f"{name}: reached {r['target']:.0%} at epoch {r['epoch']}, "
                  f"{r['seconds']:.1f} s after fit start")
        else:
            print(f"{name}: did not reach {r['target']:.0%}")
        acc = r["final_val_acc"]
    else:  # stopped by --max-steps before the first epoch ended: validate the weights once
        acc = float(trainer.validate(model, datamodule=data, verbose=False)[0]["val_acc"])
    print(f"{name}: final val acc {acc:.2%} after {trainer.global_step} optimizer steps")
    return acc


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kfac", action=argparse.BooleanOptionalAction, default=True,
                        help="precondition with K-FAC (--no-kfac: plain SGD)")
    parser.add_argument("--epochs", type=int, default=6,
                        help="epochs (also the length of the cosine schedule)")
    parser.add_argument("--max-steps", type=int, default=-1, help="stop after this many optimizer steps")
    parser.add_argument("--lr", type=float, default=None,
                        help="peak lr of SGD (default: 0.1 with K-FAC, 0.4 without)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    main(kfac=args.kfac, epochs=args.epochs, max_steps=args.max_steps, lr=args.lr)
