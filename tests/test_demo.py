"""The digits demo: data module, CNN, TimeToAccuracy, the `spdkfac` CLI with both configs, the examples.

The end-to-end test trains configs/digits.yaml (K-FAC) and configs/digits_sgd.yaml (the same run
without K-FAC) through the CLI and asserts what the demo shows, with margins that hold on any CPU:
K-FAC reaches >= 95% and gets ahead of SGD in epochs.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import yaml

from lightning_spdkfac import KFAC
from lightning_spdkfac.cli import lightning_cli, main
from lightning_spdkfac.demo import DigitsCNN, DigitsDataModule, TimeToAccuracy

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {"kfac": REPO / "configs" / "digits.yaml", "sgd": REPO / "configs" / "digits_sgd.yaml"}


def fit(config: Path, root: Path, *overrides: str) -> dict:
    """``spdkfac fit --config CONFIG`` into ``root``; TimeToAccuracy's JSON."""
    assert main(["fit", "--config", str(config), f"--trainer.default_root_dir={root}", *overrides]) == 0
    return json.loads((root / "time_to_accuracy.json").read_text())


# ----------------------------------------------------------------------------- configs and CLI
def test_configs_differ_only_by_the_kfac_callback():
    kfac, sgd = (yaml.safe_load(p.read_text()) for p in CONFIGS.values())
    assert kfac["kfac"]["damping"] == 0.03 and sgd["kfac"] is None  # the kfac: group; null = no K-FAC
    stripped = copy.deepcopy(kfac)
    for cfg in (stripped, sgd):
        cfg["trainer"].pop("default_root_dir")
        cfg.pop("kfac")
    assert stripped == sgd


@pytest.mark.parametrize("name", ["kfac", "sgd"])
def test_cli_parses_config(name, isolated):
    cli = lightning_cli(["--config", str(CONFIGS[name])], run=False)
    assert isinstance(cli.model, DigitsCNN)
    assert isinstance(cli.datamodule, DigitsDataModule)
    kinds = [type(c) for c in cli.trainer.callbacks]
    assert TimeToAccuracy in kinds
    assert (KFAC in kinds) == (name == "kfac")
    assert cli.trainer.max_epochs == 8


@pytest.mark.parametrize("name", ["kfac", "sgd"])
def test_cli_fit_one_epoch(name, isolated, tmp_path):
    r = fit(CONFIGS[name], tmp_path, "--trainer.max_epochs=1")
    assert r["epochs"] == 1 and len(r["history"]) == 1  # the sanity-check validation is not counted
    assert r["history"][0]["epoch"] == 1
    assert 0.0 <= r["final_val_acc"] <= 1.0 and r["total_seconds"] > 0
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())  # LightningCLI's SaveConfigCallback
    assert saved["trainer"]["max_epochs"] == 1
    # save_config_kwargs={"overwrite": True}: the same run directory can be reused
    fit(CONFIGS[name], tmp_path, "--trainer.max_epochs=1")


def test_cli_help_and_bad_config(isolated, capsys):
    with pytest.raises(SystemExit) as e:
        main(["fit", "--help"])
    assert e.value.code == 0
    assert "--trainer.max_epochs" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["fit", "--config", str(CONFIGS["kfac"]), "--model.init_args.lr_schedule=linear"])
    assert e.value.code != 0
    assert "lr_schedule" in capsys.readouterr().err


# ----------------------------------------------------------------------------- end to end
def _first_epoch_at(result: dict, target: float) -> float:
    return next((h["epoch"] for h in result["history"] if h["val_acc"] >= target), float("inf"))


