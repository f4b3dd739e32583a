"""A callback for the two-node test: each rank writes the K-FAC plan it trained with to JSON.

Lives in tests/ (put on PYTHONPATH by the test) and is appended to the config's callbacks with
``--trainer.callbacks+=multinode_probe.PlanDump``.
"""

from __future__ import annotations

import json
import os

import pytorch_lightning as pl

from lightning_spdkfac import KFAC


class PlanDump(pl.Callback):
    def __init__(self, out_dir: str = "."):
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module):
        kfac = next(c for c in trainer.callbacks if isinstance(c, KFAC))
        d = kfac.preconditioner.distributor
        plan = d.describe()
        plan.pop("models")
        plan.update(
            global_rank=trainer.global_rank, node_rank=trainer.node_rank, world_size=trainer.world_size,
            kfac_steps=kfac.preconditioner.steps, factor_steps=d.factor_steps,
            env={k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")},
        )
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"plan_rank{trainer.global_rank}.json"), "w") as f:
            json.dump(plan, f)
