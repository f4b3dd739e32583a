"""schedule="auto" (comm/auto.py): the candidates are timed in rotation on the job, every rank takes the same
decision, and the run computes what a fixed schedule computes."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from helpers.training import sgd_kfac_steps
from test_spd_distributed import BATCH, KFAC_KW, data, make_model
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_spdkfac import KFACPreconditioner
from lightning_spdkfac.cli import _auto_choice
from lightning_spdkfac.comm.auto import AUTO_SCHEDULES, AutoDistributor, candidates
from lightning_spdkfac.comm.scheduler import SPDDistributor, SPDOptions
from lightning_spdkfac.multiprocess import run_distributed

# spd profiles factor steps 1-2 (steps 0-3), the rotation starts at the inverse step 4: 4 candidates x 1 round
# x 1 slot of 3 inverse periods of 2 steps (MIN_SLOT_STEPS = 5 steps at least) -> the decision at step 28; 4 more
# steps on the chosen one.
AUTO_STEPS = 32
KW = {**KFAC_KW, "inv_update_steps": 2}


def _train(rank, world, options_kw, auto):
    torch.set_num_threads(1)
    model = make_model()
    options = SPDOptions.from_schedule(**options_kw)
    group = dist.new_group()
    distributor = (AutoDistributor if auto else SPDDistributor)(options, process_group=group)
    pre = KFACPreconditioner(model, distributor=distributor, **KW)
    active = []
    original = distributor.begin_step

    def spy(step):
        original(step)
        active.append(distributor.active if auto else -1)

    distributor.begin_step = spy
    sgd_kfac_steps(DDP(model), pre, data, AUTO_STEPS, world, rank, BATCH)
    pre.state_dict()
    pre.remove_hooks()
    info = distributor.describe().get("auto")
    return [p.detach().clone() for p in model.parameters()], info, active


def _auto_and_fixed(rank, world):
    return {
        "auto": _train(rank, world, dict(schedule="auto", profile_steps=(1, 3), auto_rounds=1), auto=True),
        "fixed": _train(rank, world, dict(schedule="spd", profile_steps=(1, 3)), auto=False),
        "async_auto": _train(rank, world, dict(schedule="mpd", async_inverses="auto", auto_rounds=1), auto=True),
    }


@pytest.fixture(scope="module")
def job():
    return run_distributed(_auto_and_fixed, 2, timeout=240)


def test_auto_equals_the_fixed_schedule_and_the_replicas_agree_bitwise(job):
    auto = [r["auto"][0] for r in job]
    for a, b in zip(*auto, strict=True):
        assert torch.equal(a, b), "the replicas differ"
    for a, b in zip(auto[0], job[0]["fixed"][0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_every_candidate_is_timed_in_rotation_and_every_rank_decides_the_same(job):
    info0, info1 = job[0]["auto"][1], job[1]["auto"][1]
    assert info0 == info1
    labels = [label for label, _ in AUTO_SCHEDULES]
    assert info0["candidates"] == labels
    (decision,) = info0["decisions"]
    assert decision["step"] == 28 and decision["periods_per_slot"] == 3
    table = decision["seconds_per_period"]
    assert list(table) == labels and all(t > 0 for t in table.values())
    assert decision["choice"] == min(labels, key=lambda n: (table[n], labels.index(n)))
    assert info0["chosen"] == decision["choice"]
    # Which candidate ran each step: active[k - 1] is the one begin_step chose for step k (the spy is installed
    # after the first begin_step, step 0's). spd while it profiles and until the next inverse step, then each
    # candidate for one slot (3 inverse periods, 6 steps), then the choice.
    active = job[0]["auto"][2]
    assert active[:3] == [0, 0, 0]
    assert active[3:27] == [i for i in range(4) for _ in range(6)]
    assert set(active[27:]) == {labels.index(decision["choice"])}


def test_async_inverses_auto_times_the_schedule_with_and_without(job):
    info = job[0]["async_auto"][1]
    assert info["candidates"] == ["mpd", "mpd+async"]
    assert info == job[1]["async_auto"][1]
    a, b = (r["async_auto"][0] for r in job)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_candidates_follow_the_options():
    opts = SPDOptions.from_schedule("auto", comm_dtype="bfloat16", async_inverses=True)
    got = candidates(opts)
    assert [label for label, _ in got] == ["spd", "spd-no-pipelining", "mpd", "dkfac"]
    assert all(o.comm_dtype == "bfloat16" and o.async_inverses is True and o.replan_every is None for _, o in got)
    assert [o.pipelining for _, o in got] == [True, False, False, False]
    assert [label for label, _ in candidates(SPDOptions.from_schedule("auto", async_inverses="auto"))] == [
        "spd", "spd+async", "spd-no-pipelining", "spd-no-pipelining+async", "mpd", "mpd+async", "dkfac", "dkfac+async"]


@pytest.mark.parametrize("kw, match", [
    (dict(schedule="auto", pipelining=False), "pipelining must be None with schedule='auto'"),
    (dict(schedule="auto", placement="lbp"), "placement must be None with schedule='auto'"),
    (dict(schedule="auto", bucket_mb=8.0), "bucket_mb"),
    (dict(schedule="auto", small_factor=64), "small_factor"),
    (dict(schedule="spd", auto_rounds=5), "auto_rounds must be left at its default"),
    (dict(schedule="spd", async_inverses="sometimes"), "async_inverses"),
])
def test_auto_options_are_refused_by_name(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        SPDOptions.from_schedule(**kw)


def test_one_process_auto_decides_and_logs(caplog):
    """World size 1: nothing to all-reduce; the decision is still made, logged and used."""
    model = make_model()
    distributor = AutoDistributor(SPDOptions.from_schedule("auto", profile_steps=(1, 3), auto_rounds=1))
    pre = KFACPreconditioner(model, distributor=distributor, **KW)
    with caplog.at_level(logging.INFO, logger="lightning_spdkfac.comm.auto"):
        sgd_kfac_steps(model, pre, data, 20, 1)
        assert _auto_choice(distributor) == "auto still timing its candidates when the run ended (no choice yet)"
        sgd_kfac_steps(model, pre, data, 10, 1)
    assert distributor.chosen is not None and len(distributor.decisions) == 1
    assert "K-FAC schedule=auto at step 28" in caplog.text and "ms/step" in caplog.text
    # the run summary of `spdkfac fit` names the choice
    assert _auto_choice(distributor) == f"auto chose {distributor.labels[distributor.chosen]} at step 28"
    assert _auto_choice(SPDDistributor(SPDOptions())) is None


def test_replan_every_times_the_candidates_again_and_decides_again():
    model = make_model()
    distributor = AutoDistributor(SPDOptions.from_schedule("auto", profile_steps=(1, 3), auto_rounds=1,
                                                           replan_every=10))
    pre = KFACPreconditioner(model, distributor=distributor, **KW)
    sgd_kfac_steps(model, pre, data, 64, 1)
    # decided at 28; 10 steps later (38, an inverse step) the rotation starts again: 24 steps -> 62
    assert [d["step"] for d in distributor.decisions] == [28, 62]
