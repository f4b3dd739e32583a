"""configs/digits_deepspeed.yaml: the digits K-FAC demo on DeepSpeed ZeRO-2, bf16, 2 CPU processes.

Run end to end exactly as a user does (``spdkfac fit --config ...`` as a subprocess that Lightning's
launcher turns into 2 ranks), with the process-group hygiene of helpers/processes.py's ``run_cli``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytest.importorskip("deepspeed")

from helpers.processes import run_cli  # noqa: E402

from lightning_spdkfac import KFAC, SPDKFACDeepSpeedStrategy  # noqa: E402
from lightning_spdkfac.cli import lightning_cli  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "digits_deepspeed.yaml"


def test_config_builds_the_deepspeed_strategy_with_its_inline_config(isolated):
    cli = lightning_cli(["--config", str(CONFIG)], run=False)
    s = cli.trainer.strategy
    assert isinstance(s, SPDKFACDeepSpeedStrategy)
    assert s.config["zero_optimization"]["stage"] == 2 and s.config["zero_optimization"]["overlap_comm"]
    o = s.spd_options
    assert (o.schedule, o.pipelining, o.fusion, o.placement) == ("spd", True, "dtf", "lbp_channel")
    assert s.fused_grad_gather and s.num_processes == 2
    assert cli.trainer.precision == "bf16-mixed"
    assert any(isinstance(c, KFAC) for c in cli.trainer.callbacks)


@pytest.mark.slow
def test_bf16_zero2_trains_digits_to_95_percent(tmp_path):
    result, wall, err = run_cli(CONFIG, tmp_path, timeout=300)
    history = [round(h["val_acc"], 4) for h in result["history"]]
    assert "Enabling DeepSpeed BF16" in err, err[-2000:]
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["trainer"]["strategy"]["class_path"] == "lightning_spdkfac.SPDKFACDeepSpeedStrategy"
    assert result["epochs"] == 8
    assert result["final_val_acc"] >= 0.95, f"val_acc per epoch {history} ({wall:.1f} s)"
