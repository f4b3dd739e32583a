"""K-FAC vs AdamW on a small transformer language model (the runs of configs/transformer_lm*.yaml).

A byte-level, 4-block decoder-only transformer (TinyGPT: ``nn.MultiheadAttention``, the head tied to the
token ``nn.Embedding``, 0.22 M parameters) learns to predict the next byte of Python's own standard-library
sources, which are already on every machine (the first 2 MB of the sorted top-level ``*.py`` files; the
last 10% held out). The loss is the plain per-token mean cross-entropy. Both runs start from the same
weights, see the same batches (32 x 64 bytes), use the same AdamW at its tuned lr (0.006) and take the same
number of optimizer steps; the K-FAC run adds ``KFAC()`` at its library defaults. The script prints the
validation loss (nats per byte) every ``--val-every`` steps and at the end::

    python examples/transformer_lm.py --optimizer kfac     # AdamW + the KFAC callback (library defaults)
    python examples/transformer_lm.py --optimizer adamw    # AdamW alone
    python examples/transformer_lm.py --optimizer kfac --base sgd --lr 0.01   # SGD with momentum under K-FAC

``--optimizer kfac`` is the run of ``spdkfac fit --config configs/transformer_lm.yaml`` (bitwise, on the same
machine and threads). What K-FAC gains in wall-clock time on this model, over 3 seeds and against AdamW's lr
sweep, is measured by ``python benchmarks/time_to_accuracy.py --workloads transformer`` (README, "Time to
accuracy"). ``--attention linear`` writes attention as four ``nn.Linear`` (the same function) and
``--untied`` unties the head.
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
from lightning_spdkfac.kfac.options import KFACOptions

# Peak learning rates: AdamW's is the best of the sweep of benchmarks/time_to_accuracy.py's transformer workload
# (0.0015 / 0.003 / 0.006 / 0.012, seeds 0-2); SGD's is the former SGD config's.
DEFAULT_LR = {"sgd": 0.01, "adamw": 0.006}


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
        tie_weights=not args.untied,
        attention=args.attention,
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
        # Preconditions every attention projection, MLP layer, the tied head and the position embedding before
        # every optimizer step; lr=None (the default) makes the KL clip follow the optimizer's scheduled lr.
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
        default="adamw",
        help="optimizer under K-FAC (ignored with --optimizer adamw)",
    )
    p.add_argument("--max-steps", type=int, default=500, help="optimizer steps (also the schedule length)")
    p.add_argument("--lr", type=float, default=None, help="peak lr (default: 0.01 for sgd, 0.006 for adamw)")
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
        default=1.0,
        help="the back-propagated loss is this times the mean per-token loss (1: the plain mean)",
    )
    defaults = KFACOptions()  # the library's, as KFAC() uses them
    p.add_argument("--damping", type=lambda v: v if v == "auto" else float(v), default=defaults.damping,
                   help="a number, or auto (the default: 1e-3 under AdamW, 3e-2 under SGD)")
    p.add_argument("--kl-clip", type=float, default=defaults.kl_clip)
    p.add_argument("--factor-decay", type=float, default=defaults.factor_decay)
    p.add_argument("--factor-update-steps", type=int, default=defaults.factor_update_steps)
    p.add_argument("--inv-update-steps", type=int, default=defaults.inv_update_steps)
    p.add_argument("--attention", choices=["mha", "linear"], default="mha")
    p.add_argument("--untied", action="store_true", help="a head of its own instead of the tied token embedding")
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
