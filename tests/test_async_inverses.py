"""async_inverses: inversions off the caller's thread, swapped in at the next step, exactly one step staler.

The reference is the dense float64 spec of tests/test_reference.py with one change, the documented one:
step k preconditions with the inverses of the factors of the last inverse step *before* k (step 0, and a
layer's first inverse step, with its own: there is nothing older), each at the damping of the step that
computed them.
"""

from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch
from helpers.dense_reference import (
    F64,
    Recorder,
    assert_close,
    damped_invs,
    grad_matrix,
    ref_factors,
    ref_precondition,
)
from test_reference import layer_names, make_pre, run_step, small_net, sq_loss
from torch import nn

from lightning_spdkfac import KFACPreconditioner
from lightning_spdkfac.kfac.distributor import Distributor, PendingInverses


def _damping_at(k):
    return 0.02 * (k + 1)


@pytest.mark.parametrize("inv_update_steps", [1, 2, 3])
def test_async_inverses_equal_the_inverses_of_the_previous_inverse_step(inv_update_steps):
    torch.manual_seed(4)
    tol = 1e-9
    model = small_net(F64)
    names = layer_names(model)
    kl_clip, lr = 1e-4, 0.1
    pre = make_pre(model, "f64", damping=_damping_at, factor_decay=0.5, kl_clip=kl_clip, lr=lr,
                   inv_update_steps=inv_update_steps, async_inverses=True)
    rec = Recorder(model, names)
    running: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    in_use = None  # (factors, damping) the step preconditions with
    launched = None  # ... and the ones an inverse step launched, for the next step
    for k in range(7):
        x = torch.randn(4 + k, 2, 6, 6, dtype=F64) * (1 + k)
        grads = run_step(model, pre, rec, [x], sq_loss)
        for n in names:
            A_new, G_new = ref_factors(rec, n)
            running[n] = (A_new, G_new) if k == 0 else tuple(0.5 * o + 0.5 * f for o, f in zip(running[n], (A_new, G_new)))
        if launched is not None:  # swapped in at the start of this step
            in_use, launched = launched, None
        snapshot = ({n: (running[n][0].clone(), running[n][1].clone()) for n in names}, _damping_at(k))
        if k == 0:
            in_use = snapshot  # first inverses: computed at once
        elif k % inv_update_steps == 0:
            launched = snapshot  # this step still uses the previous ones
        src, damping = in_use
        A_invs, G_invs = zip(*(damped_invs(*src[n], damping) for n in names))
        P, _ = ref_precondition([grads[n] for n in names], A_invs, G_invs, kl_clip, lr)
        for n, p in zip(names, P, strict=True):
            assert_close(grad_matrix(rec.modules[n]), p, tol)
        if k > 0 and k % inv_update_steps == 0:
            # Not the fresh inverses: the staleness is real.
            fresh = damped_invs(*running[names[0]], _damping_at(k))[0]
            assert not torch.allclose(pre.layers[names[0]].A_inv.to(F64), fresh, rtol=1e-3, atol=1e-6)
    pre.remove_hooks()


def _train(model, steps, seed=1, **kw):
    pre = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=2, lr=0.1, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 8, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        pre.step(opt)
        opt.step()
    return pre, opt, g


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 4))


