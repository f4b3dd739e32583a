"""The ``spdkfac`` CLI takes a LightningModule of either namespace (issue 38): ``pytorch_lightning`` or the
unified ``lightning.pytorch``. The Trainer, the ``kfac`` group's callback and the ``spdkfac`` strategy names
are then the model's namespace's; the same config, the same outcome line."""

from __future__ import annotations

import re
import textwrap

import pytest

from lightning_spdkfac import cli
from lightning_spdkfac.cli import lightning_cli, main, model_namespace

pytest.importorskip("lightning", reason="the unified `lightning` package is not installed (the dev extras install it)")

NAMESPACES = ("pytorch_lightning", "lightning.pytorch")

MODULE = """
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import {namespace} as L


class Tiny(L.LightningModule):
    def __init__(self, lr: float = 0.2):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        self.lr = lr

    def training_step(self, batch, _):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class Data(L.LightningDataModule):
    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g)),
                          batch_size=8)
"""

CONFIG = """
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 3
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  strategy: {strategy}
model:
  class_path: {module}.Tiny
data:
  class_path: {module}.Data
kfac:
  inv_update_steps: 2
"""


def _write(tmp_path, monkeypatch, namespace: str, strategy: str = "auto") -> str:
    module = "cli_tiny_" + namespace.replace(".", "_")
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(MODULE.format(namespace=namespace)))
    monkeypatch.syspath_prepend(str(tmp_path))
    config = tmp_path / f"{module}.yaml"
    config.write_text(CONFIG.format(module=module, strategy=strategy))
    return str(config)


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_the_cli_builds_the_models_namespace(namespace, isolated, tmp_path, monkeypatch):
    config = _write(tmp_path, monkeypatch, namespace)
    assert model_namespace(["fit", "--config", config]) == namespace
    built = lightning_cli(["--config", config, f"--trainer.default_root_dir={tmp_path}"], run=False)
    L = __import__(namespace, fromlist=["Trainer"])
    flavour = "lightning_spdkfac.lightning.callback" if namespace == "pytorch_lightning" else "lightning_spdkfac.unified"
    assert isinstance(built.trainer, L.Trainer)
    (kfac,) = [c for c in built.trainer.callbacks if type(c).__name__ == "KFAC"]
    assert type(kfac).__module__ == flavour and isinstance(kfac, L.Callback)
    assert kfac.options.inv_update_steps == 2


@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize("strategy", ["auto", "spdkfac"])
def test_spdkfac_fit_runs_a_module_of_either_namespace(namespace, strategy, isolated, tmp_path, monkeypatch, capsys):
    config = _write(tmp_path, monkeypatch, namespace, strategy)
    assert main(["fit", "--config", config, f"--trainer.default_root_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "spdkfac fit: done after 1 epoch, 3 optimizer steps" in out, out
    assert re.search(r"K-FAC: 3 steps, [\d.]+ ms per step in K-FAC .*inverse steps 2 of 3", out), out


def test_a_model_on_the_command_line_decides_too_and_an_unknown_one_falls_back(tmp_path, monkeypatch):
    config = _write(tmp_path, monkeypatch, "lightning.pytorch")
    _write(tmp_path, monkeypatch, "pytorch_lightning")
    assert model_namespace(["fit", f"--config={config}"]) == "lightning.pytorch"
    assert model_namespace(["fit", f"--config={config}", "--model", "cli_tiny_pytorch_lightning.Tiny"]) == \
        "pytorch_lightning"
    assert model_namespace(["fit", "--model.class_path=cli_tiny_lightning_pytorch.Tiny"]) == "lightning.pytorch"
    assert model_namespace(["fit", "--model=no_such_module.Net"]) == "pytorch_lightning"  # LightningCLI says why
    with pytest.raises(ValueError, match="namespace must be one of"):
        cli.lightning_cli(["--config", config], run=False, namespace="lightning")
