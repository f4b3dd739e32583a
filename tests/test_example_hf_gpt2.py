"""examples/hf_gpt2.py and configs/hf_gpt2*.yaml: a transformers GPT-2 (Conv1D, tied 50257-token head) on the stdlib
byte corpus through the spdkfac LightningCLI, with and without the KFAC callback. Seconds, not slow."""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("transformers")

from lightning_spdkfac import KFAC  # noqa: E402
from lightning_spdkfac.cli import lightning_cli  # noqa: E402
from lightning_spdkfac.demo.textlm import StdlibTextDataModule  # noqa: E402
from lightning_spdkfac.kfac.options import KFACOptions  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {
    "kfac": REPO / "configs" / "hf_gpt2.yaml",
    "adamw": REPO / "configs" / "hf_gpt2_adamw.yaml",
}
# 3 optimizer steps of 4 x 64 bytes, then one validation on 4 windows of a smaller corpus.
SHORT = (
    "--trainer.max_steps=3",
    "--data.init_args.batches_per_epoch=3",
    "--data.init_args.batch_size=4",
    "--data.init_args.val_windows=4",
    "--data.init_args.max_bytes=300000",
)


@pytest.fixture
def repo_on_path(isolated, monkeypatch):
    """`class_path: examples.hf_gpt2.GPT2LM` imports from the repository root (spdkfac puts the cwd on the path)."""
    monkeypatch.syspath_prepend(str(REPO))


def test_configs_differ_only_by_the_kfac_group():
    kfac, adamw = (yaml.safe_load(p.read_text()) for p in CONFIGS.values())
    assert adamw["kfac"] is None
    defaults = KFACOptions()
    for key in ("damping", "factor_decay", "kl_clip", "factor_update_steps", "inv_update_steps"):
        assert kfac["kfac"][key] == getattr(defaults, key), key  # K-FAC at its library defaults
    model = kfac["model"]["init_args"]
    assert model["vocab_size"] == 50257 and model["tie_weights"] is True and model["optimizer"] == "adamw"
    a, b = copy.deepcopy(kfac), copy.deepcopy(adamw)
    for cfg in (a, b):
        cfg["trainer"].pop("default_root_dir")
        cfg.pop("kfac")
    assert a == b  # same seed, model, AdamW lr, data, batch, steps, schedule and callbacks


def test_both_configs_build_the_same_gpt2(repo_on_path):
    from transformers import GPT2LMHeadModel
    from transformers.pytorch_utils import Conv1D

    clis = {name: lightning_cli(["--config", str(cfg)], run=False) for name, cfg in CONFIGS.items()}
    models = {name: cli.model for name, cli in clis.items()}
    for m in models.values():
        assert isinstance(m.gpt, GPT2LMHeadModel) and m.gpt.config.vocab_size == 50257
        assert m.gpt.lm_head.weight is m.gpt.transformer.wte.weight  # the tied head
        assert sum(isinstance(x, Conv1D) for x in m.modules()) == 8  # c_attn, c_proj, c_fc, c_proj per block
    kfac, adamw = (dict(m.named_parameters()) for m in models.values())
    assert kfac.keys() == adamw.keys()
    for name in kfac:  # the KFAC callback draws random numbers first; init_seed keeps the weights identical
        assert torch.equal(kfac[name], adamw[name]), name
    assert any(isinstance(c, KFAC) for c in clis["kfac"].trainer.callbacks)
    assert not any(isinstance(c, KFAC) for c in clis["adamw"].trainer.callbacks)


def test_byte_ids_are_gpt2_token_ids():
    sys.path.insert(0, str(REPO))
    try:
        from examples.hf_gpt2 import GPT2LM, bench_data
    finally:
        sys.path.remove(str(REPO))
    model = GPT2LM(init_seed=0)
    again = GPT2LM(init_seed=0)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters(), strict=True))
    x = torch.tensor([list(b"def f(x):\n    return x")])
    logits = model(x)
    assert logits.shape == (1, x.shape[1], 50257) and torch.isfinite(logits).all()
    assert bench_data(0).block_size == model.block_size
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 65, dtype=torch.long))


@pytest.mark.parametrize("name", ["kfac", "adamw"])
def test_config_runs_three_steps(name, repo_on_path, tmp_path):
    cli = lightning_cli(["fit", "--config", str(CONFIGS[name]), f"--trainer.default_root_dir={tmp_path}", *SHORT])
    trainer = cli.trainer
    assert trainer.global_step == 3 and isinstance(cli.datamodule, StdlibTextDataModule)
    assert isinstance(trainer.optimizers[0], torch.optim.AdamW)
    r = json.loads((tmp_path / "val_loss.json").read_text())
    assert r["steps"] == 3 and len(r["history"]) == 1
    # 3 steps from GPT-2's initialization: about log(50257) = 10.8 nats, a little lower, and finite
    assert 8.0 < r["final_val_loss"] < 11.5, r
    assert math.isfinite(r["history"][0]["train_loss"])
    kfacs = [c for c in trainer.callbacks if isinstance(c, KFAC)]
    assert len(kfacs) == (name == "kfac")
    if kfacs:  # every Conv1D, wpe and the tied head (wte is preconditioned by the head's block)
        state = kfacs[0].state_dict()
        per_block = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
        want = {f"gpt.transformer.h.{i}.{n}" for i in range(2) for n in per_block}
        want |= {"gpt.lm_head", "gpt.transformer.wpe"}
        assert state["steps"] == 3 and set(state["layers"]) == want
        assert all(torch.isfinite(p).all() for p in cli.model.parameters())
