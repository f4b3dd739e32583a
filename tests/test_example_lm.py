"""The transformer language-model example: StdlibTextDataModule, TinyGPT, both configs, the script.

Fast smoke tests (the whole file takes well under a minute on 2 CPU cores): both configs parse
and train a few steps through the ``spdkfac`` CLI; K-FAC registers every nn.Linear of TinyGPT and
builds its factors from 3-D ``(B, T, C)`` inputs exactly as docs/math.md defines them; the data
module is deterministic and its tokens are the source bytes. The K-FAC vs AdamW comparison itself
(hundreds of steps, minutes) is not run here; its numbers are in the README.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import yaml
from torch import nn

from lightning_spdkfac import KFAC, KFACPreconditioner
from lightning_spdkfac.cli import lightning_cli, main
from lightning_spdkfac.demo.textlm import (
    LossHistory,
    StdlibTextDataModule,
    TinyGPT,
    decode,
    load_corpus,
    stdlib_files,
)
from lightning_spdkfac.kfac.options import KFACOptions

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {
    "kfac": REPO / "configs" / "transformer_lm.yaml",
    "adamw": REPO / "configs" / "transformer_lm_adamw.yaml",
}
# A short run: 3 optimizer steps, validation once at the end on 8 windows of a smaller corpus.
SHORT = (
    "--trainer.max_steps=3",
    "--data.init_args.batches_per_epoch=3",
    "--data.init_args.val_windows=8",
    "--data.init_args.max_bytes=300000",
)


# ----------------------------------------------------------------------------- configs
def test_configs_differ_only_by_the_kfac_group():
    kfac, adamw = (yaml.safe_load(p.read_text()) for p in CONFIGS.values())
    assert adamw["kfac"] is None  # the kfac: group; null = no K-FAC
    defaults = KFACOptions()
    for key in ("damping", "factor_decay", "kl_clip", "factor_update_steps", "inv_update_steps"):
        assert kfac["kfac"][key] == getattr(defaults, key), key  # K-FAC at its library defaults
    model = kfac["model"]["init_args"]
    assert model["optimizer"] == "adamw" and model["loss_scale"] == 1.0 and model["tie_weights"] is True
    assert model["attention"] == "mha"
    a, b = copy.deepcopy(kfac), copy.deepcopy(adamw)
    for cfg in (a, b):
        cfg["trainer"].pop("default_root_dir")
        cfg.pop("kfac")
    assert a == b  # same seed, model, optimizer, data, batch, steps, schedule and callbacks
    assert kfac["trainer"]["max_steps"] == adamw["trainer"]["max_steps"] > 0


def test_both_configs_build_the_same_initial_model(isolated):
    models = {name: lightning_cli(["--config", str(cfg)], run=False).model for name, cfg in CONFIGS.items()}
    assert all(isinstance(m, TinyGPT) for m in models.values())
    kfac, adamw = (dict(m.named_parameters()) for m in models.values())
    assert kfac.keys() == adamw.keys()
    # The KFAC callback (built before the model) draws random numbers; the model's init_seed makes
    # the initial weights independent of that.
    for name in kfac:
        assert torch.equal(kfac[name], adamw[name]), name


@pytest.mark.parametrize("name", ["kfac", "adamw"])
def test_config_runs_a_few_steps(name, isolated, tmp_path):
    cli = lightning_cli(
        ["fit", "--config", str(CONFIGS[name]), f"--trainer.default_root_dir={tmp_path}", *SHORT]
    )
    trainer = cli.trainer
    assert trainer.global_step == 3
    assert isinstance(cli.model, TinyGPT) and isinstance(cli.datamodule, StdlibTextDataModule)
    assert isinstance(trainer.optimizers[0], torch.optim.AdamW)
    r = json.loads((tmp_path / "val_loss.json").read_text())
    assert r["steps"] == 3 and len(r["history"]) == 1 and r["history"][0]["step"] == 3
    # 3 steps from a uniform-ish start: close to log(256) = 5.55 nats, and finite
    assert 3.0 < r["final_val_loss"] < 6.5, r
    assert r["history"][0]["train_loss"] is not None and math.isfinite(r["history"][0]["train_loss"])
    kfacs = [c for c in trainer.callbacks if isinstance(c, KFAC)]
    assert len(kfacs) == (name == "kfac")
    if kfacs:  # the callback collected factors of every attention projection, MLP layer, the head and pos_emb
        state = kfacs[0].state_dict()
        per_block = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj", "fc1", "fc2")
        want = {f"blocks.{i}.{n}" for i in range(4) for n in per_block} | {"head", "pos_emb"}
        assert state["steps"] == 3 and set(state["layers"]) == want
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["trainer"]["max_steps"] == 3


def test_cli_main_and_overrides(isolated, tmp_path):
    """`spdkfac fit --config ...` as the user types it (the exit code), with a model override."""
    assert (
        main(
            [
                "fit",
                "--config",
                str(CONFIGS["adamw"]),
                f"--trainer.default_root_dir={tmp_path}",
                *SHORT,
                "--trainer.max_steps=2",
                "--data.init_args.batches_per_epoch=2",
                "--model.init_args.lr=0.001",
            ]
        )
        == 0
    )
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["model"]["init_args"]["lr"] == 0.001
    assert json.loads((tmp_path / "val_loss.json").read_text())["steps"] == 2


# ----------------------------------------------------------------------------- K-FAC on TinyGPT
def test_kfac_registers_every_linear_with_3d_inputs():
    torch.manual_seed(0)
    B, T = 3, 16
    model = TinyGPT(block_size=T, n_layer=2, n_head=2, n_embd=24, mlp_ratio=2, attention="linear",
                    tie_weights=False).train()
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert len(linears) == 2 * 6 + 1  # q, k, v, out, fc1, fc2 per block, and the head
    pre = KFACPreconditioner(model, damping=0.01, kl_clip=None)
    assert set(pre.layers) == set(linears) | {"tok_emb", "pos_emb"} and not pre.skipped

    inputs, out_grads = {}, {}

    def capture(name):
        def hook(module, args, output):
            inputs[name] = args[0].detach().clone()
            output.register_hook(lambda g: out_grads.__setitem__(name, g.detach().clone()))

        return hook

    handles = [m.register_forward_hook(capture(n)) for n, m in linears.items()]
    x = torch.randint(0, 256, (B, T + 1))
    loss = model.loss((x[:, :-1], x[:, 1:]))
    loss.backward()
    for h in handles:
        h.remove()
    grads_before = {n: m.weight.grad.clone() for n, m in linears.items()}
    bias_before = {n: m.bias.grad.clone() for n, m in linears.items() if m.bias is not None}
    for name in linears:
        layer = pre.layers[name]
        assert inputs[name].shape[:2] == (B, T) and inputs[name].dim() == 3, name
        assert layer.rows == B * T and layer.examples == B * T and layer.a_calls == layer.g_calls == 1, name
    pre.step()

    for name, m in linears.items():
        layer = pre.layers[name]
        bias = m.bias is not None
        assert bias == (name != "head")
        assert layer.A.shape == (m.in_features + bias,) * 2, name
        assert layer.G.shape == (m.out_features,) * 2, name
        # docs/math.md: A = mean over the B*T rows of [x, 1][x, 1]^T, G = (B*T) * sum of d d^T (each position is an example)
        a = inputs[name].reshape(-1, m.in_features).double()
        if bias:
            a = torch.cat([a, torch.ones(len(a), 1, dtype=a.dtype)], dim=1)
        d = out_grads[name].reshape(-1, m.out_features).double()
        torch.testing.assert_close(layer.A.double(), a.T @ a / (B * T), rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(layer.G.double(), B * T * d.T @ d, rtol=1e-4, atol=1e-12)
        assert float(layer.G.diagonal().sum()) > 0, name
        assert layer.A_inv is not None and layer.G_inv is not None, name
        # kl_clip=None: the gradient is now exactly P = G_inv [dW, db] A_inv
        g = grads_before[name]
        if bias:
            g = torch.cat([g, bias_before[name].unsqueeze(1)], dim=1)
        P = layer.G_inv @ g @ layer.A_inv
        torch.testing.assert_close(m.weight.grad, P[:, : m.in_features], rtol=1e-4, atol=1e-8)
        if bias:
            torch.testing.assert_close(m.bias.grad, P[:, -1], rtol=1e-4, atol=1e-8)
        assert not torch.allclose(m.weight.grad, grads_before[name]), name
    pre.remove_hooks()


def test_the_default_tinygpt_is_mha_with_a_tied_head_and_computes_what_the_linear_one_does():
    """attention="mha" (default) and "linear" are the same function of the same weights; K-FAC registers MHA's
    four projections, the MLP, the head (which preconditions the tied weight) and the position embedding, and
    names the tied token embedding in its one warning."""
    mha = TinyGPT(block_size=16, n_layer=2, n_head=2, n_embd=16, mlp_ratio=2)
    lin = TinyGPT(block_size=16, n_layer=2, n_head=2, n_embd=16, mlp_ratio=2, attention="linear")
    assert mha.head.weight is mha.tok_emb.weight and lin.head.weight is lin.tok_emb.weight
    state = {k: v for k, v in mha.state_dict().items() if "attn" not in k}
    lin.load_state_dict(state, strict=False)
    for bm, bl in zip(mha.blocks, lin.blocks):
        for i, proj in enumerate((bl.attn.q, bl.attn.k, bl.attn.v)):
            rows = slice(16 * i, 16 * (i + 1))
            proj.weight.data.copy_(bm.attn.in_proj_weight[rows])
            proj.bias.data.copy_(bm.attn.in_proj_bias[rows])
        bl.attn.out.load_state_dict(bm.attn.out_proj.state_dict())
    x = torch.randint(0, 256, (3, 16))
    torch.testing.assert_close(mha(x), lin(x), rtol=1e-5, atol=1e-6)
    with pytest.warns(UserWarning, match="tok_emb"):
        pre = KFACPreconditioner(mha, kl_clip=None)
    per_block = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj", "fc1", "fc2")
    assert set(pre.layers) == {f"blocks.{i}.{n}" for i in range(2) for n in per_block} | {"head", "pos_emb"}
    assert set(pre.skipped) == {"tok_emb"}
    pre.remove_hooks()


# ----------------------------------------------------------------------------- data
def test_datamodule_is_deterministic_and_round_trips_to_the_source():
    max_bytes, T, B = 300_000, 32, 8
    kw = dict(block_size=T, batch_size=B, max_bytes=max_bytes, seed=3, val_fraction=0.1, val_windows=16,
              batches_per_epoch=4)
    dm = StdlibTextDataModule(**kw)
    dm.setup("fit")
    files = stdlib_files()
    assert files == sorted(files) and not any(f.name.startswith("_sysconfigdata") for f in files)
    source = b"".join(f.read_bytes() for f in files)[:max_bytes]  # read independently of load_corpus
    tokens = torch.cat([dm.train_tokens, dm.val_tokens])
    assert tokens.dtype == torch.uint8 and len(tokens) == max_bytes
    assert bytes(tokens.tolist()) == source
    assert (
        len(dm.val_tokens) == 30_000 and bytes(dm.val_tokens.tolist()) == source[-30_000:]
    )  # contiguous split
    assert decode(dm.train_tokens[:1000]) == source[:1000].decode()
    for name, offset in dm.files:  # the index points at each file's first byte
        head = (Path(files[0].parent) / name).read_bytes()[:200]
        assert source[offset : offset + len(head)] == head[: max(0, max_bytes - offset)]

    def batches(d, loader):
        return [(x.clone(), y.clone()) for x, y in getattr(d, loader)()]

    train = batches(dm, "train_dataloader")
    assert len(train) == 4
    for x, y in train:
        assert x.shape == y.shape == (B, T) and x.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one byte
        for row_x, row_y in zip(x, y):  # every crop is a piece of the training split
            crop = bytes(row_x.tolist()) + bytes(row_y[-1:].tolist())
            assert crop in source[: len(dm.train_tokens)]
    same = StdlibTextDataModule(**kw)
    same.setup("fit")
    for (x1, y1), (x2, y2) in zip(train, batches(same, "train_dataloader")):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    other = StdlibTextDataModule(**{**kw, "seed": 4})
    other.setup("fit")
    assert not torch.equal(train[0][0], batches(other, "train_dataloader")[0][0])
    # validation: the same fixed windows for every seed and every call, spread over the whole split
    val = batches(dm, "val_dataloader")
    assert sum(len(x) for x, _ in val) == 16
    for (x1, _), (x2, _) in zip(val, batches(other, "val_dataloader")):
        assert torch.equal(x1, x2)
    assert int(dm.val_starts[0]) == 0 and int(dm.val_starts[-1]) == len(dm.val_tokens) - T - 1
    assert bytes(val[0][0][0].tolist()) == source[len(dm.train_tokens) :][:T]
    with pytest.raises(ValueError, match="val_fraction"):
        StdlibTextDataModule(val_fraction=0.0)
    with pytest.raises(ValueError, match="too small"):
        StdlibTextDataModule(block_size=64, max_bytes=100).setup("fit")


def test_load_corpus_reads_only_what_the_cut_needs():
    corpus, index = load_corpus(max_bytes=5000)
    assert len(corpus) == 5000 and index[0] == (stdlib_files()[0].name, 0)
    assert all(offset < 5000 for _, offset in index)


# ----------------------------------------------------------------------------- the model
def test_tinygpt_is_causal_and_its_schedule_warms_up_then_decays(tmp_path):
    model = TinyGPT(block_size=16, n_layer=1, n_head=2, n_embd=16, warmup_steps=2, lr=0.01, min_lr_ratio=0.1)
    x = torch.randint(0, 256, (2, 16))
    y = x.clone()
    y[:, 10:] = (y[:, 10:] + 1) % 256
    with torch.no_grad():  # changing positions >= 10 leaves the logits of positions < 10 alone
        torch.testing.assert_close(model(x)[:, :10], model(y)[:, :10])
        assert not torch.allclose(model(x)[:, 10:], model(y)[:, 10:])
    tied = TinyGPT(block_size=16, n_layer=1, n_head=2, n_embd=16, tie_weights=True)
    assert tied.head.weight is tied.tok_emb.weight
    assert torch.equal(
        TinyGPT(block_size=16, n_layer=1, n_embd=16).head.weight,
        TinyGPT(block_size=16, n_layer=1, n_embd=16).head.weight,
    )  # init_seed

    class Lrs(pl.Callback):
        lrs: list = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    rec, hist = Lrs(), LossHistory(path="h.json")
    trainer = pl.Trainer(
        max_steps=8,
        max_epochs=-1,
        callbacks=[rec, hist],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        num_sanity_val_steps=0,
    )
    data = StdlibTextDataModule(
        block_size=16, batch_size=4, max_bytes=20_000, val_windows=4, batches_per_epoch=4
    )
    trainer.fit(model, datamodule=data)
    lrs = rec.lrs
    assert len(lrs) == 8
    assert lrs[0] == pytest.approx(0.005) and lrs[1] == pytest.approx(0.01)  # 2 warmup steps
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:])) and lrs[-1] > 0.001 and lrs[-1] < 0.002
    groups = trainer.optimizers[0].param_groups
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert sum(p.numel() for g in groups for p in g["params"]) == sum(p.numel() for p in model.parameters())
    assert all(p.dim() == 1 for p in groups[1]["params"])  # biases and LayerNorm parameters
    h = json.loads((tmp_path / "h.json").read_text())
    assert [e["step"] for e in h["history"]] == [4, 8] and h["final_val_loss"] == h["history"][-1]["val_loss"]


# ----------------------------------------------------------------------------- the script
@pytest.mark.slow  # ~11 s as a subprocess; the CLI fit of a few steps stays in the 10-minute suite
def test_example_script_runs(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    p = subprocess.run(
        [
            sys.executable,
            str(REPO / "examples" / "transformer_lm.py"),
            "--optimizer",
            "kfac",
            "--max-steps",
            "2",
            "--val-every",
            "2",
            "--threads",
            "1",
            "--root",
            str(tmp_path),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "final val loss" in p.stdout and "after 2 steps" in p.stdout, p.stdout
