"""SPD-KFAC, MPD-KFAC and D-KFAC on 2 gloo processes (plain PyTorch + DDP): same parameters as each
other and as one process on the concatenated batch; the SPD plan is made and used."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from helpers.training import sgd_kfac_steps
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_spdkfac import KFACPreconditioner
from lightning_spdkfac.comm.scheduler import SPDDistributor, SPDOptions
from lightning_spdkfac.multiprocess import run_distributed

STEPS, BATCH = 7, 8  # per-rank batch
KFAC_KW = dict(damping=0.05, kl_clip=1e-2, lr=0.1, factor_update_steps=1, inv_update_steps=2)  # factors every step


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 8, 3, stride=2, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(8 * 4 * 4, 24), nn.Tanh(), nn.Linear(24, 5),
    )


def data(step, world):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH * world, 2, 8, 8, generator=g)
    y = torch.randint(0, 5, (BATCH * world,), generator=g)
    return x, y


def train_ranked(rank, world, options):
    torch.set_num_threads(1)
    model = make_model()
    ddp = DDP(model)
    distributor = SPDDistributor(options, process_group=dist.new_group())
    pre = KFACPreconditioner(model, distributor=distributor, **KFAC_KW)
    sgd_kfac_steps(ddp, pre, data, STEPS, world, rank, BATCH)
    plan = distributor.describe()
    plan.pop("models")
    plan["last_phases"] = dict(pre.timer.last)
    return [p.detach().clone() for p in model.parameters()], plan


# The schedules, trained one after the other in the same pair of rank processes: name -> the
# arguments of SPDOptions.from_schedule.
SCHEDULES = {
    "dkfac": dict(schedule="dkfac"),
    "mpd": dict(schedule="mpd"),
    "spd": dict(schedule="spd", profile_steps=(1, 3)),
    "spd_bf16": dict(schedule="spd", profile_steps=(1, 3), comm_dtype="bfloat16"),
    # re-measure at factor step 4 (steps 4, 5), re-plan at step 6
    "spd_replan": dict(schedule="spd", profile_steps=(1, 3), replan_every=4),
}


def all_schedules(rank, world):
    return {name: train_ranked(rank, world, SPDOptions.from_schedule(**kw)) for name, kw in SCHEDULES.items()}


def one_process():
    model = make_model()
    sgd_kfac_steps(model, KFACPreconditioner(model, **KFAC_KW), data, STEPS, 2)
    return [p.detach() for p in model.parameters()]


@pytest.fixture(scope="module")
def job():
    """One 2-rank job for every schedule (process start-ups: once per module) and the one-process run.

    ``results[rank][name]`` is (parameters, plan) with the plan's phase times taken out into
    ``phases[name]`` (one dict per rank), so that the plans compare without them.
    """
    results = run_distributed(all_schedules, 2, timeout=120)
    phases = {name: [r[name][1].pop("last_phases") for r in results] for name in SCHEDULES}
    return SimpleNamespace(results=results, phases=phases, reference=one_process())


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedule_agrees_with_dkfac_and_with_one_process(job, name):
    results, reference = job.results, job.reference
    params = [r[name][0] for r in results]
    if name == "spd_bf16":
        # bf16 messages (factors and inverses rounded to 8 mantissa bits): the replicas still agree
        # exactly, and the training moved the parameters nearly where fp32 did.
        assert all(torch.equal(a, b) for a, b in zip(*params))
        init = list(make_model().parameters())
        moved = torch.cat([(b - i).flatten() for b, i in zip(reference, init)]).norm()
        off = torch.cat([(a - b).flatten() for a, b in zip(params[0], reference)]).norm()
        print(f"bf16 relative deviation {float(off / moved):.4f}")
        assert off / moved < 0.1
    else:
        for a, b in zip(params[0], params[1]):
            assert torch.equal(a, b), f"{name}: the replicas differ"
        for a, b in zip(params[0], results[0]["dkfac"][0]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=f"{name} vs dkfac")
        for a, b in zip(params[0], reference):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=f"{name} vs one process")

    for p in job.phases[name]:  # the last step (6) is an inverse step: every phase of a distributed step ran
        for phase in ("factor_compute", "factor_comm_inflight", "factor_pack", "inverse_compute", "precondition"):
            assert p[phase] > 0, (phase, p)

    plan = results[0][name][1]
    n_factors = 8
    if name in ("dkfac", "mpd", "spd"):
        assert plan == results[1][name][1]  # every rank planned the same
    if name == "dkfac":
        assert plan["owners"] == [-1] * n_factors and not plan["pipelined"]
    elif name == "mpd":
        assert sorted(plan["owners"]) == [0, 0, 0, 0, 1, 1, 1, 1]
    elif name == "spd":
        assert plan["pipelined"] and not plan["measuring"]
        assert sorted(i for g in plan["groups"] for i in g) == list(range(n_factors))
        # measured ready order: the A factors come in forward order before the G factors
        assert [k for k in plan["order"] if k[1] == "A"] == [(0, "A"), (1, "A"), (2, "A"), (3, "A")]
        assert plan["order"].index((3, "A")) < plan["order"].index((3, "G"))
    elif name == "spd_replan":
        assert plan["pipelined"] and not plan["measuring"] and plan == results[1][name][1]


def test_some_schedule_waits_for_broadcast_inverses(job):
    phases = [p for per_rank in job.phases.values() for p in per_rank]
    assert max(p["inverse_comm_wait"] for p in phases) > 0  # mpd / spd broadcast inverses
