"""The sync budget (issue 34): host reads of K-FAC per optimizer step, counted on the CPU by
helpers/sync_audit.py, over the library defaults, every-step cadence, eigen, async inverses, loss scaling, SPD
in one process, and the schedules
spd (pipelined, DTF), mpd, dkfac and dpkfac on 2 gloo ranks (at the defaults' cadence, every step, async).

Targets: no host read inside a forward/backward hook in any configuration; at the defaults (and under every
schedule at the defaults' cadence) at most 1 read per step on average, and at most 2 on any one step of the
one-process defaults (an inverse step: the factor check and the inversion check), and at most 2 on any step
of the training thread at a short cadence in one process (every step, eigen, async, fp16-style loss scaling);
every collective issued from the training thread (the thread that runs forward, backward and step; on the
CPU autograd runs there).
`python tests/helpers/sync_report.py` prints the figures and the source lines behind them.

Today (3e40f94) some counts depend on timing: where SPD's measured plan launches a fusion group (inside a
hook or at the step) and whether the async worker broadcasts before the step's wait; the one-process SPD
configuration launches inside hooks on every run. Once no sync is left, each count is 0 whatever the timing.

The harness's self-tests show that each check can fail: a hook's ``.item()`` is caught inside the hook,
a collective from another thread is caught, a read from test code is not counted.
"""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist
from helpers import sync_report as R
from helpers.sync_audit import SyncAudit
from torch import nn

from lightning_spdkfac import KFACOptions
from lightning_spdkfac.multiprocess import run_distributed

RANKS_TIMEOUT = 150  # seconds: bounds the 2-rank job (every rank is killed and reaped past it)
DEFAULT_CADENCE = ("defaults", "defaults_mlp")
SCHEDULES_AT_DEFAULTS = ("spd", "mpd", "dkfac", "dpkfac")  # 2 ranks, the defaults' factor/inverse cadence
# One process, every step a factor step and an inverse step (or every other step): no plan to measure.
ONE_ROUND_PER_STEP = ("every_step", "eigen", "async", "grad_scaler", "functional_every_step", "moe_every_step")


def _ranks(rank, world):
    """The 2-rank job: every configuration of sync_report.RANKED, then the harness's collective self-test."""
    out = R.run_ranked(rank, world, list(R.RANKED))
    out["selftest"] = _collective_selftest(rank)
    return out


def _collective_selftest(rank):
    """Under an audit whose roots are this file: an all_reduce from this (the training) thread, a broadcast
    from another thread, a timed wait on a Work; the summary, plus a wait from outside the roots."""
    with SyncAudit(roots=[__file__]) as audit:
        audit.step = 0
        dist.all_reduce(torch.ones(2))
        errors = []

        def other():
            try:
                dist.broadcast(torch.ones(2), src=0)
            except Exception as e:  # noqa: BLE001  (reported to the test)
                errors.append(repr(e))

        t = threading.Thread(target=other, name="not-training")
        t.start()
        t.join(30)
        dist.all_reduce(torch.ones(2), async_op=True).wait(timeout=datetime.timedelta(seconds=30))
    summary = audit.summary(1)
    summary["errors"] = errors
    summary["collective_list"] = [(c.op, c.thread, c.training_thread) for c in audit.collectives]
    return summary


@pytest.fixture(scope="module")
def local():
    return {name: [R.run_local(name)] for name in R.LOCAL}


@pytest.fixture(scope="module")
def ranked():
    per_rank = run_distributed(_ranks, 2, timeout=RANKS_TIMEOUT)
    return {name: [r[name] for r in per_rank] for name in per_rank[0]}


def _summaries(name, local, ranked):
    return local[name] if name in R.LOCAL else ranked[name]


def _top(s):
    return "\n".join(f"  {c:>4} {where} <- {via} {kind} [{thread}]{' IN HOOK' if h else ''}"
                     for where, via, kind, thread, h, c in s["top"])


# ---------------------------------------------------------------------------------------------- the budget


