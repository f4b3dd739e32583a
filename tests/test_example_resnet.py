"""The CIFAR-shaped ResNet example: model, data modules, the three configs, the example script.

Smoke tests only (a few optimizer steps each): the accuracy comparison of configs/resnet_cifar.yaml
and configs/resnet_cifar_sgd.yaml takes minutes and is not run here.
"""

from __future__ import annotations

import copy
import csv
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from lightning_spdkfac import KFAC, KFACPreconditioner
from lightning_spdkfac.cli import lightning_cli, main
from lightning_spdkfac.demo import DigitsDataModule, TimeToAccuracy
from lightning_spdkfac.demo.cifar import ResNetCIFAR, SmallImagesDataModule, SyntheticCIFARDataModule

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {
    "kfac": REPO / "configs" / "resnet_cifar.yaml",
    "sgd": REPO / "configs" / "resnet_cifar_sgd.yaml",
    "synthetic": REPO / "configs" / "resnet_cifar_synthetic.yaml",
}
# A few steps and a short validation: what the smoke runs add to any config.
FEW_STEPS = ("--trainer.max_epochs=1", "--trainer.limit_train_batches=3", "--trainer.limit_val_batches=2")


def kfac_layer_names(model: nn.Module) -> set[str]:
    return {name for name, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))}


# ----------------------------------------------------------------------------- model and K-FAC
def test_model_shapes_and_arguments():
    model = ResNetCIFAR(widths=(8, 16, 32), blocks=(2, 1, 1))
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    # stem + 2 convs per block (4 blocks) + a 1x1 shortcut where the width changes (stages 2 and 3)
    assert len(convs) == 1 + 2 * 4 + 2
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) == len(convs)
    assert all(m.bias is None for m in convs)  # BatchNorm follows every convolution
    plain = ResNetCIFAR(widths=(8,), blocks=(1,), batch_norm=False, stem_stride=2, num_classes=4)
    assert plain(torch.randn(1, 3, 32, 32)).shape == (1, 4)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in plain.modules())
    for bad in (dict(widths=(8, 16), blocks=(1,)), dict(widths=(), blocks=()), dict(blocks=(1, 0, 1))):
        with pytest.raises(ValueError, match="widths and blocks"):
            ResNetCIFAR(**bad)


def test_kfac_registers_every_conv_and_linear_and_skips_batchnorm():
    # (the default ResNet-8 is checked through the KFAC callback in test_cli_fit_a_few_steps)
    blocks = (2, 2, 1)
    torch.manual_seed(0)
    model = ResNetCIFAR(widths=(8, 16, 32), blocks=blocks)
    pre = KFACPreconditioner(model, damping=0.03, lr=0.1, inv_update_steps=1)
    names = kfac_layer_names(model)
    assert len(pre.layers) == len(names) == 1 + 2 * sum(blocks) + 2 + 1  # convs + shortcuts + fc
    assert set(pre.layers) == names
    assert not pre.skipped  # BatchNorm is not a candidate at all: nothing is skipped with a reason

    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    F.cross_entropy(model(x), y).backward()
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    pre.step()
    for name, p in model.named_parameters():
        module = model.get_submodule(name.rsplit(".", 1)[0])
        if isinstance(module, nn.BatchNorm2d):
            assert torch.equal(p.grad, before[name]), name  # BatchNorm: the plain gradient
        else:
            assert torch.isfinite(p.grad).all(), name
            assert not torch.allclose(p.grad, before[name]), name  # preconditioned
    for name in names:
        a_dim = pre.layers[name].helper.a_dim
        assert pre.layers[name].A.shape == (a_dim, a_dim)
    pre.remove_hooks()


