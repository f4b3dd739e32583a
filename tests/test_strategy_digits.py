"""configs/digits_spdkfac.yaml: the digits K-FAC demo on 2 CPU processes with SPDKFACStrategy.

The end-to-end test runs ``spdkfac fit --config configs/digits_spdkfac.yaml`` exactly as a user
does, as a subprocess: that process is rank 0 and Lightning's launcher starts rank 1 itself (it
re-runs the command line). It also runs the single-process ``configs/digits.yaml`` and asserts that
the 2-process run (same global batch of 64) reaches >= 95% and lands within 2 points of it.

val_acc is a torchmetrics Accuracy logged as a Metric object, which Lightning computes at epoch end
with a sync over the ranks; the test checks that the number TimeToAccuracy wrote is indeed the
accuracy on the WHOLE validation set (not rank 0's half) by re-evaluating the saved final weights.

Both runs are started in a session of their own and the whole process group is killed afterwards,
so no rank outlives the test (pass, fail or timeout): helpers/processes.py's ``run_cli``.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml
from helpers.processes import run_cli

from lightning_spdkfac import KFAC, SPDKFACStrategy
from lightning_spdkfac.cli import lightning_cli, main
from lightning_spdkfac.demo import DigitsCNN, DigitsDataModule, TimeToAccuracy

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "digits_spdkfac.yaml"
SINGLE = REPO / "configs" / "digits.yaml"


def _val_accuracies(ckpt: Path, world: int) -> tuple[float, list[float]]:
    """Accuracy of the checkpoint's weights on the whole validation set, and on each rank's share of it.

    The shares are those of Lightning's DistributedSampler for validation (no shuffling): rank r
    gets samples r, r + world, ... (360 is divisible by 2: no padding).
    """
    model = DigitsCNN.load_from_checkpoint(ckpt, map_location="cpu").eval()
    dm = DigitsDataModule(**yaml.safe_load(CONFIG.read_text())["data"]["init_args"])
    dm.setup("fit")
    x, y = dm.val_set.tensors
    with torch.no_grad():
        hit = (model(x).argmax(1) == y).double()
    return float(hit.mean()), [float(hit[r::world].mean()) for r in range(world)]


# ----------------------------------------------------------------------------- the config
def test_config_matches_the_single_process_demo_but_strategy_devices_and_batch():
    dist_cfg, single = (yaml.safe_load(p.read_text()) for p in (CONFIG, SINGLE))
    t = dist_cfg["trainer"]
    assert t["strategy"]["class_path"] == "lightning_spdkfac.SPDKFACStrategy"
    assert t["strategy"]["init_args"]["schedule"] == "spd"
    assert t["accelerator"] == "cpu" and t["devices"] == 2
    # the global batch of configs/digits.yaml: per-process batch x processes
    assert dist_cfg["data"]["init_args"]["batch_size"] * t["devices"] == single["data"]["init_args"]["batch_size"]
    stripped = copy.deepcopy(dist_cfg)
    for key in ("strategy", "devices", "num_nodes", "default_root_dir"):
        stripped["trainer"].pop(key, None)
    stripped["data"]["init_args"].pop("batch_size")
    reference = copy.deepcopy(single)
    for key in ("devices", "default_root_dir"):
        reference["trainer"].pop(key)
    reference["data"]["init_args"].pop("batch_size")
    assert stripped == reference  # same seed, model, optimizer, schedule, K-FAC settings, callbacks


def test_config_parses_and_instantiates_the_strategy(isolated, capsys):
    with pytest.raises(SystemExit) as e:
        main(["fit", "--print_config", "--config", str(CONFIG)])
    assert e.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    strategy = printed["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_spdkfac.SPDKFACStrategy"
    assert strategy["init_args"]["schedule"] == "spd" and strategy["init_args"]["fusion"] == "dtf"

    cli = lightning_cli(["--config", str(CONFIG)], run=False)  # builds everything, launches and trains nothing
    s = cli.trainer.strategy
    assert isinstance(s, SPDKFACStrategy)
    o = s.spd_options
    assert (o.schedule, o.pipelining, o.fusion, o.placement) == ("spd", True, "dtf", "lbp_channel")
    assert (o.profile_steps, o.replan_every, o.small_factor, o.comm_dtype) == ((3, 8), None, None, "float32")
    assert s.num_processes == 2 and s.num_nodes == 1 and s.root_device.type == "cpu"
    assert cli.trainer.num_devices == 2 and cli.trainer.max_epochs == 8
    kinds = [type(c) for c in cli.trainer.callbacks]
    assert KFAC in kinds and TimeToAccuracy in kinds
    assert isinstance(cli.model, DigitsCNN) and isinstance(cli.datamodule, DigitsDataModule)
    assert cli.datamodule.batch_size == 32


# ----------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_two_processes_match_the_single_process_accuracy(tmp_path):
    dist_root, single_root = tmp_path / "spdkfac", tmp_path / "single"
    # Checkpointing on (rank 0 writes it) so that the final weights can be re-evaluated here.
    two, two_wall, err = run_cli(CONFIG, dist_root, "--trainer.enable_checkpointing=true", timeout=150)
    one, one_wall, _ = run_cli(SINGLE, single_root, timeout=90)
    summary = (
        f"2 processes: final val_acc {two['final_val_acc']:.4f} (fit {two['total_seconds']:.1f} s, "
        f"wall {two_wall:.1f} s, history {[round(h['val_acc'], 4) for h in two['history']]}); "
        f"1 process: final val_acc {one['final_val_acc']:.4f} (fit {one['total_seconds']:.1f} s, "
        f"wall {one_wall:.1f} s, history {[round(h['val_acc'], 4) for h in one['history']]})"
    )
    print(summary)

    # The run used SPDKFACStrategy on 2 ranks (config.yaml is LightningCLI's SaveConfigCallback, rank 0).
    saved = yaml.safe_load((dist_root / "config.yaml").read_text())
    assert saved["trainer"]["strategy"]["class_path"] == "lightning_spdkfac.SPDKFACStrategy", saved["trainer"]
    assert saved["trainer"]["strategy"]["init_args"]["schedule"] == "spd"
    assert saved["trainer"]["devices"] == 2 and saved["data"]["init_args"]["batch_size"] == 32
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in err and "Starting with 2 processes" in err, err[-3000:]
    assert two["epochs"] == one["epochs"] == 8, summary

    # The compared number is the accuracy on the whole validation set (torchmetrics syncs the ranks).
    ckpts = sorted(dist_root.rglob("*.ckpt"))
    assert ckpts, f"no checkpoint under {dist_root}"
    full, shares = _val_accuracies(ckpts[-1], world=2)
    assert two["final_val_acc"] == pytest.approx(full, abs=1e-6), (
        f"val_acc {two['final_val_acc']:.6f} is not the whole-set accuracy of the final weights {full:.6f} "
        f"(rank shares: {shares})"
    )

    assert two["final_val_acc"] >= 0.95, summary
    assert abs(two["final_val_acc"] - one["final_val_acc"]) <= 0.02, summary
