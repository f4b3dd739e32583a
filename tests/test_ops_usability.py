"""Operations from the user's side (issue 16, items 5 and 6): exact resume of the demo data, shipped
configs, the K-FAC thread cap, and benchmark scripts that never overwrite committed results by default.

References are independent runs of the same code on the same machine: an uninterrupted fit, the data
order that ``DataLoader(shuffle=True, generator=manual_seed(seed))`` gave before the sampler existed.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

import lightning_spdkfac
from lightning_spdkfac import KFAC
from lightning_spdkfac.demo import DigitsCNN, DigitsDataModule

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*GPU available but not used.*")

REPO = Path(__file__).resolve().parents[1]
EPOCHS = 3


class _StopAfterEpoch(pl.Callback):
    """Save a checkpoint at the end of epoch ``epoch`` (0-based) and stop: an interrupted run."""

    def __init__(self, epoch: int, path: Path) -> None:
        self.epoch, self.path = epoch, path

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == self.epoch:
            trainer.save_checkpoint(self.path)
            trainer.should_stop = True


def _fit(root: Path, kfac: bool, callbacks: list[pl.Callback] | None = None, ckpt: Path | None = None):
    pl.seed_everything(0, verbose=False)
    model = DigitsCNN(channels=(4, 8), hidden=16, lr=0.05)  # cosine schedule over EPOCHS: resume must keep it
    data = DigitsDataModule(batch_size=256)  # 6 batches per epoch
    cbs = list(callbacks or [])
    if kfac:
        cbs.append(KFAC(factor_update_steps=1, inv_update_steps=4, log_step_time=False))
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=EPOCHS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, deterministic=True, default_root_dir=root,
        callbacks=cbs, num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule=data, ckpt_path=ckpt)
    return {k: v.clone() for k, v in model.state_dict().items()}, trainer


@pytest.mark.parametrize("kfac", [False, True], ids=["sgd", "kfac"])
def test_digits_fit_resumed_from_checkpoint_equals_uninterrupted_fit_bitwise(tmp_path, kfac):
    whole, _ = _fit(tmp_path / "whole", kfac)
    ckpt = tmp_path / "epoch1.ckpt"
    first, _ = _fit(tmp_path / "part", kfac, callbacks=[_StopAfterEpoch(1, ckpt)])
    resumed, trainer = _fit(tmp_path / "resumed", kfac, ckpt=ckpt)
    assert trainer.current_epoch == EPOCHS
    assert any(not torch.equal(first[k], whole[k]) for k in whole)  # the interrupted run really stopped early
    for k in whole:
        assert torch.equal(resumed[k], whole[k]), k


def test_digits_epoch_order_is_that_of_a_seeded_shuffling_loader(tmp_path):
    data = DigitsDataModule(batch_size=100, seed=3)
    data.setup("fit")
    assert data.train_set is not None
    old = DataLoader(data.train_set, batch_size=100, shuffle=True, generator=torch.Generator().manual_seed(3))
    old_epochs = [torch.cat([y for _, y in old]) for _ in range(3)]
    loader = data.train_dataloader()
    for epoch in (2, 0, 1):  # any order: epoch e depends on (seed, e) only
        loader.sampler.set_epoch(epoch)
        assert torch.equal(torch.cat([y for _, y in loader]), old_epochs[epoch])
    assert not torch.equal(old_epochs[0], old_epochs[1])


def test_text_crops_of_each_epoch_are_those_of_one_seeded_stream():
    from torch.utils.data import RandomSampler

    from lightning_spdkfac.demo.digits import EpochSeededSampler

    data = range(1000)
    stream = RandomSampler(data, replacement=True, num_samples=70, generator=torch.Generator().manual_seed(5))
    old_epochs = [list(stream) for _ in range(3)]
    sampler = EpochSeededSampler(data, 5, replacement=True, num_samples=70)
    for epoch in (1, 2, 0):
        sampler.set_epoch(epoch)
        assert list(sampler) == old_epochs[epoch]


def test_configs_ship_inside_the_package():
    folder = lightning_spdkfac.configs_dir()
    assert folder.is_dir() and folder.parent == Path(lightning_spdkfac.__file__).parent
    shipped = {p.relative_to(folder) for p in folder.rglob("*.yaml")}
    assert Path("digits.yaml") in shipped and Path("digits_sgd.yaml") in shipped
    repo_configs = REPO / "configs"
    if repo_configs.is_dir():  # a source checkout: the same files, byte for byte
        in_repo = {p.relative_to(repo_configs) for p in repo_configs.rglob("*.yaml")}
        assert shipped == in_repo
        for rel in in_repo:
            assert (folder / rel).read_bytes() == (repo_configs / rel).read_bytes(), rel


def _bench(name: str):
    import importlib
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


def _outputs(name: str, argv: list[str]) -> list[Path]:
    module = _bench(name)
    if name == "paper_table":
        return [Path(p) for p in module._outputs(module._parser().parse_args(argv))]
    args = module.parse_args(argv)
    return [Path(p) for p in (args.json, getattr(args, "png", None)) if p]


COMMITTED = {
    "iteration_time": ["benchmarks/results/iteration_time.json", "benchmarks/results/iteration_time.png"],
    "soak": ["benchmarks/results/soak.json"],
    "timeline": ["docs/timeline.json", "docs/timeline.png"],
    "paper_table": ["benchmarks/results/paper_table.json", "benchmarks/results/scaling_resnet50.png",
                    "docs/simulated_timeline.png"],
}


@pytest.mark.parametrize("name", sorted(COMMITTED))
def test_benchmarks_write_a_fresh_folder_unless_told_to_refresh_the_committed_files(tmp_path, monkeypatch, name):
    common = _bench("_common")
    monkeypatch.setattr(common, "RESULTS", str(tmp_path))
    default = _outputs(name, [])
    assert default and all(p.parent.parent == tmp_path and p.parent.name.startswith("run-") for p in default)
    assert len({p.parent for p in default}) == 1  # one run, one folder
    again = _outputs(name, [])
    assert {p.parent for p in again}.isdisjoint({p.parent for p in default})  # a second run never overwrites
    committed = {(REPO / p).resolve() for p in COMMITTED[name]}
    assert all((REPO / p).is_file() for p in COMMITTED[name])
    assert {p.resolve() for p in _outputs(name, ["--refresh"])} == committed


def test_deepspeed_says_so_before_building_its_op_once(tmp_path, monkeypatch, caplog):
    pytest.importorskip("deepspeed")
    import logging

    from lightning_spdkfac.lightning.deepspeed_config import _announce_op_build

    caplog.set_level(logging.INFO)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # an empty cache: a first run
    if not _announce_op_build("ShareMemCommBuilder"):
        pytest.skip("DeepSpeed would not build this op here (prebuilt, or not compatible)")
    lines = [r.getMessage() for r in caplog.records if "DeepSpeed is building" in r.getMessage()]
    assert len(lines) == 1 and "later runs reuse it" in lines[0] and str(tmp_path) in lines[0]
    built = Path(lines[0].split("in ", 1)[1].split(")")[0])
    built.mkdir(parents=True, exist_ok=True)
    (built / "deepspeed_shm_comm.so").write_bytes(b"")  # what the build leaves behind
    caplog.clear()
    assert not _announce_op_build("ShareMemCommBuilder")  # a later run: nothing to say
    assert not any("DeepSpeed is building" in r.getMessage() for r in caplog.records)


def _threads_inside_kfac(monkeypatch, threads: int) -> tuple[set[int], int]:
    """torch's intra-op threads seen by K-FAC's inversions and factor hooks, and after the step."""
    from torch import nn

    import lightning_spdkfac.kfac.inverse_steps as inverse_steps
    from lightning_spdkfac import KFACPreconditioner
    from lightning_spdkfac.kfac.factor_updates import FactorStatistics

    seen: set[int] = set()
    real_inverses, real_accumulate = inverse_steps.robust_inverses, FactorStatistics._accumulate_a

    def inverses(*args, **kwargs):
        seen.add(torch.get_num_threads())
        return real_inverses(*args, **kwargs)

    def accumulate(self, *args, **kwargs):
        seen.add(torch.get_num_threads())
        return real_accumulate(self, *args, **kwargs)

    monkeypatch.setattr(inverse_steps, "robust_inverses", inverses)  # where the inversions call it
    monkeypatch.setattr(FactorStatistics, "_accumulate_a", accumulate)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
        pre = KFACPreconditioner(model, lr=0.1)
        model(torch.randn(8, 6)).square().sum().backward()
        pre.step()
        return seen, torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def test_kfac_runs_its_own_work_on_one_thread_by_default_and_restores_torchs_setting(monkeypatch):
    monkeypatch.delenv("SPDKFAC_KFAC_THREADS", raising=False)
    seen, after = _threads_inside_kfac(monkeypatch, 2)
    assert seen == {1} and after == 2


@pytest.mark.parametrize(("value", "expected"), [("0", {2}), ("off", {2}), ("2", {2}), ("1", {1})])
def test_kfac_thread_cap_follows_the_environment_variable(monkeypatch, value, expected):
    monkeypatch.setenv("SPDKFAC_KFAC_THREADS", value)
    seen, after = _threads_inside_kfac(monkeypatch, 2)
    assert seen == expected and after == 2


def test_kfac_thread_cap_refuses_a_value_that_is_not_a_thread_count(monkeypatch):
    from lightning_spdkfac import KFACPreconditioner

    monkeypatch.setenv("SPDKFAC_KFAC_THREADS", "two")
    with pytest.raises(ValueError, match="SPDKFAC_KFAC_THREADS must be a positive integer.*'two'"):
        KFACPreconditioner(torch.nn.Linear(2, 2))
