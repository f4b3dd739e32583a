"""The pieces that keep K-FAC's hot path free of host synchronisation (issue 34), each against an independent
reference: NCCL-style waits, timeout recognition, the plan clock, device-side presence of fused factors, the KL
clip's per-layer weights, and the inverse worker's hand-over to the caller's thread."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch

from lightning_spdkfac.comm import faults
from lightning_spdkfac.comm.clock import HostClock, clock_for
from lightning_spdkfac.comm.fused import FusedAllReduce
from lightning_spdkfac.kfac.distributor import PendingInverses
from lightning_spdkfac.kfac.preconditioning import _lr_weights


class _Work:
    def __init__(self, error: Exception | None = None) -> None:
        self.calls: list[dict[str, object]] = []
        self.error = error

    def wait(self, **kwargs: object) -> bool:
        self.calls.append(kwargs)
        if self.error is not None:
            raise self.error
        return True


def _wait(work: _Work, stream_only: bool) -> None:
    faults.wait_work(work, 5.0, collective="all_reduce", phase=faults.FACTOR_ALLREDUCE, what="group 0", rank=0,
                     world_size=2, stream_only=stream_only)


def test_stream_ordered_waits_pass_no_timeout_and_host_waits_do():
    nccl, gloo = _Work(), _Work()
    _wait(nccl, stream_only=True)
    _wait(gloo, stream_only=False)
    assert nccl.calls == [{}]  # Work.wait(): NCCL orders the stream, the host goes on
    assert gloo.calls == [{"timeout": timedelta(seconds=5.0)}]


@pytest.mark.parametrize("message", [
    "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=10, "
    "NumelOut=10, Timeout(ms)=600000) ran for 600015 milliseconds before timing out.",
    "NCCL communicator was aborted on rank 0 due to a collective operation timeout",
    "Operation timed out!",
])
def test_backend_timeouts_nccl_watchdog_included_are_reported_as_timeouts(message):
    with pytest.raises(faults.KFACCommError) as info:
        _wait(_Work(RuntimeError(message)), stream_only=True)
    assert info.value.timed_out and "did not complete within comm_timeout_s=5 s" in str(info.value)


def test_a_peer_failure_is_not_a_timeout():
    with pytest.raises(faults.KFACCommError) as info:
        _wait(_Work(RuntimeError("Connection closed by peer [127.0.0.1]:1234")), stream_only=False)
    assert not info.value.timed_out and "failed (RuntimeError: Connection closed by peer" in str(info.value)


def test_stream_ordered_is_false_without_torch_distributed():
    assert not faults.stream_ordered(None)


def test_the_cpu_clock_is_the_host_clock_and_measures_elapsed_seconds():
    clock = clock_for("cpu")
    assert isinstance(clock, HostClock)
    start = clock.stamp()
    time.sleep(0.01)
    (seconds,) = clock.seconds(start, [clock.stamp()])
    assert 0.009 <= seconds < 5.0


def test_missing_factors_stay_on_the_device_until_asked():
    a, c = torch.eye(2) * 3.0, torch.eye(2) * 5.0
    fused = FusedAllReduce([[0, 1], [2]], [2, 2, 2], allow_missing=True)
    fused.begin_step()
    fused.submit(0, a)
    fused.submit(1, None)
    fused.submit(2, c)
    results = fused.wait(defer_missing=True)
    assert torch.equal(results[0], a) and torch.equal(results[2], c)
    assert torch.equal(results[1], torch.zeros(2, 2))  # no rank had it: zeros, and a False flag
    assert [bool(f) for f in fused.last_present] == [True, False, True]
    fused.begin_step()
    fused.submit(0, a)
    fused.submit(1, None)
    fused.submit(2, None)
    resolved = fused.wait()  # the default: None where no rank had data (one host read for the step)
    assert torch.equal(resolved[0], a) and resolved[1] is None and resolved[2] is None


class _Layer:
    def __init__(self, index: int) -> None:
        self.index = index


@pytest.mark.parametrize("lrs", [[0.1, 0.1, 0.1], [0.1, 0.2, 0.2, 0.1, 3e-4], [1e20, 0.0]])
def test_kl_clip_weights_are_filled_on_the_device_with_the_host_values(lrs):
    layers = tuple(_Layer(i) for i in range(len(lrs)))
    unscale = 1.0 / 1024.0**2
    got = _lr_weights(dict(enumerate(lrs)), layers, unscale, torch.zeros(1, dtype=torch.float64))
    want = torch.tensor([lr**2 * unscale for lr in lrs], dtype=torch.float64)  # the old host-built weights
    assert torch.equal(got, want)


def test_the_worker_computes_and_the_hand_over_runs_on_the_waiting_thread():
    threads: dict[str, int] = {}
    inverse = torch.ones(2, 2)

    def run():
        threads["run"] = threading.get_ident()
        return [(0, "A", inverse)]

    def then(results):
        threads["then"] = threading.get_ident()
        return [(i, w, x * 2) for i, w, x in results]

    pending = PendingInverses(run, torch.device("cpu"), timeout=30.0, then=then)
    out = pending.wait()
    assert threads["then"] == threading.get_ident() != threads["run"]
    assert torch.equal(out[0][2], inverse * 2) and pending.wait() is out  # the hand-over runs once