def test_kfac_gets_ahead_of_sgd_in_epochs(isolated, tmp_path):
    """What the demo shows, asserted with margins that hold on any CPU: float results differ between CPUs
    (SIMD width, oneDNN kernels), and the epoch at which a run first crosses 97% is a knife edge: seed 0
    crossed it at epoch 3 on the Intel machine the README's table came from, and had 96.9% at epoch 3 (97%
    at 5) on an AMD EPYC. Seed 0 on the AMD EPYC: K-FAC 0.78 after epoch 1 vs SGD 0.50, 95% at epoch 2 vs 4,
    mean of epochs 1-3 0.90 vs 0.75."""
    kfac = fit(CONFIGS["kfac"], tmp_path / "kfac")
    sgd = fit(CONFIGS["sgd"], tmp_path / "sgd")
    summary = {
        name: (r["epoch"], round(r["final_val_acc"], 4), [round(h["val_acc"], 3) for h in r["history"]])
        for name, r in (("kfac", kfac), ("sgd", sgd))
    }
    assert kfac["epochs"] == sgd["epochs"] == 8, summary
    assert kfac["final_val_acc"] >= 0.95, summary
    assert kfac["reached"] and kfac["epoch"] is not None, summary  # 97% within the 8 epochs
    assert _first_epoch_at(kfac, 0.95) < _first_epoch_at(sgd, 0.95), summary
    early = [sum(h["val_acc"] for h in r["history"][:3]) / 3 for r in (kfac, sgd)]
    assert early[0] > early[1] + 0.08, summary
    assert kfac["history"][0]["val_acc"] > sgd["history"][0]["val_acc"] + 0.1, summary


# ----------------------------------------------------------------------------- pieces
def test_datamodule_split_is_stratified_and_deterministic():
    dm = DigitsDataModule(val_fraction=0.2, seed=0)
    dm.setup("fit")
    x, y = dm.train_set.tensors
    xv, yv = dm.val_set.tensors
    assert x.shape == (1437, 1, 8, 8) and xv.shape == (360, 1, 8, 8)
    assert x.dtype == torch.float32 and 0.0 <= float(x.min()) and float(x.max()) <= 1.0
    assert torch.bincount(yv, minlength=10).min() >= 35  # ~36 of each digit in validation
    again = DigitsDataModule(val_fraction=0.2, seed=0)
    again.setup("fit")
    assert torch.equal(again.val_set.tensors[1], yv) and torch.equal(again.val_set.tensors[0], xv)
    other = DigitsDataModule(val_fraction=0.2, seed=1)
    other.setup("fit")
    assert not torch.equal(other.val_set.tensors[0], xv)
    b1 = next(iter(dm.train_dataloader()))[1]
    b2 = next(iter(again.train_dataloader()))[1]
    assert torch.equal(b1, b2)  # shuffling depends on `seed` only
    with pytest.raises(ValueError, match="val_fraction"):
        DigitsDataModule(val_fraction=1.0)


class _LrRecorder(pl.Callback):
    def __init__(self):
        self.lrs = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


@pytest.mark.parametrize("schedule", ["cosine", "step", "constant"])
def test_lr_schedules(schedule, tmp_path):
    rec = _LrRecorder()
    model = DigitsCNN(lr=0.1, lr_schedule=schedule, step_epochs=2, gamma=0.5, warmup_epochs=0.5, hidden=8)
    trainer = pl.Trainer(
        max_epochs=4, limit_train_batches=4, limit_val_batches=0, callbacks=[rec], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=DigitsDataModule())
    lrs = rec.lrs
    assert len(lrs) == 16
    assert lrs[0] == pytest.approx(0.05) and lrs[1] == pytest.approx(0.1)  # 2 warmup steps
    if schedule == "cosine":
        assert all(a >= b for a, b in zip(lrs[1:], lrs[2:])) and lrs[-1] < 0.01
    elif schedule == "step":
        assert lrs[7] == pytest.approx(0.1) and lrs[8] == pytest.approx(0.05) and lrs[-1] == pytest.approx(0.05)
    else:
        assert lrs[-1] == pytest.approx(0.1)


