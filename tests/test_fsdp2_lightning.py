"""FSDP2 through Lightning's ModelParallelStrategy, 2 gloo ranks: K-FAC state through Lightning's distributed
checkpoint (saved as a directory; resumed on the same world size and on one rank), and the K-FAC bytes each rank
holds against what the summary reports."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from helpers.processes import finish_cli, start_cli
from test_fsdp2 import KW, PER_RANK, _batch, _loss, _model

from lightning_spdkfac.multiprocess import free_port

STATE_KEYS = ("A", "G", "A_inv", "G_inv")


def _module_class() -> Any:
    import pytorch_lightning as pl
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader

    class Module(pl.LightningModule):
        """The 7-row linear case; the batch indexed by the global step (so that a resumed fit sees the same data)."""

        def __init__(self) -> None:
            super().__init__()
            self.net = _model("linear")

        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            for layer in (self.net[0], self.net[2]):
                fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, _: Any, __: int) -> torch.Tensor:
            world, r = self.trainer.world_size, self.trainer.global_rank
            x, y = _batch("linear", self.trainer.global_step, 2)  # the 2-rank global batch, split over `world`
            rows = 2 * PER_RANK // world
            return _loss("linear", self.net(x[r * rows:(r + 1) * rows]), y[r * rows:(r + 1) * rows])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(list(range(100)), batch_size=None, shuffle=False)

    return Module


def _trainer(world: int, steps: int, callbacks: list[Any]) -> Any:
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import ModelParallelStrategy

    return pl.Trainer(accelerator="cpu", devices=world, max_steps=steps,
                      strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
                      callbacks=callbacks, logger=False,
                      enable_checkpointing=any(type(c).__name__ == "ModelCheckpoint" for c in callbacks), enable_progress_bar=False,
                      enable_model_summary=False, use_distributed_sampler=False)


def _plain(state: dict[str, Any]) -> dict[str, Any]:
    """The K-FAC state's tensors, by layer and key, cloned; and its step."""
    layers = {name: {k: v.detach().clone() for k, v in layer.items() if isinstance(v, torch.Tensor)}
              for name, layer in state["layers"].items()}
    return {"steps": state["steps"], "layers": layers}


def _fit_save_resume(rank: int, world: int, folder: str, mode: str) -> dict[str, Any]:
    """mode "save": 4 steps, a checkpoint by ModelCheckpoint after step 2 (mid-fit: the owners' K-FAC state gathered
    on every rank) and one by trainer.save_checkpoint after the fit; "resume": steps 3 and 4 from the step-2 one."""
    import warnings

    from pytorch_lightning.callbacks import Callback, ModelCheckpoint

    from lightning_spdkfac import KFAC

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    kfac = KFAC(**{k: v for k, v in KW.items() if k != "lr"}, summary=False)
    out: dict[str, Any] = {}

    class FirstStep(Callback):
        """The K-FAC state as the resumed fit starts its first step (collective under dpkfac: every rank)."""

        def on_train_batch_start(self, trainer: Any, *_: Any) -> None:
            if "resumed" not in out:
                assert kfac.preconditioner is not None
                out["resumed"] = _plain(kfac.preconditioner.state_dict())
                out["owned"] = sorted(n for n, ly in kfac.preconditioner.layers.items() if ly.A_inv is not None)

    module = _module_class()()
    if mode == "save":
        every = ModelCheckpoint(dirpath=folder, filename="kfac-{step}", every_n_train_steps=2, save_top_k=-1)
        trainer = _trainer(world, 4, [kfac, every])
        trainer.fit(module)
        trainer.save_checkpoint(os.path.join(folder, "final.ckpt"))
    else:
        trainer = _trainer(world, 4, [kfac, FirstStep()])
        trainer.fit(module, ckpt_path=os.path.join(folder, "kfac-step=2.ckpt"))
    out["weights"] = [p.full_tensor().detach().clone() for p in module.net.parameters()]
    return out


@functools.cache
def _saved(folder: str) -> list[dict[str, Any]]:
    from lightning_spdkfac.multiprocess import run_distributed

    return run_distributed(_fit_save_resume, 2, folder, "save", timeout=150)


def _meta_state(path: str) -> dict[str, Any]:
    """The K-FAC state as Lightning wrote it: the callback states are in the directory's meta.pt (rank 0's)."""
    assert os.path.isdir(path), f"{path}: ModelParallelStrategy writes a distributed checkpoint, a directory"
    meta = torch.load(os.path.join(path, "meta.pt"), weights_only=False)
    return _plain(meta["callbacks"]["KFAC"])


