"""Distributed faults on 2 gloo processes: a rank that dies or stalls makes the other fail within
``comm_timeout_s`` with an error naming the collective and the phase (never a hang); a failed step leaves no
stale buffer for the next one; ranks that hold different plans fail loudly at the plan check.

Each fault is injected in one rank and the outcome checked against what is computed independently: the
expected factors and inverses are rebuilt from their seeds in the test process, the placement each rank used
is recorded where it was made."""

from __future__ import annotations

import inspect
import multiprocessing as mp
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_spdkfac import KFACPreconditioner
from lightning_spdkfac.comm import FusedAllReduce, InverseBroadcaster
from lightning_spdkfac.comm.consistency import PlanMismatchError, check_plan_consistency, plan_fingerprint
from lightning_spdkfac.comm.faults import FACTOR_ALLREDUCE, INVERSE_BROADCAST, KFACCommError
from lightning_spdkfac.comm.scheduler import SPDDistributor, SPDOptions
from lightning_spdkfac.multiprocess import RankFailure, run_distributed

pytestmark = pytest.mark.timeout(120)

KFAC_KW = dict(damping=0.05, kl_clip=1e-2, lr=0.1, factor_update_steps=1, inv_update_steps=2)  # factors every step
COMM_TIMEOUT = 5.0  # comm_timeout_s of the kill and stall tests
HANG = 60  # the harness's and the process group's own timeout: where a hang would end


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 12), nn.Tanh(), nn.Linear(12, 4))


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g)


def error_record(err: KFACCommError, **extra) -> dict:
    return dict(type=type(err).__name__, message=str(err), phase=err.phase, collective=err.collective,
                what=err.what, timed_out=err.timed_out, cause=repr(err.__cause__), **extra)


def spd_training(rank, world, inject):
    """SPD-KFAC (pipelined, layer-wise groups, round-robin inverses) with identical data on both ranks, so
    no gradient reduction is needed; ``inject(rank, distributor, pre)`` plants the fault."""
    torch.set_num_threads(1)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    options = SPDOptions.from_schedule("spd", fusion="layerwise", placement="round_robin",
                                       comm_timeout_s=COMM_TIMEOUT)
    distributor = SPDDistributor(options, process_group=dist.new_group())
    pre = KFACPreconditioner(model, distributor=distributor, **KFAC_KW)
    inject(rank, distributor, pre)
    for step in range(4):
        x, y = batch(step)
        opt.zero_grad()
        t0 = time.monotonic()
        try:
            F.cross_entropy(model(x), y).backward()
            launched = distributor._fused.launched_groups
            pre.step()
        except KFACCommError as err:
            fused = distributor._fused
            try:
                fused.begin_step()
                refused = None
            except RuntimeError as again:
                refused = str(again)
            return error_record(err, step=step, elapsed=time.monotonic() - t0, launched=launched,
                                groups=len(fused.groups), buffers_dropped=all(b is None for b in fused._buffers),
                                refused=refused)
        opt.step()
    return "finished"


# ------------------------------------------------------------------------------------- rank 1 dies
KILL_STEP = 2  # a pipelined step (step 0 learns the hook counts), factor all-reduces launched from hooks


def die_in_backward(rank, distributor, pre):
    if rank != 1:
        return
    submit = distributor.factor_final

    def factor_final(index, which, matrix):
        if pre.steps == KILL_STEP and (index, which) == (0, "G"):  # the last factor of the backward
            fused = distributor._fused
            for g in fused.launched_groups:  # every group but the last one is complete on both ranks
                fused.wait_group(g)
            os._exit(1)
        submit(index, which, matrix)

    distributor.factor_final = factor_final


def test_killed_rank_fails_the_other_fast_naming_the_factor_all_reduce():
    rank0, rank1 = run_distributed(spd_training, 2, die_in_backward, timeout=HANG, allow_failures=True)
    assert isinstance(rank1, RankFailure) and rank1.exitcode == 1, rank1
    assert isinstance(rank0, dict), rank0  # rank 0 raised KFACCommError (did not finish, did not hang)
    assert rank0["step"] == KILL_STEP and rank0["type"] == "KFACCommError"
    # The factor all-reduces of layers 2 and 1 were launched from rank 0's hooks before it waited.
    assert len(rank0["launched"]) == rank0["groups"] == 6
    assert rank0["phase"] == FACTOR_ALLREDUCE and rank0["collective"] == "all_reduce"
    message = rank0["message"]
    for part in ("K-FAC factor all-reduce failed", "all_reduce of fusion group", "on rank 0 of 2",
                 "comm_timeout_s=5", "other ranks' logs", "restart"):
        assert part in message, (part, message)
    # The group that rank 1 never launched: the last one, layer 0's G (layers 0-2: A0 A1 A2 G2 G1 G0).
    assert rank0["what"] == "fusion group 5 of 6 (factors layer 0 G)", rank0["what"]
    # The peer's death was reported by gloo (the cause is kept), long before the timeout, let alone a hang
    # (timed on rank 0 from the start of the step; the harness's wall time includes starting processes).
    assert not rank0["timed_out"] and "RuntimeError" in rank0["cause"]
    assert rank0["elapsed"] < COMM_TIMEOUT, rank0["elapsed"]
    # The abandoned step left nothing to read, and the executor refuses to go on until reset().
    assert rank0["buffers_dropped"]
    assert "abandoned a step" in rank0["refused"] and "reset()" in rank0["refused"]
    assert not [p for p in mp.active_children() if p.name.startswith("rank")]  # no process left behind