# ----------------------------------------------------------------------------- data
def test_small_images_are_the_digits_made_cifar_shaped():
    dm = SmallImagesDataModule(val_fraction=0.2, seed=0)
    dm.setup("fit")
    x, y = dm.train_set.tensors
    xv, yv = dm.val_set.tensors
    assert x.shape == (1437, 3, 32, 32) and xv.shape == (360, 3, 32, 32) and x.dtype == torch.float32
    assert torch.equal(x[:, 0], x[:, 1]) and torch.equal(x[:, 0], x[:, 2])  # gray repeated to 3 channels
    assert abs(float(x.mean())) < 1e-4 and float(x.std()) == pytest.approx(1.0, abs=1e-4)  # train statistics
    # The same split, labels and images as DigitsDataModule: its 8x8 digits, upsampled bilinearly.
    digits = DigitsDataModule(val_fraction=0.2, seed=0)
    digits.setup("fit")
    assert torch.equal(digits.val_set.tensors[1], yv) and torch.equal(digits.train_set.tensors[1], y)
    raw = SmallImagesDataModule(val_fraction=0.2, seed=0, normalize=False)
    raw.setup("fit")
    small = digits.val_set.tensors[0]
    up = F.interpolate(small, size=(32, 32), mode="bilinear", align_corners=False)
    assert torch.allclose(raw.val_set.tensors[0], up.expand(-1, 3, -1, -1), atol=1e-6)
    assert float(raw.val_set.tensors[0].min()) >= 0.0 and float(raw.val_set.tensors[0].max()) <= 1.0
    assert torch.allclose(x, (raw.train_set.tensors[0] - raw.train_set.tensors[0].mean())
                          / raw.train_set.tensors[0].std(), atol=1e-5)
    assert torch.bincount(yv, minlength=10).min() >= 35  # stratified
    b1 = next(iter(dm.train_dataloader()))
    b2 = next(iter(raw.train_dataloader()))
    assert b1[0].shape == (64, 3, 32, 32) and torch.equal(b1[1], b2[1])  # shuffling depends on the seed only
    assert len(dm.val_dataloader()) == 1
    with pytest.raises(ValueError, match="image_size"):
        SmallImagesDataModule(image_size=4)


def test_synthetic_data_is_fixed_by_the_seed():
    dm = SyntheticCIFARDataModule(num_train=40, num_val=16, batch_size=8, seed=3)
    dm.setup("fit")
    x, y = dm.train_set.tensors
    assert x.shape == (40, 3, 32, 32) and dm.val_set.tensors[0].shape == (16, 3, 32, 32)
    assert y.min() >= 0 and y.max() < 10 and len(dm.train_dataloader()) == 5 and len(dm.val_dataloader()) == 2
    again = SyntheticCIFARDataModule(num_train=40, num_val=16, batch_size=8, seed=3)
    again.setup("fit")
    assert torch.equal(again.train_set.tensors[0], x)
    assert torch.equal(again.val_set.tensors[1], dm.val_set.tensors[1])
    other = SyntheticCIFARDataModule(num_train=40, num_val=16, batch_size=8, seed=4)
    other.setup("fit")
    assert not torch.equal(other.train_set.tensors[0], x)
    with pytest.raises(ValueError, match="num_val"):
        SyntheticCIFARDataModule(num_val=0)