def _assert_state_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["steps"] == want["steps"]
    assert sorted(got["layers"]) == sorted(want["layers"])
    for name, layer in want["layers"].items():
        for key in STATE_KEYS:
            assert key in layer and key in got["layers"][name], (name, key)
            torch.testing.assert_close(got["layers"][name][key], layer[key], rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("resume_world", [2, 1])
def test_fsdp2_lightning_checkpoint_round_trip(tmp_path_factory: pytest.TempPathFactory, resume_world: int) -> None:
    """A 2-rank ModelParallelStrategy fit checkpointed by ModelCheckpoint at step 2 (a distributed checkpoint: a
    directory, the K-FAC state in its callback states) resumes with fit(ckpt_path=...) on 2 ranks and on 1: K-FAC's
    factors, inverses and step at the first resumed step equal the checkpoint's, and the resumed fit ends where the
    uninterrupted one did (1e-6 on the same world size, 1e-5 on one rank: another reduction order)."""
    from lightning_spdkfac.multiprocess import run_distributed

    folder = str(tmp_path_factory.getbasetemp() / "fsdp2_ckpt")
    saved = _saved(folder)
    at2 = _meta_state(os.path.join(folder, "kfac-step=2.ckpt"))
    assert at2["steps"] == 2 and sorted(at2["layers"]) == ["net.0", "net.2"]
    _assert_state_equal(_meta_state(os.path.join(folder, "final.ckpt")),
                        _meta_state(os.path.join(folder, "kfac-step=4.ckpt")))
    resumed = run_distributed(_fit_save_resume, resume_world, folder, "resume", timeout=150)
    for got in resumed:
        _assert_state_equal(got["resumed"], at2)  # the gathered state, on every rank
    if resume_world == 2:  # dpkfac: each rank inverts its own layers only, and together all of them
        assert sorted(resumed[0]["owned"] + resumed[1]["owned"]) == ["net.0", "net.2"], resumed
    tol = dict(rtol=1e-6, atol=1e-7) if resume_world == 2 else dict(rtol=1e-5, atol=1e-6)
    for got in resumed:
        for a, b in zip(got["weights"], saved[0]["weights"]):
            torch.testing.assert_close(a, b, **tol)
    start = [p.detach() for p in _model("linear").parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(saved[0]["weights"], start)), "nothing was trained"


REPO = Path(__file__).resolve().parents[1]
FSDP2_CONFIG = REPO / "configs" / "digits_fsdp2.yaml"
_SHORT = ("--trainer.max_steps=6", "--trainer.max_epochs=1", "--trainer.limit_val_batches=2",
          "--trainer.logger=false", "--kfac.factor_update_steps=1", "--kfac.inv_update_steps=2")


def _check_run(root: Path, world: int) -> None:
    saved = yaml.safe_load((root / "config.yaml").read_text())  # what rank 0 ran with
    assert saved["trainer"]["strategy"]["class_path"].endswith("ModelParallelStrategy")
    assert saved["model"]["init_args"]["shard"] is True
    state = _meta_state(str(root / "ckpt" / "last.ckpt"))  # the K-FAC state in the distributed checkpoint
    assert state["steps"] == 6 and sorted(state["layers"]) == ["net.0", "net.2", "net.6", "net.8"]
    for layer in state["layers"].values():
        assert all(torch.isfinite(layer[k]).all() for k in STATE_KEYS)


def _with_checkpoint(root: Path) -> list[str]:
    return [f"--trainer.default_root_dir={root}", "--trainer.enable_checkpointing=true",
            "--trainer.callbacks+=pytorch_lightning.callbacks.ModelCheckpoint",
            f"--trainer.callbacks.dirpath={root / 'ckpt'}", "--trainer.callbacks.save_last=true"]


def test_fsdp2_config_one_process(tmp_path: Path, isolated: None) -> None:
    """configs/digits_fsdp2.yaml (DigitsCNN sharding itself with fully_shard in configure_model, ModelParallelStrategy,
    the KFAC callback) trains 6 steps through the spdkfac CLI on one process, and its checkpoint (a directory) holds
    the K-FAC state of every layer."""
    from lightning_spdkfac.cli import main

    root = tmp_path / "run"
    port = str(free_port())
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    code = main(["fit", "--config", str(FSDP2_CONFIG), "--trainer.devices=1", "--trainer.strategy.init_args.data_parallel_size=1", *_SHORT, *_with_checkpoint(root)])
    assert code == 0
    _check_run(root, 1)


def test_digits_shard_needs_a_data_parallel_mesh() -> None:
    """DigitsCNN(shard=True) outside ModelParallelStrategy (no device mesh) is refused naming the strategy to use."""
    from lightning_spdkfac.demo import DigitsCNN

    with pytest.raises(ValueError, match=r"shard=True.*ModelParallelStrategy\(data_parallel_size=.*shard=False"):
        DigitsCNN(shard=True).configure_model()
    DigitsCNN().configure_model()  # shard=False: nothing to do


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp2_config_two_processes(tmp_path: Path) -> None:
    """The same config as a user runs it, `spdkfac fit --config configs/digits_fsdp2.yaml`: Lightning's launcher starts
    the second rank; FSDP2 over 2 gloo ranks, owner-based K-FAC (the summary says so)."""
    root = tmp_path / "run"
    proc = start_cli(["fit", "--config", str(FSDP2_CONFIG), *_SHORT, *_with_checkpoint(root)],
                     env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONPATH": str(REPO)})
    done = finish_cli(proc, 240)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "FSDP2: exact sharded preconditioning, owner-based" in done.stdout + done.stderr
    _check_run(root, 2)


def _held_bytes(pre: Any) -> int:
    """What the layers of ``pre`` hold, from the tensors themselves: accumulators, running factors, inverses."""
    total = 0
    for layer in pre.layers.values():
        for name in ("xx", "x_sum", "dd", "group_rows", "A", "G", "A_inv", "G_inv"):
            t = getattr(layer, name)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def _mlp() -> torch.nn.Sequential:
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 24), nn.Tanh(), nn.Linear(24, 31), nn.Tanh(), nn.Linear(31, 17), nn.Tanh(),
                         nn.Linear(17, 3))


