"""Ranks that must agree, do: a layer that runs on some ranks only (data-dependent control flow under
``find_unused_parameters=True``) and ranks started with different K-FAC settings.

The first must train with every replica bitwise equal, under every schedule, plain DDP and the
Lightning strategy; the second must fail on every rank with one error naming the setting.
"""

from __future__ import annotations

import os
import warnings

import pytest
import pytorch_lightning as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

from lightning_spdkfac import KFAC, KFACPreconditioner, SPDKFACStrategy
from lightning_spdkfac.comm.consistency import PlanMismatchError
from lightning_spdkfac.comm.scheduler import SPDDistributor, SPDOptions
from lightning_spdkfac.multiprocess import RankFailure, free_port, run_distributed

STEPS, BATCH = 6, 4
KFAC_KW = dict(damping=0.01, kl_clip=1e-2, lr=0.1, factor_update_steps=1, inv_update_steps=2)


def takes_branch(step: int, rank: int) -> bool:
    """Rank 0 alone, rank 1 alone, or neither: every kind of disagreement within six steps."""
    return (step + rank) % 3 == 0


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.branch, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x, take):
        h = torch.tanh(self.trunk(x))
        if take:
            h = h + torch.tanh(self.branch(h))
        return self.head(h)


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g)


def _train_plain(rank, world, schedule):
    torch.set_num_threads(1)
    model = Branchy()
    ddp = DDP(model, find_unused_parameters=True)
    distributor = SPDDistributor(SPDOptions.from_schedule(schedule, profile_steps=(1, 3)), process_group=dist.new_group())
    pre = KFACPreconditioner(model, distributor=distributor, **KFAC_KW)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = batch(step, rank)
        opt.zero_grad()
        F.cross_entropy(ddp(x, takes_branch(step, rank)), y).backward()
        pre.step()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def plain_all(rank, world):
    return {s: _train_plain(rank, world, s) for s in ("dkfac", "mpd", "spd")}