def test_time_to_accuracy_records_first_epoch_and_skips_sanity_check(tmp_path):
    class FakeTrainer:
        sanity_checking = True
        current_epoch = 0
        callback_metrics: dict = {}
        default_root_dir = str(tmp_path)
        is_global_zero = True

    t = FakeTrainer()
    cb = TimeToAccuracy(target=0.9, path="sub/tta.json")
    cb.on_fit_start(t, None)
    t.callback_metrics = {"val_acc": torch.tensor(0.99)}
    cb.on_validation_end(t, None)  # sanity check: ignored
    t.sanity_checking = False
    for epoch, acc in enumerate([0.5, 0.95, 0.8, 0.97]):
        t.current_epoch = epoch
        t.callback_metrics = {"val_acc": torch.tensor(acc)}
        cb.on_validation_end(t, None)
    cb.on_fit_end(t, None)
    r = json.loads((tmp_path / "sub" / "tta.json").read_text())
    assert r == cb.results
    assert r["reached"] and r["epoch"] == 2 and r["seconds"] >= 0
    assert r["final_val_acc"] == pytest.approx(0.97) and r["best_val_acc"] == pytest.approx(0.97)
    assert r["best_epoch"] == 4 and r["epochs"] == 4 and len(r["history"]) == 4
    assert r["total_seconds"] >= r["seconds"]
    with pytest.raises(ValueError, match="target"):
        TimeToAccuracy(target=0.0)
    t.callback_metrics = {}
    with pytest.raises(KeyError, match="val_acc"):
        cb.on_validation_end(t, None)


