"""SPDKFACStrategy under a real Trainer on 2 gloo processes."""

from __future__ import annotations

import os
import warnings

import pytest
import pytorch_lightning as pl
import torch
from helpers.lightning_models import KW, Tiny, data, fit_on_ranks, trainer

from lightning_spdkfac import KFAC, KFACPreconditioner, SPDKFACStrategy
from lightning_spdkfac.multiprocess import run_distributed


def one_process(steps, batch, **kfac_kw):
    import torch.nn.functional as F

    model = Tiny().net
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    pre = KFACPreconditioner(model, lr=0.2, **KW, **kfac_kw)
    x, y = data()
    for k in range(steps):
        i = (k * batch) % len(x)
        opt.zero_grad()
        F.cross_entropy(model(x[i:i + batch]), y[i:i + batch]).backward()
        pre.step()
        opt.step()
    return list(model.parameters())


@pytest.mark.parametrize("schedule", ["spd", "mpd", "dkfac"])
def test_strategy_on_two_processes_equals_one_process_on_the_joint_batch(schedule):
    results = run_distributed(fit_on_ranks, 2, schedule, 6, timeout=120)
    ref = one_process(6, 8)
    for a, b in zip(results[0][0], results[1][0]):
        assert torch.equal(a, b)
    for a, b in zip(results[0][0], ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    plan = results[0][1]
    assert plan == results[1][1]
    assert plan["pipelined"] == (schedule == "spd") and not plan["measuring"]
    assert plan["factor_steps"] == 6


def test_accumulation_reduces_factors_once_per_optimizer_step():
    results = run_distributed(fit_on_ranks, 2, "spd", 5, 2, timeout=120)
    ref = one_process(5, 8)
    # Micro-batches of 2 sum in another order than one batch of 8, and inverses with damping 0.01
    # amplify that round-off over 5 steps: 1e-3 relative.
    for a, b in zip(results[0][0], ref):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
    assert results[0][1]["factor_steps"] == 5 and results[0][1]["pipelined"]


def test_strategy_is_registered_and_validates():
    t = pl.Trainer(strategy="spdkfac", accelerator="cpu", devices=1, logger=False)
    assert isinstance(t.strategy, SPDKFACStrategy) and t.strategy.spd_options.schedule == "spd"
    t = pl.Trainer(strategy="spdkfac_mpd", accelerator="cpu", devices=1, logger=False)
    assert t.strategy.spd_options.placement == "round_robin"
    with pytest.raises(ValueError, match="schedule must be one of"):
        SPDKFACStrategy(schedule="fast")
    with pytest.raises(ValueError, match="fusion must be one of"):
        SPDKFACStrategy(fusion="magic")
    with pytest.raises(ValueError, match="bucket_mb is only used with fusion='bucket'"):
        SPDKFACStrategy(bucket_mb=8)
    with pytest.raises(ValueError, match="profile_steps must be"):
        SPDKFACStrategy(profile_steps=(5, 2))


def test_kfac_refuses_plain_ddp_on_several_processes():
    results = run_distributed(_plain_ddp, 2, timeout=60)
    assert all("needs a K-FAC-aware strategy" in r for r in results)


def _plain_ddp(rank, world):
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    warnings.filterwarnings("ignore")
    t = trainer(max_steps=1, devices=world, strategy="ddp", callbacks=[KFAC(**KW)])
    try:
        t.fit(Tiny())
    except RuntimeError as e:
        return str(e)
    return "no error"
