"""async_inverses and schedule="auto" through the strategies under a real Trainer (2 gloo processes)."""

from __future__ import annotations

import pytest
import torch
from helpers.lightning_models import fit_on_ranks
from test_strategy import one_process

from lightning_spdkfac.multiprocess import run_distributed


def test_ddp_strategy_with_auto_schedule_and_async_inverses_equals_one_process():
    """The strategy's async_inverses=True over the callback's default (False), and schedule="auto" building the
    AutoDistributor: the replicas agree bitwise and equal the one-process run with asynchronous inverses."""
    results = run_distributed(fit_on_ranks, 2, "auto", 8, 1, async_inverses=True, timeout=180)
    for a, b in zip(results[0][0], results[1][0], strict=True):
        assert torch.equal(a, b)
    ref = one_process(8, 8, async_inverses=True)
    for a, b in zip(results[0][0], ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    sync = one_process(8, 8)
    assert any(not torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(results[0][0], sync, strict=True))
    plan = results[0][1]
    assert plan["auto"]["candidates"] == ["spd", "spd-no-pipelining", "mpd", "dkfac"]


@pytest.mark.slow  # ~11 s; async inverses under the DDP strategy stay in the suite
def test_deepspeed_zero2_with_async_inverses_equals_one_process():
    pytest.importorskip("deepspeed")
    from test_deepspeed import ds_fit

    results = run_distributed(ds_fit, 2, 8, stage=2, async_inverses=True, timeout=240)
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(a, b)
    ref = one_process(8, 8, async_inverses=True)
    for a, b in zip(results[0]["params"], ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