@pytest.mark.parametrize("name", R.CONFIGS)
def test_no_host_read_inside_hooks(name, local, ranked):
    for rank, s in enumerate(_summaries(name, local, ranked)):
        assert s["hooks_wrapped"] > 0 and s["hook_calls"] > 0, f"{name}: the audit saw no K-FAC hook run"
        assert s["in_hook"] == 0, (f"{name} rank {rank}: {s['in_hook']} host reads inside forward/backward hooks "
                                   f"in {s['steps']} steps:\n{_top(dict(s, top=s['top_in_hook']))}")


@pytest.mark.parametrize("name", R.CONFIGS)
def test_every_collective_from_the_training_thread(name, local, ranked):
    for rank, s in enumerate(_summaries(name, local, ranked)):
        assert s["off_thread_collectives"] == 0, (
            f"{name} rank {rank}: {s['off_thread_collectives']} collectives issued off the training thread "
            f"({s['collectives_by_thread']}): {s['off_thread_top']}")
    if name in R.RANKED:
        assert all(s["collectives"] > 0 for s in ranked[name]), f"{name}: the audit saw no collective"


def test_the_defaults_configuration_is_the_library_defaults():
    options = KFACOptions()
    assert R.INV_DEFAULT == options.inv_update_steps and options.inv_update_steps % options.factor_update_steps == 0
    for name in DEFAULT_CADENCE:
        _, kw, steps, schedule = R.LOCAL[name]
        assert kw == {} and schedule is None and steps >= 2 * options.inv_update_steps
    for name in SCHEDULES_AT_DEFAULTS:
        _, kw, steps = R.RANKED[name]
        assert kw == {} and steps > options.inv_update_steps  # two inverse steps, ten factor steps


@pytest.mark.parametrize("name", DEFAULT_CADENCE)
def test_at_most_one_host_read_per_step_at_the_defaults(name, local):
    (s,) = local[name]
    assert s["reads_per_step"] <= 1.0 and s["max_per_step"] <= 2, (
        f"{name}: {s['reads_per_step']:.2f} host reads per step over {s['steps']} steps (at most 1), "
        f"{s['max_per_step']} at step {s['worst_step']} (at most 2):\n{_top(s)}")


# Every schedule at the defaults' cadence: at most one host read per step on average (dpkfac's per-layer "did the
# owner precondition it" flags stay on the device, kfac/preconditioning.py).
PER_STEP_BUDGET: dict[str, float] = {}


@pytest.mark.parametrize("name", SCHEDULES_AT_DEFAULTS)
def test_at_most_one_host_read_per_step_under_each_schedule_at_the_defaults(name, ranked):
    budget = PER_STEP_BUDGET.get(name, 1.0)
    for rank, s in enumerate(ranked[name]):
        assert s["reads_per_step"] <= budget, (
            f"{name} rank {rank}: {s['reads_per_step']:.2f} host reads per step over {s['steps']} steps "
            f"(at most {budget:g}):\n{_top(s)}")


@pytest.mark.parametrize("name", ONE_ROUND_PER_STEP)
def test_at_most_two_reads_on_any_step_without_a_schedule(name, local):
    """Deliver 1 of the issue, on the steps that need reads: a factor step's non-finite check batched into one
    read, one finiteness read per inversion round (eigen included), the loss scale kept on the device; an
    inverse worker's own reads (async) are not the training thread's."""
    (s,) = local[name]
    # eigen: torch.linalg.eigh reads its error code on the host on a GPU (it has no _ex variant), once per batched
    # call (one per factor shape of a round on a GPU; on a CPU, stacks that MKL would round differently run one
    # factor at a time, kfac/inverse.py): those are counted apart, the package's own reads stay within 2.
    key = "max_per_step_training_without_eigh" if name == "eigen" else "max_per_step_training"
    assert s[key] <= 2, (
        f"{name}: {s[key]} host reads on one step of the training thread (at most 2: the "
        f"factor check and the inversion check), per step {s['per_step']}:\n{_top(s)}")


# ---------------------------------------------------------------------------------------------- the harness