# ------------------------------------------------------------------------------------- rank 1 stalls
STALL_STEP = 2  # an inverse step (inv_update_steps=2)


def stall_before_inverses(rank, distributor, pre):
    if rank != 1:
        return
    invert = distributor.invert

    def slow_invert(tasks, invert_fn, on_ready):
        if pre.steps == STALL_STEP:
            time.sleep(COMM_TIMEOUT + 1.5)
            try:
                invert(tasks, invert_fn, on_ready)
            finally:  # rank 0 has given up: stop here, whatever this round does
                raise SystemExit(0)
        invert(tasks, invert_fn, on_ready)

    distributor.invert = slow_invert


def test_stalled_rank_fails_the_other_at_the_timeout_naming_the_inverse_broadcast():
    rank0, rank1 = run_distributed(spd_training, 2, stall_before_inverses, timeout=HANG, allow_failures=True)
    assert isinstance(rank0, dict), rank0
    assert rank0["step"] == STALL_STEP and rank0["phase"] == INVERSE_BROADCAST
    assert rank0["collective"] == "broadcast" and rank0["timed_out"]
    message = rank0["message"]
    for part in ("K-FAC inverse broadcast failed", "broadcast of the inverse of factor layer",
                 "(from its owner, rank 1)", "on rank 0 of 2", "did not complete within comm_timeout_s=5 s",
                 "stalled", "raise comm_timeout_s"):
        assert part in message, (part, message)
    assert "timed out" in rank0["cause"]
    # Bounded by the timeout: not earlier (rank 1 was alive), and nowhere near a hang.
    assert COMM_TIMEOUT <= rank0["elapsed"] < COMM_TIMEOUT + 3, rank0["elapsed"]
    assert isinstance(rank1, RankFailure) and "SystemExit" in rank1.message  # it woke up and stopped
    assert not [p for p in mp.active_children() if p.name.startswith("rank")]


# ------------------------------------------------------------------- no stale data after a failed step
SIDES = [3, 5, 4]
GROUPS = [[0], [1, 2]]
T_STALE = 3.0  # executor timeout of the stale-buffer test
LATE = 1.0  # rank 1 arrives this long after rank 0 gave up, when rank 0 has packed its next step


def sym(seed, n):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, n + 2, generator=g, dtype=torch.float64)
    m = x @ x.T / (n + 2)
    return ((m + m.T) / 2).float()  # exactly symmetric: the triangle round trip is exact


def factor(step, rank, index):
    return sym(1000 * step + 100 * rank + index, SIDES[index])


def late_peer(rank, world):
    """Step 1: rank 1 arrives after rank 0's wait timed out. Rank 0 abandons the step, resets and runs
    step 2 at once; rank 1's late step-1 all-reduces then complete against rank 0's abandoned ones."""
    group = dist.new_group()
    out = {}
    fused = FusedAllReduce(GROUPS, SIDES, process_group=group, timeout=T_STALE)
    fused.begin_step()
    if rank == 1:
        time.sleep(T_STALE + LATE)
    for i in range(len(SIDES)):
        fused.submit(i, factor(1, rank, i))
    if rank == 0:
        with pytest.raises(KFACCommError) as info:
            fused.wait()
        out["error"] = error_record(info.value)
        with pytest.raises(RuntimeError, match="abandoned a step") as refused:
            fused.begin_step()
        out["refused"] = str(refused.value)
        fused.reset()
    else:
        out["step1"] = fused.wait()
    fused.begin_step()
    for i in range(len(SIDES)):
        fused.submit(i, factor(2, rank, i))
    out["step2"] = fused.wait()

    # The same for inverse broadcasts: rank 1 owns factor 0 and publishes it late.
    bc = InverseBroadcaster([1, 0], SIDES[:2], process_group=group, timeout=T_STALE, names=["A", "B"])
    bc.begin_round()
    if rank == 1:
        time.sleep(T_STALE + LATE)
    bc.exchange(lambda i: factor(10, 0, i))  # round 1's "inverses"
    if rank == 0:
        with pytest.raises(KFACCommError) as info:
            bc.wait_all()
        out["bc_error"] = error_record(info.value)
        with pytest.raises(RuntimeError, match="abandoned a round"):
            bc.begin_round()
        bc.reset()
    else:
        out["round1"] = bc.wait_all()
    bc.begin_round()
    bc.exchange(lambda i: factor(20, 0, i))  # round 2's
    out["round2"] = bc.wait_all()
    return out


