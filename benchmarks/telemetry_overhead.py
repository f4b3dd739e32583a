"""What the KFAC callback's step-time telemetry costs, against what K-FAC itself costs (issues 14, 16).

Run ``python benchmarks/telemetry_overhead.py`` (``--help`` for options; about a minute per repeat on one
core). It fits the digits CNN of ``configs/digits.yaml`` (model, data, seed, K-FAC hyperparameters;
``--epochs`` epochs, factors and inverses every ``--factor-update-steps`` / ``--inv-update-steps`` steps) with
a CSVLogger at Lightning's default ``log_every_n_steps`` (50), one torch thread, in these variants,
interleaved within every repeat (the order rotating from repeat to repeat):

- ``sgd``: no KFAC callback (the same optimizer, schedule and logger);
- ``kfac_off``: ``KFAC(log_step_time=False)`` (the fault counters are still logged);
- ``kfac_on``: ``KFAC(log_step_time=True)``, the default;
- ``kfac_nologger``: ``KFAC()`` with ``Trainer(logger=False)``.

Printed: the median ``trainer.fit`` seconds of each, the *overhead share* ``(t_on - t_off) / (t_off - t_sgd)``
(issue 14's target: at most 2%) and, since fit times on a busy machine move by more than that, the same share
measured directly: the seconds the callback's ``on_before_optimizer_step`` spends outside
``KFACPreconditioner.step()``, summed over the fit, ``(hook_on - hook_off) / (t_off - t_sgd)``.

Results (``summary.json`` and every run's CSV logs) go to ``--out``, a new or empty folder, by default a fresh
``benchmarks/results/run-*-telemetry_overhead/``. ``--quick``: one repeat of one epoch, no warm-up fit. The
timed code is the checkout this script lives in (its root goes first on ``sys.path``).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from _common import PhaseTimer, bench_parser, interleave, out_dir, parse, save_json, set_threads  # noqa: E402
from pytorch_lightning.loggers import CSVLogger  # noqa: E402

import lightning_spdkfac  # noqa: E402
from lightning_spdkfac import KFAC  # noqa: E402
from lightning_spdkfac.demo import DigitsCNN, DigitsDataModule  # noqa: E402

VARIANTS = ("sgd", "kfac_off", "kfac_on", "kfac_nologger")


class TimedKFAC(KFAC):
    """KFAC that sums the seconds its ``on_before_optimizer_step`` spends outside ``pre.step()``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.timer = PhaseTimer()  # "hook": the whole hook; "kfac_step": pre.step() inside it
        self.hook_calls = 0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.preconditioner is not None:
            self.preconditioner.step = self.timer.wrap("kfac_step", self.preconditioner.step)  # type: ignore

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.timer.wrap("hook", super().on_before_optimizer_step)(trainer, pl_module, optimizer)
        self.hook_calls += 1

    @property
    def kfac_step_s(self) -> float:
        return self.timer.totals.get("kfac_step", 0.0)

    @property
    def telemetry_s(self) -> float:
        return self.timer.totals.get("hook", 0.0) - self.kfac_step_s


def load_config(path: Path) -> dict:
    cfg = yaml.safe_load(path.read_text())
    kfac = cfg.get("kfac") or next(  # the kfac: group (a trainer.callbacks entry in older configs)
        c["init_args"] for c in cfg["trainer"]["callbacks"] if c["class_path"].endswith("KFAC"))
    return {"seed": cfg["seed_everything"], "model": cfg["model"]["init_args"], "data": cfg["data"]["init_args"],
            "kfac": {k: v for k, v in kfac.items() if k != "log_step_time"}}


def fit_once(variant: str, cfg: dict, args: argparse.Namespace, run_dir: Path) -> dict:
    pl.seed_everything(cfg["seed"], verbose=False)
    model_kw = dict(cfg["model"], channels=tuple(cfg["model"]["channels"]))
    model, data = DigitsCNN(**model_kw), DigitsDataModule(**cfg["data"])
    callbacks: list[pl.Callback] = []
    kfac = None
    if variant != "sgd":
        kfac = TimedKFAC(**dict(cfg["kfac"], factor_update_steps=args.factor_update_steps,
                                inv_update_steps=args.inv_update_steps, log_step_time=variant != "kfac_off"))
        callbacks.append(kfac)
    logger = False if variant == "kfac_nologger" else CSVLogger(run_dir, name="", version="")
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=args.epochs, logger=logger, log_every_n_steps=args.log_every_n_steps,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, deterministic=True,
        callbacks=callbacks, default_root_dir=run_dir,
    )
    t0 = time.perf_counter()
    trainer.fit(model, datamodule=data)
    fit_s = time.perf_counter() - t0
    out = {"fit_s": fit_s, "steps": trainer.global_step}
    if kfac is not None:
        out.update(telemetry_s=kfac.telemetry_s, kfac_step_s=kfac.kfac_step_s, hook_calls=kfac.hook_calls)
    return out


