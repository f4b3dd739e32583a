"""K-FAC vs AdamW on a small transformer language model (the runs of configs/transformer_lm*.yaml).

A byte-level, 4-block decoder-only transformer (TinyGPT, 0.24 M parameters, 25 nn.Linear layers)
learns to predict the next byte of Python's own standard-library sources, which are already on
every machine (the first 2 MB of the sorted top-level ``*.py`` files; the last 10% held out).
Both runs start from the same weights, see the same batches (32 x 64 bytes) and take the same
number of optimizer steps; the script prints the validation loss (cross-entropy in nats per byte)
every 100 steps and at the end::

    python examples/transformer_lm.py --optimizer kfac     # SGD with momentum + the KFAC callback
    python examples/transformer_lm.py --optimizer adamw    # AdamW, no K-FAC
    python examples/transformer_lm.py --optimizer kfac --max-steps 100   # quicker

About 45 s (K-FAC) and 30 s (AdamW) for 500 steps on 2 idle CPU cores (a few minutes on a busy
one). The defaults are those of the two configs: ``--optimizer kfac`` is the same run as
``spdkfac fit --config configs/transformer_lm.yaml`` (bitwise, on the same machine and threads).

What it shows (CPython 3.11.7, torch 2.13, 2 threads, 500 steps, final val loss):

- K-FAC + SGD (damping 0.01, kl_clip 3e-4, lr 0.01): **1.646** (seeds 1, 2: 1.664, 1.628).
- AdamW at its best lr 0.013: **1.853** (seeds 1, 2: 2.220, 2.142; lr 0.006 is steadier over
  seeds: 1.898, 1.907, 1.946). So K-FAC is lower at equal steps by about 0.2 nats/byte.
- But a K-FAC step costs about 1.6x an AdamW step here: at equal wall time AdamW gets 800 steps
  and reaches 1.642 (``--optimizer adamw --max-steps 800``), the same as K-FAC.
- ``--loss-scale`` matters to K-FAC: the one ``damping`` is added to both Kronecker factors, and
  with the mean loss per token the G factor is ``1/block_size`` of the per-sequence one, far below
  A. With ``--loss-scale 1`` the same K-FAC settings end at 2.517, and the best of two tries at
  1.980 (damping 0.03, kl_clip 1e-3, lr 0.1), worse than AdamW; AdamW does not care (1.861).
- ``--base adamw`` feeds the K-FAC-preconditioned gradients to AdamW instead of SGD (a hybrid):
  1.645 with damping 0.03, kl_clip 1e-3, lr 0.003.

The K-FAC sweep at seed 0 (``--damping D --kl-clip K --lr L``, final val loss):

    damping  kl_clip   lr 0.003   lr 0.01
    0.01     3e-4      1.689      1.646  <- the config
    0.01     1e-3      1.983      1.911
    0.01     3e-3      2.286      11.46 (diverged)
    0.03     3e-4      1.756      1.742
    0.03     1e-3      1.657      1.673
    0.03     3e-3      1.797      1.684
    0.1      3e-4      2.033      1.995
    0.1      1e-3      1.951      1.824
    0.1      3e-3      1.747      1.700

AdamW (``--optimizer adamw --lr L``): 0.001 2.197, 0.003 1.981, 0.006 1.898, 0.0075 1.871,
0.01 1.861, 0.013 1.853, 0.02 2.312, 0.03 2.353, 0.05 2.451. The KL clip is active at every step
of the K-FAC run (its factor nu stays between 0.02 and 0.23), so for the K-FAC layers
lr * nu = sqrt(kl_clip / |<P, g>|) does not depend on the lr: the warmup and the cosine act only
on the embeddings and LayerNorms.
"""

from __future__ import annotations

import argparse
import json
import logging
import warnings

import pytorch_lightning as pl
import torch

from lightning_spdkfac import KFAC
from lightning_spdkfac.demo.textlm import LossHistory, StdlibTextDataModule, TinyGPT

# Peak learning rates of the two configs (each the best of its sweep at 500 steps).
DEFAULT_LR = {"sgd": 0.01, "adamw": 0.013}