class _Net(nn.Module):
    """A Linear whose forward hook, registered by this file, reads ``.item()`` (and registers a tensor hook that
    reads too): a read inside a hook, as the audit sees it when this file is among its roots."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def hook_up(self):
        def forward_hook(module, inputs, output):
            output.sum().item()
            output.register_hook(lambda g: (bool(g.abs().sum() > 0), None)[1])

        return self.fc.register_forward_hook(forward_hook)


def test_harness_catches_a_read_inside_a_hook_and_counts_reads_of_its_roots_only():
    net = _Net()
    with SyncAudit(roots=[__file__]) as audit:
        handle = net.hook_up()
        audit.step = 0
        loss = net.fc(torch.randn(3, 4)).square().sum()
        loss.backward()
        loss.item()  # a read of this file (a root), outside any hook
        audit.step = 1
        float(loss.detach())
    handle.remove()
    kinds = [(e.kind, e.in_hook, e.step, e.function) for e in audit.events]
    assert ("item", True, 0, "forward_hook") in kinds, kinds
    assert ("__bool__", True, 0, "<lambda>") in kinds, kinds
    assert ("item", False, 0, "test_harness_catches_a_read_inside_a_hook_and_counts_reads_of_its_roots_only") \
        in kinds
    assert ("__float__", False, 1, kinds[-1][3]) in kinds
    assert audit.hooks_wrapped == 2 and audit.hook_calls == 2
    s = audit.summary(2)
    assert s["in_hook"] == 2 and s["per_step"] == [3, 1] and s["max_per_step"] == 3 and s["worst_step"] == 0

    # The same with the default roots (the package): this file's reads are seen, not counted; its hook is
    # not wrapped.
    with SyncAudit() as audit:
        handle = net.hook_up()
        net.fc(torch.randn(3, 4)).sum().backward()
        torch.ones(1).item()
    handle.remove()
    assert audit.events == [] and audit.ignored == 3 and audit.hooks_wrapped == 0


def test_harness_counts_each_kind_of_read():
    with SyncAudit(roots=[__file__]) as audit:
        t = torch.arange(3.0)
        t.tolist(), t.numpy(), t.cpu(), int(t[0]), [0, 1][t[1].long()]
        torch.equal(t, t), torch.tensor([1.0], device="cpu"), torch.as_tensor([1.0], device="cpu")
        torch.linalg.eigh(torch.eye(2))
        buf = torch.zeros(2)
        buf.copy_(torch.tensor([1.0, 2.0]))  # a host tensor into a (device) buffer
        torch.tensor([1.0]).to("cpu")
        buf.copy_(torch.ones(2))  # not a host tensor: no read
        buf[0] = 3.0  # a Python number set into a (device) tensor
        buf[1] = torch.ones(())  # a tensor value: no read
        buf[0].fill_(3.0)  # idem
        torch.ones(2).to("cpu")  # idem
    kinds = sorted(e.kind for e in audit.events)
    assert kinds == sorted(["tolist", "numpy", "cpu", "__int__", "__index__", "torch.equal", "torch.tensor(device=)",
                            "torch.as_tensor(device=)", "linalg.eigh", "copy_(host tensor)",
                            "to(host tensor)", "__setitem__(Python number)"]), kinds


def test_harness_restores_torch_and_refuses_to_nest():
    before = {n: getattr(torch.Tensor, n) for n in ("item", "tolist", "__bool__", "cpu", "copy_", "to", "__setitem__")}
    fns = (torch.tensor, torch.linalg.eigh, dist.all_reduce, dist.distributed_c10d.broadcast, dist.Work.wait,
           nn.Module.register_forward_hook, torch.Tensor.register_hook)
    with SyncAudit() as audit:
        assert torch.Tensor.item is not before["item"] and dist.all_reduce is not fns[2]
        with pytest.raises(RuntimeError, match="another SyncAudit"), SyncAudit():
            pass
    assert {n: getattr(torch.Tensor, n) for n in before} == before
    assert (torch.tensor, torch.linalg.eigh, dist.all_reduce, dist.distributed_c10d.broadcast, dist.Work.wait,
            nn.Module.register_forward_hook, torch.Tensor.register_hook) == fns
    assert audit.events == []


def test_harness_catches_a_collective_off_the_training_thread(ranked):
    for rank, s in enumerate(ranked["selftest"]):
        assert s["errors"] == [], s["errors"]
        ops = s["collective_list"]
        assert ("all_reduce", "MainThread", True) in ops and ("broadcast", "not-training", False) in ops, ops
        assert s["off_thread_collectives"] == 1, (rank, ops)
        assert s["by_kind"] == {"Work.wait(timeout)": 1}, s["by_kind"]