def median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if key in r]
    return statistics.median(values) if values else None


def share(extra: float | None, base: float | None) -> float | None:
    return None if extra is None or base is None or base <= 0 else extra / base


def main(argv: list[str] | None = None) -> dict:
    p = bench_parser(__doc__.split("\n")[0], threads=1, reps=3, reps_flags=("--repeats", "--reps"),
                     out="a new or empty folder (default: a fresh benchmarks/results/run-*/)")
    p.add_argument("--config", type=Path, default=REPO / "configs" / "digits.yaml")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--factor-update-steps", type=int, default=10)
    p.add_argument("--inv-update-steps", type=int, default=10)
    p.add_argument("--log-every-n-steps", type=int, default=50, help="Lightning's default: 50")
    args = parse(p, argv, quick={"reps": 1, "epochs": 1})
    if args.reps < 1 or args.epochs < 1:
        p.error("--repeats and --epochs must be >= 1")
    out = Path(out_dir(args, "telemetry_overhead", empty=True))

    set_threads(args.threads)
    logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)
    logging.getLogger("lightning_fabric").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    warnings.filterwarnings("ignore", message=".*smaller than the logging interval.*")  # 23 steps an epoch
    cfg = load_config(args.config)
    print(f"timing {Path(lightning_spdkfac.__file__).parent}; digits CNN, {args.epochs} epochs, factors every "
          f"{args.factor_update_steps} / inverses every {args.inv_update_steps} steps, log_every_n_steps "
          f"{args.log_every_n_steps}, {args.threads} torch thread(s), {args.reps} repeats; out {out}", flush=True)

    if not args.quick:
        fit_once("kfac_on", cfg, argparse.Namespace(**{**vars(args), "epochs": 1}), out / "warmup")  # imports, caches
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}

    def variant_fit(variant: str):
        def fit() -> float:
            r = len(runs[variant])
            res = fit_once(variant, cfg, args, out / f"r{r}" / variant)
            runs[variant].append(res)
            extra = f", telemetry in hook {1e3 * res['telemetry_s']:.1f} ms" if "telemetry_s" in res else ""
            print(f"repeat {r} {variant:13s} fit {res['fit_s']:.3f} s{extra}", flush=True)
            return res["fit_s"]
        return fit

    interleave({v: variant_fit(v) for v in VARIANTS}, args.reps)  # the order rotates from repeat to repeat

    t = {v: median(runs[v], "fit_s") for v in VARIANTS}
    hook = {v: median(runs[v], "telemetry_s") for v in VARIANTS}
    kfac_cost = None if t["kfac_off"] is None or t["sgd"] is None else t["kfac_off"] - t["sgd"]
    results = {
        "fit_s_median": t, "telemetry_in_hook_s_median": hook, "kfac_cost_s": kfac_cost,
        "overhead_share_fit": share(t["kfac_on"] - t["kfac_off"], kfac_cost),
        "overhead_share_hook": share(hook["kfac_on"] - hook["kfac_off"], kfac_cost),  # type: ignore[operator]
        "logging_share_vs_no_logger_fit": share(t["kfac_on"] - t["kfac_nologger"], t["kfac_nologger"] - t["sgd"]),
        "steps": runs["kfac_on"][0]["steps"], "runs": runs,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in {"repeats": args.reps, **vars(args)}.items()},
        "code": str(Path(lightning_spdkfac.__file__).parent), "torch": torch.__version__,
        "pytorch_lightning": pl.__version__,
    }
    save_json(out, "summary.json", results)

    print()
    print(f"{'variant':14s} {'median fit s':>12s} {'telemetry in hook ms':>21s}")
    for v in VARIANTS:
        h = hook[v]
        print(f"{v:14s} {t[v]:12.3f} {'-' if h is None else format(1e3 * h, '.1f'):>21s}")
    steps = results["steps"]
    if kfac_cost is not None:
        print(f"\nK-FAC cost (t_off - t_sgd): {kfac_cost:.3f} s over {steps} steps")
    for key, label in (("overhead_share_fit", "overhead share, fit times   (t_on - t_off) / (t_off - t_sgd)"),
                       ("overhead_share_hook", "overhead share, hook times  (hook_on - hook_off) / (t_off - t_sgd)"),
                       ("logging_share_vs_no_logger_fit",
                        "logger + telemetry vs no logger (t_on - t_nolog) / (t_nolog - t_sgd)")):
        v = results[key]
        print(f"{label}: {'-' if v is None else format(100 * v, '.2f') + ' %'}")
    print(f"\nsummary: {out / 'summary.json'}")
    return results


if __name__ == "__main__":
    main()
