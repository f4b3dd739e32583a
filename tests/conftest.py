"""Fixtures shared by the tests that build a Trainer or run the ``spdkfac`` CLI in this process."""

from __future__ import annotations

import os
import random
import sys

import numpy as np
import pytest
import torch
from helpers import hardware

# Variables that would make Lightning believe it runs under torchrun / a launcher, or pin its rank or port.
LAUNCH_VARS = ("LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def pytest_addoption(parser):
    parser.addoption(
        "--cpu-fp16", choices=hardware.MODES, default=None,
        help="'off': DeepSpeed's CPU accelerator reports no fp16, as on a CPU without AVX512-FP16/AMX "
             f"(default: ${hardware.ENV} or 'auto', the machine's own answer)",
    )


def pytest_configure(config):
    # Set before any rank process is started: ranks read it and apply the same override.
    choice = config.getoption("--cpu-fp16")
    if choice is not None:
        os.environ[hardware.ENV] = choice
    hardware.mode()  # a bad value in the environment fails here, once, naming the variable
    hardware.apply_overrides()


@pytest.fixture
def isolated(monkeypatch):
    """One torch thread, a clean sys.argv and no launcher variables; afterwards, undo what a run in this
    process changes globally (``deterministic: true``, ``seed_everything``'s seeds and PL_GLOBAL_SEED)."""
    monkeypatch.setattr(sys, "argv", ["spdkfac"])
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    env = dict(os.environ)
    det, det_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    py_rng, np_rng = random.getstate(), np.random.get_state()
    torch.set_num_threads(1)
    yield
    os.environ.clear()
    os.environ.update(env)
    torch.use_deterministic_algorithms(det, warn_only=det_warn)
    torch.set_num_threads(threads)
    torch.set_rng_state(rng)
    random.setstate(py_rng)
    np.random.set_state(np_rng)


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    """A fit with a DDP-based strategy in this process leaves Lightning's 1-rank default process group
    initialized (its teardown does not destroy it); later tests that check "no process group" or that
    start one of their own would see it. Destroy it after every test."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
