"""What the KFAC callback logs, drawn: a short digits fit with a CSVLogger, its K-FAC timing curves.

Runs the demo's digits CNN with ``KFAC`` (factors every step, inverses every ``--inv-update-steps``) for
``--epochs`` epochs with ``log_every_n_steps=--log-every``, reads the CSVLogger's ``metrics.csv`` and plots,
against the optimizer step:

- ``kfac/step_ms`` (mean over the steps since the previous write) and ``kfac/step_ms_max`` (their max):
  the K-FAC step, whose inverse steps are the spikes the max shows and the mean averages in;
- ``kfac/inverse_step_share``: the fraction of those steps that recomputed inverses (read the mean
  against it: with inverses every 7 steps and a window of 10 steps it is 0.1 or 0.2, and the mean follows).

    python benchmarks/telemetry_plot.py             # fresh benchmarks/results/run-*-telemetry_plot/
    python benchmarks/telemetry_plot.py --refresh   # the committed docs/telemetry.png (README)
    python benchmarks/telemetry_plot.py --out DIR   # into DIR
    python benchmarks/telemetry_plot.py --quick     # one epoch (seconds)
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import warnings

from _common import DOCS, bench_parser, out_dir, parse, pyplot, save_png, set_threads

CURVES = ("kfac/step_ms", "kfac/step_ms_max", "kfac/inverse_step_share", "kfac/steps_in_window")


def fit(folder: str, args: argparse.Namespace) -> str:
    """Run the fit; the path of its metrics.csv."""
    import pytorch_lightning as pl
    from pytorch_lightning.loggers import CSVLogger

    from lightning_spdkfac import KFAC
    from lightning_spdkfac.demo import DigitsCNN, DigitsDataModule

    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    set_threads(args.threads)
    pl.seed_everything(0, verbose=False)
    logger = CSVLogger(folder, name="fit", version=0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=args.epochs, logger=logger, log_every_n_steps=args.log_every,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[KFAC(factor_update_steps=1, inv_update_steps=args.inv_update_steps)],
    )
    trainer.fit(DigitsCNN(), datamodule=DigitsDataModule(batch_size=32))
    return os.path.join(logger.log_dir, "metrics.csv")


def read_curves(path: str) -> dict[str, list[tuple[int, float]]]:
    """(step, value) per logged K-FAC curve, from a CSVLogger's metrics.csv (empty cells skipped)."""
    curves: dict[str, list[tuple[int, float]]] = {name: [] for name in CURVES}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            for name in CURVES:
                if row.get(name):
                    curves[name].append((int(row["step"]), float(row[name])))
    return curves


def plot(curves: dict[str, list[tuple[int, float]]], path: str, args: argparse.Namespace) -> None:
    plt = pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5.2), sharex=True, height_ratios=(2.2, 1))
    for name, style, label in (("kfac/step_ms_max", "-", "kfac/step_ms_max (slowest step of the window)"),
                               ("kfac/step_ms", "-", "kfac/step_ms (mean of the window)")):
        pts = curves[name]
        top.plot([s for s, _ in pts], [v for _, v in pts], style, marker="o", ms=3, label=label)
    top.set_ylabel("K-FAC step (ms)")
    top.set_yscale("log")
    top.legend(loc="upper right", fontsize=8)
    top.set_title(f"KFAC callback logs: digits CNN, factors every step, inverses every {args.inv_update_steps} "
                  f"steps, log_every_n_steps={args.log_every}", fontsize=9)
    pts = curves["kfac/inverse_step_share"]
    bottom.step([s for s, _ in pts], [v for _, v in pts], where="mid", color="tab:green")
    bottom.set_ylabel("inverse_step_share")
    bottom.set_ylim(0, max(0.5, max((v for _, v in pts), default=0) * 1.2))
    bottom.set_xlabel("optimizer step (Lightning's row)")
    fig.tight_layout()
    save_png(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, threads=1, refresh="write the committed docs/telemetry.png")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--log-every", type=int, default=10, help="Trainer(log_every_n_steps=...)")
    p.add_argument("--inv-update-steps", type=int, default=7)
    args = parse(p, argv, quick={"epochs": 1})
    folder = out_dir(args, "telemetry_plot")  # the CSV logs (never into docs/, even with --refresh)
    curves = read_curves(fit(folder, args))
    for name in CURVES:
        vals = [v for _, v in curves[name]]
        if not vals:
            print(f"{name}: not logged", file=sys.stderr)
            return 1
        print(f"{name:26s} {len(vals):3d} rows  min {min(vals):8.3f}  max {max(vals):8.3f}")
    png = os.path.join(DOCS if args.refresh and not args.out else folder, "telemetry.png")
    plot(curves, png, args)
    print(f"wrote {png} (metrics.csv in {folder})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