def test_a_layer_run_on_some_ranks_only_keeps_the_replicas_bitwise_equal():
    results = run_distributed(plain_all, 2, timeout=120)
    for schedule in ("dkfac", "mpd", "spd"):
        for a, b in zip(results[0][schedule], results[1][schedule]):
            assert torch.equal(a, b), f"{schedule}: the replicas differ by {float((a - b).abs().max()):.3g}"
        for a, b in zip(results[0][schedule], results[0]["dkfac"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=f"{schedule} vs dkfac")
    # The branch was preconditioned: it moved, and not as plain SGD moves it (checked in one process below).
    init = Branchy().branch.weight
    assert not torch.equal(results[0]["dkfac"][2], init)


class _Data(Dataset):
    def __len__(self):
        return STEPS

    def __getitem__(self, step):
        return step


class BranchyModule(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = Branchy()

    def training_step(self, step, _):
        rank = self.trainer.global_rank
        x, y = batch(int(step), rank)
        return F.cross_entropy(self.net(x, takes_branch(int(step), rank)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        # Every rank gets the step index; the batch comes from (step, rank).
        return DataLoader(_Data(), batch_size=None, shuffle=False)


def _fit_lightning(rank, world, schedule):
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    module = BranchyModule()
    kw = {k: v for k, v in KFAC_KW.items() if k != "lr"}
    strategy = SPDKFACStrategy(schedule=schedule, profile_steps=(1, 3), find_unused_parameters=True)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS,
                         callbacks=[KFAC(**kw)], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(module)
    return [p.detach().clone() for p in module.parameters()]


def test_a_layer_run_on_some_ranks_only_under_the_lightning_strategy():
    """Replicas bitwise equal, and equal to the plain-DDP run of the same schedule (same math through Lightning).

    (DeepSpeed ZeRO is not tested here: DeepSpeed itself hangs when a parameter is used on some ranks only,
    with or without K-FAC; see docs/faults.md, "Notes and limits".)"""
    results = run_distributed(_fit_lightning, 2, "spd", timeout=120)
    for a, b in zip(*results):
        assert torch.equal(a, b), f"the replicas differ by {float((a - b).abs().max()):.3g}"


def _different_damping(rank, world):
    torch.set_num_threads(1)
    model = Branchy()
    distributor = SPDDistributor(SPDOptions.from_schedule("spd", profile_steps=(1, 3)), process_group=dist.new_group())
    KFACPreconditioner(model, distributor=distributor, **{**KFAC_KW, "damping": 0.01 * (1 + rank)})


def test_ranks_with_different_kfac_settings_fail_on_every_rank_naming_the_setting():
    results = run_distributed(_different_damping, 2, timeout=60, allow_failures=True)
    for r in results:
        assert isinstance(r, RankFailure), "a rank with other K-FAC settings was accepted"
        assert PlanMismatchError.__name__ in r.message
        assert "K-FAC settings" in r.message and "damping" in r.message, r.message


@pytest.mark.parametrize("schedule", ["dkfac"])
def test_same_settings_pass_the_check(schedule):
    results = run_distributed(_train_plain, 2, schedule, timeout=60)
    assert all(torch.equal(a, b) for a, b in zip(*results))


class Stalling(BranchyModule):
    """Rank 1 stops in its third step for longer than the K-FAC timeout (a hung data loader, a slow disk)."""

    woke_at: float | None = None  # wall clock when rank 1 resumed

    def training_step(self, step, _):
        if int(step) == 2 and self.trainer.global_rank == 1:
            import time

            time.sleep(STALL_S)
            Stalling.woke_at = time.time()
        return super().training_step(step, _)


STALL_S = 8.0


def _fit_stalling(rank, world, port):
    """(wall clock when fit raised or returned, the error's text, when rank 1 woke from its stall)."""
    # Lightning must create the process group itself (with the strategy's timeout), as under a launcher:
    # drop the one the test harness made.
    dist.destroy_process_group()
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import time
    import traceback

    strategy = SPDKFACStrategy(schedule="dkfac", comm_timeout_s=1.0, find_unused_parameters=True)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS,
                         callbacks=[KFAC(**{k: v for k, v in KFAC_KW.items() if k != "lr"})], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False)
    try:
        trainer.fit(Stalling())
    except Exception as e:  # noqa: BLE001 - the test reads what the ranks saw
        return time.time(), "".join(traceback.format_exception(e)), Stalling.woke_at
    return time.time(), "", Stalling.woke_at


@pytest.mark.slow  # ~14 s; the stalled-rank timeouts of the executors stay in the suite (test_faults_distributed.py)
def test_a_stalled_rank_under_ddp_fails_the_others_at_comm_timeout_s():
    """DDP's own gradient all-reduce is bounded by comm_timeout_s too (the strategy's process-group timeout
    defaults to it, 1 s here), so the waiting rank fails while its peer is still stalled (8 s), not after
    30 minutes, naming the timeout. (An order of events, not a duration: robust on a slow machine.)"""
    results = run_distributed(_fit_stalling, 2, free_port(), timeout=90, allow_failures=True)
    waiting, stalled = results
    assert not isinstance(waiting, RankFailure), waiting.message
    failed_at, error, _ = waiting
    assert error, "the waiting rank finished although its peer stalled"
    assert "comm_timeout_s" in error, error[-2000:]
    if not isinstance(stalled, RankFailure) and stalled[2] is not None:
        assert failed_at < stalled[2], "the waiting rank failed only after its peer woke up"


class Routed(nn.Module):
    """An 'expert' layer that some steps route no example to on one rank (an empty input, 0 rows)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.expert, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x, routed):
        h = torch.tanh(self.trunk(x))
        out = h.clone()
        out[:routed] = h[:routed] + torch.tanh(self.expert(h[:routed]))
        return self.head(out)


def _train_routed(rank, world):
    torch.set_num_threads(1)
    model = Routed()
    ddp = DDP(model)
    options = SPDOptions.from_schedule("spd", profile_steps=(1, 3))  # pipelined from step 3 on
    pre = KFACPreconditioner(model, distributor=SPDDistributor(options, process_group=dist.new_group()), **KFAC_KW)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(8):
        x, y = batch(step, rank)
        opt.zero_grad()
        F.cross_entropy(ddp(x, 0 if takes_branch(step, rank) else BATCH), y).backward()
        pre.step()
        opt.step()
    assert pre.distributor.pipelined
    return [p.detach().clone() for p in model.parameters()], pre.skipped_factor_steps


def test_an_empty_input_on_one_rank_under_pipelined_spd_sends_no_data_not_nan():
    """The rank with no rows for the expert sends 'no data' (not 0/0): no step is skipped as non-finite,
    and the replicas stay equal."""
    results = run_distributed(_train_routed, 2, timeout=120)
    (p0, skipped0), (p1, skipped1) = results
    assert skipped0 == skipped1 == 0
    for a, b in zip(p0, p1):
        assert torch.equal(a, b)
