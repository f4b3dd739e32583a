"""The small Lightning models of the Trainer tests: ``Tiny`` (one process), ``TinyInterleaved`` (each rank
reads its share of the same batches), their data, a quiet CPU ``trainer`` and the K-FAC settings ``KW``;
``fit_on_ranks`` is the body of a 2-process ``SPDKFACStrategy`` fit (module level: ``run_distributed``
pickles it by reference).
"""

from __future__ import annotations

import os
import warnings

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_spdkfac import KFAC, SPDKFACStrategy

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*GPU available but not used.*")


def data(n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


class Tiny(pl.LightningModule):
    def __init__(self, lr=0.2, batch_size=8, scheduler=False, n=32):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        self.lr, self.batch_size, self.scheduler, self.n = lr, batch_size, scheduler, n

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, _):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        if not self.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(TensorDataset(*data(self.n)), batch_size=self.batch_size, shuffle=False)


def trainer(**kw):
    defaults = dict(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    defaults.update(kw)
    return pl.Trainer(**defaults)


# Factors every step, inverses every 3 (not the defaults, 5 and 50): the tests that use KW compare runs
# step by step (a manual loop, other ranks, a resume, accumulation, pipelining) over a few steps.
KW = dict(damping=0.01, kl_clip=0.01, factor_update_steps=1, inv_update_steps=3)


class TinyInterleaved(Tiny):
    """Rank r of W reads samples r, r+W, r+2W, ...: together one step sees the joint batch."""

    def train_dataloader(self):
        ds = TensorDataset(*data(self.n))
        return DataLoader(ds, batch_size=self.batch_size, sampler=DistributedSampler(ds, shuffle=False))


def fit_on_ranks(rank, world, schedule, steps, accumulate=1, **strategy_kw):
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    model = TinyInterleaved(batch_size=4 // accumulate)
    strategy = SPDKFACStrategy(schedule=schedule, profile_steps=(1, 3), **strategy_kw)
    cb = KFAC(**KW)
    plans = []

    class Plan(pl.Callback):
        def on_train_end(self, trainer, pl_module):
            plan = cb.preconditioner.distributor.describe()
            plan.pop("models")
            plan["factor_steps"] = cb.preconditioner.distributor.factor_steps
            plans.append(plan)

    t = trainer(max_steps=steps, devices=world, strategy=strategy, callbacks=[cb, Plan()],
                use_distributed_sampler=False, accumulate_grad_batches=accumulate)
    t.fit(model)
    return [p.detach().clone() for p in model.net.parameters()], plans[0]