# ----------------------------------------------------------------------------- configs and CLI
def test_accuracy_configs_differ_only_by_the_kfac_callback_and_the_tuned_lr():
    kfac, sgd = (yaml.safe_load(CONFIGS[n].read_text()) for n in ("kfac", "sgd"))
    assert kfac["kfac"]["damping"] == 0.03 and sgd["kfac"] is None  # the kfac: group; null = no K-FAC
    # each optimizer at its own best peak lr (see the configs' comments)
    assert (kfac["model"]["init_args"]["lr"], sgd["model"]["init_args"]["lr"]) == (0.1, 0.4)
    stripped = copy.deepcopy(kfac)
    for cfg in (stripped, sgd):
        cfg["trainer"].pop("default_root_dir")
        cfg.pop("kfac")
        cfg["model"]["init_args"].pop("lr")
    assert stripped == sgd
    assert kfac["seed_everything"] == sgd["seed_everything"] == 0
    synthetic = yaml.safe_load(CONFIGS["synthetic"].read_text())
    assert synthetic["model"] == kfac["model"]  # the timing run times the same network
    assert synthetic["kfac"]["inv_update_steps"] == 5  # K-FAC on


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cli_parses_config(name, isolated):
    cli = lightning_cli(["--config", str(CONFIGS[name])], run=False)
    assert isinstance(cli.model, ResNetCIFAR)
    data = SyntheticCIFARDataModule if name == "synthetic" else SmallImagesDataModule
    assert type(cli.datamodule) is data
    kinds = [type(c) for c in cli.trainer.callbacks]
    assert TimeToAccuracy in kinds
    assert (KFAC in kinds) == (name != "sgd")
    assert tuple(cli.model.hparams.widths) == (16, 32, 64)


def _metrics_rows(root: Path) -> list[dict]:
    (path,) = root.rglob("metrics.csv")
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cli_fit_a_few_steps(name, isolated, tmp_path):
    extra = [f"--trainer.logger.init_args.save_dir={tmp_path}"] if name == "synthetic" else []
    cli = lightning_cli(
        ["fit", "--config", str(CONFIGS[name]), f"--trainer.default_root_dir={tmp_path}", *FEW_STEPS, *extra]
    )
    assert cli.trainer.global_step == 3
    r = json.loads((tmp_path / "time_to_accuracy.json").read_text())
    assert r["epochs"] == 1 and len(r["history"]) == 1 and r["total_seconds"] > 0
    assert 0.0 <= r["final_val_acc"] <= 1.0
    assert all(torch.isfinite(p).all() for p in cli.model.parameters())
    kfac = [c for c in cli.trainer.callbacks if isinstance(c, KFAC)]
    if name == "sgd":
        assert not kfac
    else:  # K-FAC stepped 3 times and holds factors for every Conv2d and Linear of the ResNet
        state = kfac[0].state_dict()
        assert state["steps"] == 3
        assert set(state["layers"]) == kfac_layer_names(cli.model)
    if name == "synthetic":  # per-step K-FAC times for the timing run
        rows = [row for row in _metrics_rows(tmp_path) if row.get("kfac/step_ms")]
        assert len(rows) == 3 and all(float(row["kfac/step_ms"]) > 0 for row in rows)


def test_cli_main_entry_point(isolated, tmp_path):
    assert main(["fit", "--config", str(CONFIGS["sgd"]), f"--trainer.default_root_dir={tmp_path}",
                 "--trainer.max_steps=2", "--trainer.limit_val_batches=0"]) == 0
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())  # LightningCLI's SaveConfigCallback
    assert saved["trainer"]["max_steps"] == 2
    assert saved["data"]["class_path"] == "lightning_spdkfac.demo.cifar.SmallImagesDataModule"


# ----------------------------------------------------------------------------- the example
@pytest.mark.slow  # ~11 s as a subprocess; the CLI fit of a few steps stays in the 10-minute suite
def test_example_script_runs(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    p = subprocess.run(
        [sys.executable, str(REPO / "examples" / "resnet_cifar.py"), "--max-steps", "3"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    m = re.search(r"K-FAC: final val acc (\d+\.\d+)% after (\d+) optimizer steps", p.stdout)
    assert m, p.stdout
    assert 0.0 <= float(m.group(1)) <= 100.0 and int(m.group(2)) == 3


def test_example_main_without_kfac(isolated, capsys):
    path = REPO / "examples" / "resnet_cifar.py"
    spec = importlib.util.spec_from_file_location("resnet_cifar_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    acc = example.main(kfac=False, max_steps=2)
    out = capsys.readouterr().out
    assert 0.0 <= acc <= 1.0
    assert f"SGD: final val acc {acc:.2%} after 2 optimizer steps" in out, out