# ----------------------------------------------------------------------------- examples
@pytest.mark.slow  # ~10 s each as subprocesses (make test-slow); the demo's own tests stay in the suite
@pytest.mark.parametrize("script", ["plain_pytorch.py", "digits.py"])
def test_examples_run(script):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(
        [sys.executable, str(REPO / "examples" / script), "--epochs", "2"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    accs = [float(a) for a in re.findall(r"val acc (\d+\.\d+)%", p.stdout)]
    assert accs and accs[-1] > 80.0, p.stdout


# ----------------------------------------------------------------------------- the demo driver
def test_demo_seed_table_reports_median_and_range_over_seeds():
    from lightning_spdkfac.demo.__main__ import format_seed_table, parse_args

    def run(epoch, seconds, final, total):
        return dict(target=0.97, epoch=epoch, seconds=seconds, final_val_acc=final, total_seconds=total)

    per_seed = {
        0: {"K-FAC": run(5, 3.0, 0.97, 5.0), "SGD": run(6, 1.0, 0.98, 2.0)},
        1: {"K-FAC": run(2, 1.0, 0.99, 4.0), "SGD": run(None, None, 0.95, 1.0)},
        2: {"K-FAC": run(3, 2.0, 0.98, 6.0), "SGD": run(4, 0.5, 0.96, 3.0)},
    }
    lines = format_seed_table(per_seed).splitlines()
    kfac = next(line for line in lines if line.startswith("K-FAC"))
    sgd = next(line for line in lines if line.startswith("SGD"))
    # medians with [min-max]; epochs and time over the seeds that reached the target only
    assert "98.0% [97.0%-99.0%]" in kfac and "3 of 3" in kfac and "3 [2-5]" in kfac
    assert "2.0 s [1.0 s-3.0 s]" in kfac and "5.0 s [4.0 s-6.0 s]" in kfac
    assert "96.0% [95.0%-98.0%]" in sgd and "2 of 3" in sgd and "5 [4-6]" in sgd and "0.8 s [0.5 s-1.0 s]" in sgd
    assert lines[-1] == ("epochs to 97% per seed: seed 0: K-FAC 5, SGD 6; seed 1: K-FAC 2, SGD -; "
                         "seed 2: K-FAC 3, SGD 4")
    assert "CPU time to 97%" in lines[0]  # (wall seconds stand in for a record without CPU seconds, as here)
    assert parse_args(["--seeds", "3,1"]).seeds == [3, 1] and parse_args([]).seeds == [0, 1, 2, 3, 4, 5, 6, 7]
    for bad in ("1,1", "a", "-1"):
        with pytest.raises(SystemExit):
            parse_args(["--seeds", bad])


def test_verdict_holds_only_when_every_seed_agrees_and_says_tie_otherwise():
    from lightning_spdkfac.demo.__main__ import epoch_cost_line, verdict

    def run(cpu, wall=None, epoch=3):
        return {"target": 0.97, "epoch": None if cpu is None else epoch, "seconds": wall if wall is not None else cpu,
                "cpu_seconds": cpu}

    # K-FAC faster on every seed: wins, with the median and range of the paired ratios
    wins = verdict({"K-FAC": [run(1.0), run(1.8), run(0.9)], "SGD": [run(2.0), run(2.0), run(1.0)]})
    assert wins.startswith("verdict: K-FAC wins: K-FAC/SGD time to 97% = 0.90x median over 3 seeds [0.50x to 0.90x]")
    assert "faster to 97% on every seed (3 of 3)" in wins
    assert "K-FAC loses" in verdict({"K-FAC": [run(3.0), run(1.2)], "SGD": [run(1.5), run(1.0)]})
    # the spread covers 1: a tie, whatever the median says (here 0.75x)
    tie = verdict({"K-FAC": [run(0.5), run(1.5), run(0.6)], "SGD": [run(1.0), run(1.0), run(0.8)]})
    assert tie.startswith("verdict: tie: K-FAC/SGD time to 97% = 0.75x median over 3 seeds [0.50x to 1.50x]")
    assert "K-FAC faster to 97% on 2 of 3 seeds and slower on 1" in tie
    # CPU seconds decide, not wall seconds (a neighbour slowed SGD's wall clock only)
    assert "K-FAC loses" in verdict({"K-FAC": [run(2.0, wall=2.0)], "SGD": [run(1.0, wall=5.0)]})
    assert "K-FAC wins" in verdict({"K-FAC": [run(2.0, wall=2.0)], "SGD": [run(1.0, wall=5.0)]}, clock="seconds")
    # a seed that missed counts as never; a seed both missed says nothing
    missed = verdict({"K-FAC": [run(1.0), run(None), run(None)], "SGD": [run(None), run(1.0), run(None)]})
    assert "tie" in missed and "[SGD missed 97% on 1 seed; K-FAC missed 97% on 1 seed]" in missed
    assert "on 1 of 2 seeds" in missed
    three = verdict({"K-FAC": [run(1.0), run(1.0), run(2.0)], "SGD": [run(None), run(2.0), run(1.0)]})
    assert "= 0.50x median over 3 seeds [0.50x to 2.00x; SGD missed 97% on 1 seed]" in three
    assert "K-FAC wins" in verdict({"K-FAC": [run(1.0), run(2.0)], "SGD": [run(None), run(3.0)]})
    assert "no verdict" in verdict({"K-FAC": [run(None)], "SGD": [run(None)]})
    assert "one seed has no spread" in verdict({"K-FAC": [run(1.0)], "SGD": [run(2.0)]})
    # why: epochs to the target and an epoch's CPU cost, K-FAC's over SGD's (medians over seeds)
    k = [dict(run(1.0, epoch=e), epochs=8, total_cpu_seconds=8 * c) for e, c in ((3, 0.3), (4, 0.26), (5, 0.28))]
    g = [dict(run(1.0, epoch=e), epochs=8, total_cpu_seconds=8 * 0.2) for e in (4, 5, 6)]
    assert epoch_cost_line({"K-FAC": k, "SGD": g}) == (
        "why: epochs to 97%, median over the seeds that reached it: K-FAC 4 (3 of 3 seeds), SGD 5 (3 of 3); "
        "a K-FAC epoch costs 1.40x an SGD epoch (CPU seconds, median over seeds).")