def _memory_ranked(rank: int, world: int) -> dict[str, Any]:
    """Per rank, the K-FAC bytes held after 3 factor steps under FSDP2 (owner-based) and under DDP with the default
    schedule (spd: every rank holds every layer), each as the layers' tensors hold it and as the summary says."""
    import torch.distributed as dist
    from test_fsdp2 import _shard, _train
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_spdkfac.comm.scheduler import SPDDistributor
    from lightning_spdkfac.comm.spd_options import SPDOptions
    from lightning_spdkfac.kfac import KFACPreconditioner
    from lightning_spdkfac.kfac.summary import format_bytes

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    ddp_model = _mlp()
    pre = KFACPreconditioner(ddp_model, distributor=SPDDistributor(SPDOptions.from_schedule("spd"),
                                                                   process_group=dist.new_group()), **KW)
    _train("linear", ddp_model, DDP(ddp_model), pre, rank, world, range(3))
    out["ddp"] = (_held_bytes(pre), pre.summary().total_bytes)
    pre.remove_hooks()
    model = _mlp()
    _shard(model)
    pre = KFACPreconditioner(model, **KW)
    _train("linear", model, model, pre, rank, world, range(3))
    summary = pre.summary()
    out["fsdp"] = (_held_bytes(pre), summary.total_bytes)
    out["text"] = str(summary)
    out["owned"] = sorted(n for n, ly in pre.layers.items() if ly.A is not None)
    out["format"] = format_bytes(summary.total_bytes)
    pre.remove_hooks()
    # The same run keeping the other ranks' accumulators between steps: bitwise the same weights.
    from lightning_spdkfac.kfac import sharded

    kept = _mlp()
    _shard(kept)
    free, sharded.free_foreign_accumulators = sharded.free_foreign_accumulators, lambda *_: None  # type: ignore[assignment]
    try:
        pre = KFACPreconditioner(kept, **KW)
        _train("linear", kept, kept, pre, rank, world, range(3))
        out["kept"] = _held_bytes(pre)
        pre.remove_hooks()
    finally:
        sharded.free_foreign_accumulators = free
    out["same"] = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(model.parameters(), kept.parameters()))
    return out


@pytest.mark.timeout(120)
def test_fsdp2_memory_per_rank_matches_the_summary() -> None:
    """On 2 ranks under FSDP2 the K-FAC bytes each rank holds between steps (summed from its layers' tensors) are what
    its summary reports and prints, each rank holds its own layers' state only (the other layers' accumulators are
    dropped after the reduce, the weights bitwise those of keeping them), and it is below DDP K-FAC's (the default
    schedule, every layer on every rank), whose summary matches its tensors too."""
    from lightning_spdkfac.multiprocess import run_distributed

    results = run_distributed(_memory_ranked, 2, timeout=90)
    for rank, got in enumerate(results):
        held, reported = got["fsdp"]
        assert held == reported, (rank, held, reported)
        assert f"K-FAC memory on rank {rank} (dpkfac: its own layers): {got['format']} held between steps" in got["text"]
        ddp_held, ddp_reported = got["ddp"]
        assert ddp_held == ddp_reported, (rank, ddp_held, ddp_reported)
        assert held < ddp_held, (rank, held, ddp_held)
        assert got["same"], "dropping the other ranks' accumulators changed the training"
        assert got["kept"] > held  # (what dropping them saves between steps)
    assert sorted(results[0]["owned"] + results[1]["owned"]) == ["0", "2", "4", "6"]
    assert results[0]["owned"] and results[1]["owned"]
    # Each layer's state (its accumulators included) on one rank only: together they hold what one DDP rank holds.
    assert results[0]["fsdp"][0] + results[1]["fsdp"][0] == results[0]["ddp"][0]