@pytest.mark.parametrize("method", ["cholesky", "eigen"])
def test_a_checkpoint_taken_while_inversions_are_in_flight_resumes_bitwise(method):
    """state_dict() right after an inverse step (the inversions still in flight) holds a step-boundary state:
    a preconditioner resumed from it continues exactly like the uninterrupted one."""
    ref_model = _mlp()
    model = copy.deepcopy(ref_model)
    ref_pre, _, _ = _train(ref_model, 8, async_inverses=True, inverse_method=method)

    pre, opt, g = _train(model, 5, async_inverses=True, inverse_method=method)  # step k=4 launched inversions
    assert pre.inverter.in_flight is not None
    state = copy.deepcopy(pre.state_dict())
    assert pre.inverter.in_flight is None  # settled by state_dict
    weights = copy.deepcopy(model.state_dict())
    pre.remove_hooks()

    resumed = _mlp()
    resumed.load_state_dict(weights)
    pre2 = KFACPreconditioner(resumed, factor_update_steps=1, inv_update_steps=2, lr=0.1, async_inverses=True,
                              inverse_method=method)
    pre2.load_state_dict(state)
    opt2 = torch.optim.SGD(resumed.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(16, 8, generator=g)
        opt2.zero_grad()
        resumed(x).pow(2).mean().backward()
        pre2.step(opt2)
        opt2.step()
    for a, b in zip(ref_model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    for n in ref_pre.layers:
        assert torch.equal(ref_pre.layers[n].A_inv, pre2.layers[n].A_inv)


class _Gated(Distributor):
    """One process, with the worker held until the test opens the gate (or failing, when told)."""

    is_local = True

    def __init__(self, fail=False):
        self.gate = threading.Event()
        self.fail = fail
        self.launched = 0

    def invert_async(self, tasks, invert_fn):
        tasks = list(tasks)
        self.launched += 1

        def run():
            assert self.gate.wait(30)
            if self.fail:
                raise RuntimeError("simulated broadcast failure")
            return [(i, w, inv) for (i, w, _), inv in zip(tasks, invert_fn(tasks))]

        return PendingInverses(run, torch.device("cpu"), timeout=30)


def test_the_step_after_an_inverse_step_waits_for_the_inversions_and_uses_them():
    dist = _Gated()
    model = _mlp()
    pre, opt, g = _train(model, 3, async_inverses=True, distributor=dist)  # steps 0 (sync), 1, 2 (launch)
    assert dist.launched == 1 and pre.inverter.in_flight is not None and not pre.inverter.in_flight.pending.done()
    held = {n: ly.A_inv.clone() for n, ly in pre.layers.items()}
    threading.Timer(0.2, dist.gate.set).start()
    x = torch.randn(16, 8, generator=g)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    pre.step(opt)  # blocks until the gate opens, then swaps in
    assert pre.inverter.in_flight is None
    assert pre.timer.last["inverse_wait"] > 0.05
    assert all(not torch.equal(held[n], ly.A_inv) for n, ly in pre.layers.items())


def test_a_failed_worker_raises_on_the_next_step_and_keeps_the_inverses_held():
    dist = _Gated(fail=True)
    model = _mlp()
    pre, opt, g = _train(model, 3, async_inverses=True, distributor=dist)
    held = {n: (ly.A_inv.clone(), ly.G_inv.clone()) for n, ly in pre.layers.items()}
    dist.gate.set()
    opt.zero_grad()
    model(torch.randn(16, 8, generator=g)).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match="simulated broadcast failure"):
        pre.step(opt)
    assert pre.inverter.in_flight is None
    for n, ly in pre.layers.items():  # none of the failed round's inverses swapped in
        assert torch.equal(held[n][0], ly.A_inv) and torch.equal(held[n][1], ly.G_inv)
    dist.fail = False
    pre.step(opt)  # the run can go on (the next inverse step launches a new round)
    assert pre.steps == 4


def test_a_worker_past_its_timeout_is_abandoned_with_a_clear_error():
    gate = threading.Event()

    def run():
        gate.wait(10)
        return []

    pending = PendingInverses(run, torch.device("cpu"), timeout=0.05)
    with pytest.raises(TimeoutError, match="did not finish within 0.05 s"):
        pending.wait()
    gate.set()


def test_loading_a_state_drops_the_inversions_in_flight():
    dist = _Gated()
    model = _mlp()
    other = copy.deepcopy(model)
    pre_other, _, _ = _train(other, 2)
    state = pre_other.state_dict()
    pre, opt, g = _train(model, 3, async_inverses=True, distributor=dist)
    assert pre.inverter.in_flight is not None
    dist.gate.set()
    pre.load_state_dict(state)
    assert pre.inverter.in_flight is None
    for n, ly in pre.layers.items():
        assert torch.equal(ly.A_inv, pre_other.layers[n].A_inv)


def test_fallback_warnings_of_the_worker_are_given_on_the_callers_thread_at_the_swap():
    """A factor the worker could not invert by Cholesky warns and counts once swapped in, like the sync path."""
    model = _mlp()
    pre, opt, g = _train(model, 2, async_inverses=True, damping=0.0)
    layer = next(iter(pre.layers.values()))
    layer.A.zero_()  # singular with damping 0: the ladder falls back
    layer.A[0, 0] = 1.0
    before = pre.inverse_fallbacks
    opt.zero_grad()
    model(torch.randn(16, 8, generator=g)).pow(2).mean().backward()
    pre.factor_update_steps = 10**9  # keep the broken factor as it is for the launch
    pre.step(opt)  # step 2: launches
    assert pre.inverse_fallbacks == before  # not yet: the worker's reports wait for the swap
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pre.step(opt)  # step 3: swaps in, reports
    assert pre.inverse_fallbacks > before
    assert any("K-FAC layer" in str(w.message) for w in caught)


def test_async_inverses_is_validated_by_name():
    with pytest.raises(TypeError, match="async_inverses"):
        KFACPreconditioner(_mlp(), async_inverses="yes")


# ----------------------------------------------------------------------------- distributed

ASYNC_SCHEDULES = {  # name -> SPDOptions.from_schedule arguments
    "spd": dict(schedule="spd", profile_steps=(1, 3)),  # pipelined: factor all-reduces beside the worker's broadcasts
    "mpd": dict(schedule="mpd"),
    "dkfac": dict(schedule="dkfac"),
    "spd_strategy_flag": dict(schedule="spd", profile_steps=(1, 3), async_inverses=True),  # the strategy's switch
}


def _async_on_ranks(rank, world, inv_update_steps):
    from helpers.training import sgd_kfac_steps
    from test_spd_distributed import BATCH, KFAC_KW, STEPS, data, make_model
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_spdkfac.comm.scheduler import SPDDistributor, SPDOptions

    torch.set_num_threads(1)
    out = {}
    for name, kw in ASYNC_SCHEDULES.items():
        import torch.distributed as dist

        model = make_model()
        distributor = SPDDistributor(SPDOptions.from_schedule(**kw), process_group=dist.new_group())
        flag = "async_inverses" not in kw  # else the strategy's option decides, over the preconditioner's False
        pre = KFACPreconditioner(model, distributor=distributor, **{**KFAC_KW, "inv_update_steps": inv_update_steps},
                                 async_inverses=flag)
        sgd_kfac_steps(DDP(model), pre, data, STEPS, world, rank, BATCH)
        pre.state_dict()  # settles the last launch
        out[name] = ([p.detach().clone() for p in model.parameters()], distributor._async_group is not None,
                     pre.timer.last.get("inverse_async", 0.0))
        pre.remove_hooks()
    return out


@pytest.mark.parametrize("inv_update_steps", [1])
def test_async_inverses_on_two_ranks_agree_bitwise_and_with_one_process(inv_update_steps):
    from helpers.training import sgd_kfac_steps
    from test_spd_distributed import KFAC_KW, STEPS, data, make_model

    from lightning_spdkfac.multiprocess import run_distributed

    results = run_distributed(_async_on_ranks, 2, inv_update_steps, timeout=180)
    model = make_model()
    pre = KFACPreconditioner(model, **{**KFAC_KW, "inv_update_steps": inv_update_steps}, async_inverses=True)
    sgd_kfac_steps(model, pre, data, STEPS, 2)
    reference = [p.detach() for p in model.parameters()]
    sync_model = make_model()
    sgd_kfac_steps(sync_model, KFACPreconditioner(sync_model, **{**KFAC_KW, "inv_update_steps": inv_update_steps}),
                   data, STEPS, 2)
    for name in ASYNC_SCHEDULES:
        params = [r[name][0] for r in results]
        for a, b in zip(*params, strict=True):
            assert torch.equal(a, b), f"{name}: the replicas differ"
        for a, b in zip(params[0], reference, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=f"{name} vs one process")
        # The staleness is visible: not the synchronous run.
        assert any(not torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(params[0], sync_model.parameters()))
        assert results[0][name][1] == (name != "dkfac")  # broadcasts on a group of their own; dkfac sends none