def test_failed_step_leaves_no_stale_buffer_for_the_next():
    rank0, rank1 = run_distributed(late_peer, 2, timeout=HANG)
    err = rank0["error"]
    assert err["phase"] == FACTOR_ALLREDUCE and err["timed_out"] and "fusion group 0 of 2 (factors 0)" in err["what"]
    assert "reset()" in rank0["refused"]
    # Reference: the averages, computed here from the seeds.
    for step, results in ((1, rank1["step1"]), (2, rank0["step2"]), (2, rank1["step2"])):
        for i, got in enumerate(results):
            want = (factor(step, 0, i).double() + factor(step, 1, i).double()) / 2
            torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-7, msg=f"step {step} factor {i}")
    # Rank 0 packed step 2 while its step-1 all-reduces were still pending (they completed when rank 1
    # arrived): had a step-1 buffer been reused, step 2 would hold a mix of both steps.
    berr = rank0["bc_error"]
    assert berr["phase"] == INVERSE_BROADCAST and berr["what"] == "the inverse of factor A (from its owner, rank 1)"
    for r in (rank0, rank1):
        for i in (0, 1):
            assert torch.equal(r["round2"][i], factor(20, 0, i)), i  # exact: fp32 triangle round trip
    assert torch.equal(rank1["round1"][0], factor(10, 0, 0)) and torch.equal(rank1["round1"][1], factor(10, 0, 1))


def backend_refuses(rank, world):
    """The backend raises when a collective is issued (as it may once it knows a peer is gone)."""
    group = dist.new_group()

    def refuse(*args, **kwargs):
        raise RuntimeError("Connection closed by peer (injected)")

    dist.all_reduce = dist.broadcast = refuse
    out = {}
    fused = FusedAllReduce(GROUPS, SIDES, process_group=group, timeout=5.0)
    fused.begin_step()
    try:
        fused.submit(0, factor(1, rank, 0))  # group 0 is complete: its launch fails
    except KFACCommError as err:
        out["fused"] = error_record(err, kept=fused.failure is err)
    try:
        fused.submit(1, factor(1, rank, 1))
    except RuntimeError as err:
        out["fused_next"] = str(err)
    bc = InverseBroadcaster([0, 1], SIDES[:2], process_group=group, timeout=5.0)
    bc.begin_round()
    try:
        bc.exchange(lambda i: factor(10, 0, i))
    except KFACCommError as err:
        out["bc"] = error_record(err)
    return out


def test_launch_failure_is_named_and_abandons_the_step():
    for rank, out in enumerate(run_distributed(backend_refuses, 2, timeout=HANG)):
        err = out["fused"]
        assert err["phase"] == FACTOR_ALLREDUCE and not err["timed_out"] and "(injected)" in err["cause"]
        assert err["what"] == "fusion group 0 of 2 (factors 0)" and err["kept"]
        assert "could not be launched (RuntimeError: Connection closed by peer (injected)" in err["message"]
        assert f"on rank {rank} of 2" in err["message"]
        assert "abandoned a step" in out["fused_next"]
        err = out["bc"]
        assert err["phase"] == INVERSE_BROADCAST and err["collective"] == "broadcast"
        assert err["what"] == "the inverse of factor 0 (from its owner, " + ("this rank)" if rank == 0 else "rank 0)")


# --------------------------------------------------------------------------------- plan consistency
def mismatched_placement(rank, world):
    """Rank 1's placement planner hands out the other rank's factors: the plan check must catch it."""
    seen = {}
    plan = SPDDistributor._plan_placement

    def placement(self):
        owners = plan(self)
        seen["planned"] = list(owners)
        if rank == 1:
            owners = tuple(1 - o if o >= 0 else o for o in owners)
        seen["used"] = list(owners)
        return owners

    SPDDistributor._plan_placement = placement
    group = dist.new_group()
    options = SPDOptions.from_schedule("mpd", comm_timeout_s=20.0)
    out = {"seen": seen}
    try:
        KFACPreconditioner(make_model(), distributor=SPDDistributor(options, process_group=group), **KFAC_KW)
    except PlanMismatchError as err:
        out["placement"] = (str(err), err.parts, err.ranks)
    # The check itself, straight: equal plans pass; different fusion groups on rank 1 are named as such.
    order, sides, owners = [(0, "A"), (1, "A"), (1, "G"), (0, "G")], [7, 17, 12, 16], [0, 1, -1, 0]
    check_plan_consistency(order, [[0, 1], [2, 3]], owners, sides, group, timeout_s=20.0)
    out["consistent"] = True
    groups = [[0, 1], [2, 3]] if rank == 0 else [[0], [1, 2, 3]]
    try:
        check_plan_consistency(order, groups, owners, sides, group, timeout_s=20.0)
    except PlanMismatchError as err:
        out["groups"] = (str(err), err.parts, err.ranks)
    return out