def main(args: argparse.Namespace) -> float:
    torch.set_num_threads(args.threads)
    pl.seed_everything(args.seed, verbose=False)
    kfac = args.optimizer == "kfac"
    base = args.base if kfac else "adamw"
    lr = args.lr if args.lr is not None else DEFAULT_LR[base]
    model = TinyGPT(
        block_size=args.block_size,
        n_layer=4,
        n_head=4,
        n_embd=64,
        mlp_ratio=4,
        optimizer=base,
        lr=lr,
        weight_decay=args.weight_decay,
        momentum=0.9,
        warmup_steps=args.warmup_steps,
        min_lr_ratio=0.1,
        init_seed=args.seed,
        loss_scale=args.loss_scale,
    )
    data = StdlibTextDataModule(
        block_size=args.block_size,
        batch_size=args.batch_size,
        max_bytes=2_000_000,
        seed=args.seed,
        val_fraction=0.1,
        val_windows=256,
        batches_per_epoch=args.val_every,
    )
    history = LossHistory(path=None)
    callbacks: list[pl.Callback] = [history]
    if kfac:
        # Preconditions the gradients of all 25 nn.Linear layers before every optimizer step; lr=None
        # (the default) makes the KL clip follow the optimizer's scheduled lr.
        callbacks.insert(
            0,
            KFAC(
                damping=args.damping,
                factor_decay=args.factor_decay,
                kl_clip=args.kl_clip,
                factor_update_steps=args.factor_update_steps,
                inv_update_steps=args.inv_update_steps,
                log_step_time=False,
            ),
        )
    trainer = pl.Trainer(
        max_steps=args.max_steps,
        max_epochs=-1,
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        deterministic=True,
        default_root_dir=args.root,
    )
    trainer.fit(model, datamodule=data)

    r = history.results
    name = f"K-FAC ({base} base, damping {args.damping}, kl_clip {args.kl_clip})" if kfac else "AdamW"
    for h in r["history"]:
        print(f"step {h['step']:5d}  val loss {h['val_loss']:.4f}  ({h['seconds']:.0f} s)")
    print(
        f"{name}, lr {lr}: final val loss {r['final_val_loss']:.4f} nats/byte after {r['steps']} steps "
        f"({r['total_seconds']:.0f} s)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "lr": lr, **r}, f, indent=2)
    return r["final_val_loss"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--optimizer", choices=["kfac", "adamw"], default="kfac")
    p.add_argument(
        "--base",
        choices=["sgd", "adamw"],
        default="sgd",
        help="optimizer under K-FAC (ignored with --optimizer adamw)",
    )
    p.add_argument("--max-steps", type=int, default=500, help="optimizer steps (also the schedule length)")
    p.add_argument("--lr", type=float, default=None, help="peak lr (default: 0.01 for sgd, 0.013 for adamw)")
    p.add_argument(
        "--weight-decay",
        type=float,
        default=None,
        help="default: 0.1 for adamw (decoupled), 5e-4 for sgd (L2)",
    )
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument(
        "--loss-scale",
        type=float,
        default=64.0,
        help="the back-propagated loss is this times the mean per-token loss (64: per-sequence sum)",
    )
    p.add_argument("--damping", type=float, default=0.01)
    p.add_argument("--kl-clip", type=float, default=0.0003)
    p.add_argument("--factor-decay", type=float, default=0.95)
    p.add_argument("--factor-update-steps", type=int, default=1)
    p.add_argument("--inv-update-steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--val-every", type=int, default=100, help="validate every this many steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--root", default="demo_runs/transformer_lm_example", help="Trainer default_root_dir")
    p.add_argument("--json", default=None, help="also write the history to this JSON file")
    args = p.parse_args(argv)
    if args.weight_decay is None:
        base = args.base if args.optimizer == "kfac" else "adamw"
        args.weight_decay = 0.1 if base == "adamw" else 5e-4
    return args


if __name__ == "__main__":
    logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    main(parse_args())
