"""A model with an activation-checkpointed block (one layer called twice inside it), shared by the
checkpointing tests of test_faults_models.py and test_layer_setups.py."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class Checkpointed(nn.Module):
    def __init__(self, mode):
        super().__init__()
        torch.manual_seed(0)
        self.mode = mode  # None: no checkpointing; False / True: use_reentrant
        self.inp = nn.Linear(6, 8)
        self.block = nn.ModuleDict({"a": nn.Linear(8, 8), "b": nn.Linear(8, 8)})
        self.head = nn.Linear(8, 3)

    def run_block(self, h):
        h = torch.tanh(self.block["a"](h))
        h = torch.tanh(self.block["b"](h))
        return torch.tanh(self.block["b"](h))  # "b" twice: shared weights inside the checkpoint

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = self.run_block(h) if self.mode is None else checkpoint(self.run_block, h, use_reentrant=self.mode)
        return self.head(h)