def test_ranks_with_different_plans_fail_loudly_on_every_rank():
    results = run_distributed(mismatched_placement, 2, timeout=HANG)
    r0, r1 = (r["seen"] for r in results)
    assert r0["planned"] == r1["planned"] and r0["used"] == r0["planned"] and r1["used"] != r0["used"]
    for rank, out in enumerate(results):
        assert "placement" in out, f"rank {rank} did not detect the placement mismatch"
        message, parts, ranks = out["placement"]
        assert parts == ("owners",) and ranks == (1,)
        assert f"seen on rank {rank} of 2" in message and "placement owners" in message
        assert f"rank 0 has {r0['used']}" in message and f"rank 1 has {r1['used']}" in message, message
        assert "factor order" not in message and "fusion groups" not in message
        assert out["consistent"]
        message, parts, ranks = out["groups"]
        assert parts == ("groups",) and ranks == (1,)
        assert "rank 0 has [[0, 1], [2, 3]]" in message and "rank 1 has [[0], [1, 2, 3]]" in message, message


def one_rank_hangs(rank, world):
    if rank == 1:
        time.sleep(600)
    return "done"


def test_harness_with_allow_failures_reports_a_hanging_rank_and_reaps_it():
    t0 = time.monotonic()
    rank0, rank1 = run_distributed(one_rank_hangs, 2, timeout=1.5, allow_failures=True)
    assert rank0 == "done" and isinstance(rank1, RankFailure) and rank1.rank == 1
    assert rank1.message == "did not finish within 1.5 s (killed)"
    assert time.monotonic() - t0 < 30
    assert not [p for p in mp.active_children() if p.name.startswith("rank")]


# ------------------------------------------------------------------------------------ one process
def test_fingerprint_options_and_arguments():
    base = dict(order=[(0, "A"), (0, "G")], groups=[[0, 1]], owners=[0, 1], sides=[3, 4])
    fp = plan_fingerprint(**base)
    assert fp == plan_fingerprint(order=[[0, "A"], [0, "G"]], groups=((0, 1),), owners=(0, 1), sides=(3, 4))
    assert all(0 <= v < 2**63 for v in fp.values())
    for part, other in (("order", [(0, "G"), (0, "A")]), ("groups", [[0], [1]]), ("owners", [1, 0]),
                        ("sides", [3, 5])):
        changed = plan_fingerprint(**{**base, part: other})
        assert [k for k in fp if fp[k] != changed[k]] == [part]
    # One process: nothing to compare, no collective.
    check_plan_consistency(**base)

    assert SPDOptions(comm_timeout_s=2).comm_timeout_s == 2
    for bad, exc in ((0, ValueError), (-1.0, ValueError), (float("inf"), ValueError), (float("nan"), ValueError),
                     ("5", TypeError), (True, TypeError)):
        with pytest.raises(exc, match="comm_timeout_s"):
            SPDOptions(comm_timeout_s=bad)
    with pytest.raises(ValueError, match="timeout must be a positive, finite number of seconds"):
        FusedAllReduce([[0]], [2], timeout=0)
    with pytest.raises(TypeError, match="timeout must be"):
        InverseBroadcaster([0], [2], timeout="1")
    # The strategies take the option by name (LightningCLI reads their signatures).
    from lightning_spdkfac.lightning.deepspeed import SPDKFACDeepSpeedStrategy
    from lightning_spdkfac.lightning.strategy import SPD_ARGUMENTS, SPDKFACStrategy, _spd_options

    assert "comm_timeout_s" in SPD_ARGUMENTS
    for cls in (SPDKFACStrategy, SPDKFACDeepSpeedStrategy):
        assert inspect.signature(cls.__init__).parameters["comm_timeout_s"].default == 600.0
    arguments = {k: p.default for k, p in inspect.signature(SPDKFACStrategy.__init__).parameters.items()}
    assert _spd_options({**arguments, "comm_timeout_s": 7.5}).comm_timeout_s == 7.5
