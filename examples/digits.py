"""K-FAC as a Lightning callback, in plain Python (the same run as configs/digits.yaml).

    python examples/digits.py             # 8 epochs, about 5 s on a laptop CPU
    python examples/digits.py --epochs 2  # quicker
"""

import argparse

import pytorch_lightning as pl

from lightning_spdkfac import KFAC
from lightning_spdkfac.demo import DigitsCNN, DigitsDataModule, TimeToAccuracy


def main(epochs: int = 8) -> float:
    pl.seed_everything(0)
    model = DigitsCNN(lr=0.15, momentum=0.9, weight_decay=5e-4, lr_schedule="cosine")
    data = DigitsDataModule(batch_size=64, val_fraction=0.2, seed=0)
    timer = TimeToAccuracy(target=0.97)
    trainer = pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        # K-FAC preconditions the gradients of every Conv2d/Linear layer before each SGD step;
        # lr=None (the default) makes its KL clip follow the optimizer's scheduled lr.
        callbacks=[KFAC(damping=0.03, kl_clip=1e-3, factor_decay=0.95, inv_update_steps=5), timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data)

    r = timer.results
    print(f"final val acc {r['final_val_acc']:.2%} (best {r['best_val_acc']:.2%}) after {r['epochs']} epochs")
    if r["reached"]:
        print(f"reached {r['target']:.0%} at epoch {r['epoch']}, {r['seconds']:.1f} s after fit start")
    else:
        print(f"did not reach {r['target']:.0%}")
    return r["final_val_acc"]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=8)
    main(parser.parse_args().epochs)
