"""The comm layer on real process groups (gloo, 127.0.0.1): triangle packing, fused asynchronous factor
all-reduce, inverse broadcast from owners, profiling - checked against references rebuilt independently
in every rank (each rank regenerates the other ranks' inputs from their seeds) - and the harness itself."""

from __future__ import annotations

import math
import os
import time

import pytest
import torch
import torch.distributed as dist
from helpers.compare import assert_same

from lightning_spdkfac.comm import (
    FusedAllReduce,
    InverseBroadcaster,
    broadcast_object,
    measure_allreduce,
    measure_broadcast,
    pack_triu,
    triu_size,
    unpack_triu,
)
from lightning_spdkfac.multiprocess import free_port, run_distributed

pytestmark = pytest.mark.timeout(60)

SIDES = [3, 5, 1, 8, 4, 6]
GROUPS = [[0, 1], [2, 3, 4], [5]]


def sym(seed: int, n: int, dtype=torch.float32) -> torch.Tensor:
    """A random symmetric positive semi-definite n x n matrix, exactly symmetric, from a seed."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, n + 2, generator=g, dtype=torch.float64)
    m = x @ x.T / (n + 2)
    return ((m + m.T) / 2).to(dtype)


def factor(step: int, rank: int, index: int) -> torch.Tensor:
    return sym(100_000 * step + 1000 * rank + index, SIDES[index])


# ------------------------------------------------------------------------------- one process: triangles
def test_triu_round_trip_exact_and_symmetric():
    sides = [1, 2, 5, 17, 64]
    mats = [sym(n, n, torch.float64) for n in sides]
    flat = pack_triu(mats)
    assert flat.shape == (sum(triu_size(n) for n in sides),) and flat.dtype == torch.float64
    assert [triu_size(n) for n in (0, 1, 2, 3, 10)] == [0, 1, 3, 6, 55]
    back = unpack_triu(flat, sides)
    for m, b in zip(mats, back):
        assert torch.equal(m, b)
    # Row-major upper triangle of the first 2 x 2 block: (0,0), (0,1), (1,1).
    two = torch.tensor([[1.0, 2.0], [2.0, 3.0]])
    assert pack_triu([two]).tolist() == [1.0, 2.0, 3.0]
    # Only the upper triangle is read; the result mirrors it (exactly symmetric).
    a = torch.randn(7, 7)
    (b,) = unpack_triu(pack_triu([a]), [7])
    assert torch.equal(b, b.T) and torch.equal(b.triu(), a.triu())
    # Non-contiguous input, caller-given buffers (pack into a slice, unpack into given matrices).
    t = a.T
    out = torch.zeros(triu_size(7) + 3)
    pack_triu([t], out=out[3:])
    assert torch.equal(out[3:], pack_triu([t.contiguous()]))
    given = [torch.empty(7, 7, dtype=torch.float64)]
    res = unpack_triu(out[3:], [7], out=given)
    assert res[0] is given[0] and torch.equal(given[0], unpack_triu(out[3:], [7])[0].double())
    with pytest.raises(ValueError, match="square"):
        pack_triu([torch.zeros(2, 3)])
    with pytest.raises(ValueError, match="elements"):
        unpack_triu(flat[1:], sides)


def test_triu_bfloat16_path_error_bound():
    sides = [4, 33, 100]
    mats = [sym(7 + n, n) for n in sides]
    flat = pack_triu(mats, out=torch.empty(sum(triu_size(n) for n in sides), dtype=torch.bfloat16))
    assert flat.dtype == torch.bfloat16
    back = unpack_triu(flat, sides, dtype=torch.float32)
    for m, b in zip(mats, back):
        assert b.dtype == torch.float32 and torch.equal(b, b.T)
        # bfloat16 keeps 8 significant bits: relative rounding error <= 2^-8 per element.
        assert ((b - m).abs() <= m.abs() * 2.0**-8).all()


# ------------------------------------------------------------------ one process: the state machines
def test_fused_allreduce_single_process_state_machine():
    fused = FusedAllReduce(GROUPS, SIDES)  # torch.distributed not initialized: one local process
    assert fused.world_size == 1
    with pytest.raises(RuntimeError, match="begin_step"):
        fused.submit(0, factor(0, 0, 0))
    fused.begin_step()
    fused.submit(1, factor(0, 0, 1))
    assert not fused.is_launched(0)
    fused.submit(0, factor(0, 0, 0))
    assert fused.is_launched(0) and fused.launched_groups == (0,)
    with pytest.raises(RuntimeError, match="already submitted"):
        fused.submit(0, factor(0, 0, 0))
    with pytest.raises(ValueError, match="shape"):
        fused.submit(2, torch.zeros(2, 2))
    with pytest.raises(RuntimeError, match=r"factors \[2, 3, 4, 5\] were never submitted"):
        fused.wait()
    with pytest.raises(RuntimeError, match="previous step is unfinished"):
        fused.begin_step()
    for i in (2, 3, 4, 5):
        fused.submit(i, factor(0, 0, i))
    out = fused.wait()
    assert all(torch.equal(o, factor(0, 0, i)) for i, o in enumerate(out))
    assert not fused.active and fused.last_timings is not None
    with pytest.raises(ValueError, match="cover every factor"):
        FusedAllReduce([[0, 1]], [2, 2, 2])
    with pytest.raises(ValueError, match="groups"):
        FusedAllReduce([[0, 1], [1, 2]], [2, 2, 2])
    with pytest.raises(ValueError, match="dtype"):
        FusedAllReduce([[0]], [2], dtype=torch.int32)


def test_inverse_broadcaster_single_process_order_checks():
    bc = InverseBroadcaster([0, -1, 0], [2, 3, 2])
    assert bc.order == (0, 2) and bc.replicated == (1,) and bc.owned == (0, 2)
    bc.begin_round()
    with pytest.raises(RuntimeError, match="out of order"):
        bc.publish(2, sym(2, 2))
    with pytest.raises(RuntimeError, match="which owns"):
        bc.expect(0)
    bc.exchange(lambda i: sym(i, [2, 3, 2][i]))
    got = bc.wait_all()
    assert sorted(got) == [0, 1, 2] and all(torch.equal(got[i], sym(i, [2, 3, 2][i])) for i in got)
    with pytest.raises(ValueError, match="owners"):
        InverseBroadcaster([1], [2])


def test_executor_arguments_follow_the_package_rule():
    """A wrong type raises TypeError, a wrong value ValueError, each naming the argument (a float or a
    string where a factor index is expected used to be truncated or to raise ValueError)."""
    for kwargs, error, match in [
        ({"groups": [[0, 1.0]]}, TypeError, r"groups\[0\]\[1\] must be an integer, got float"),
        ({"groups": "01"}, TypeError, "groups must be a sequence"),
        ({"names": "ab"}, TypeError, "names must be a sequence"),
        ({"names": ["a"]}, ValueError, "names must give one label per factor"),
        ({"op": "avg"}, ValueError, "op must be one of 'average', 'sum', got 'avg'"),
        ({"op": 1}, TypeError, "op must be one of"),
        ({"allow_missing": 1}, TypeError, "allow_missing must be True or False"),
    ]:
        with pytest.raises(error, match=match):
            FusedAllReduce(**({"groups": [[0, 1]], "sides": [2, 2]} | kwargs))
    for kwargs, error, match in [
        ({"owners": ["0"]}, TypeError, r"owners\[0\] must be an integer, got str"),
        ({"owners": [0, -1]}, ValueError, "owners and sides must have the same length"),
        ({"order": [0.0]}, TypeError, r"order\[0\] must be an integer"),
    ]:
        with pytest.raises(error, match=match):
            InverseBroadcaster(**({"owners": [0], "sides": [2]} | kwargs))
    fused = FusedAllReduce([[0]], [2])
    fused.begin_step()
    with pytest.raises(TypeError, match="matrix must be a Tensor"):
        fused.submit(0, [[1.0, 0.0], [0.0, 1.0]])
    bc = InverseBroadcaster([0], [2])
    bc.begin_round()
    with pytest.raises(TypeError, match="inverse must be a Tensor"):
        bc.publish(0, [[1.0, 0.0], [0.0, 1.0]])
    with pytest.raises(TypeError, match=r"sides\[0\] must be an integer"):
        unpack_triu(torch.zeros(3), ["2"])
    with pytest.raises(TypeError, match=r"sizes_bytes\[0\] must be an integer"):
        measure_allreduce([4096.0])


# -------------------------------------------------------------------------------- distributed workers
def _check_step(fused: FusedAllReduce, step: int, rank: int, world: int, order) -> list[torch.Tensor]:
    """Submit this rank's factors of ``step`` in ``order``, checking launches; verify the averages."""
    fused.begin_step()
    for i in order:
        g = fused.group_of(i)
        members_left = [j for j in GROUPS[g] if j != i and not fused._submitted[j]]
        fused.submit(i, factor(step, rank, i))
        # A group is issued by the submit of its last member, before anything else happens.
        assert fused.is_launched(g) == (not members_left), (i, g, members_left)
        if not members_left:
            assert fused._works[g] is not None and fused.launched_groups[-1] == g
    out = fused.wait()
    assert not fused.active and all(w is None for w in fused._works) and all(b is None for b in fused._buffers)
    for i, o in enumerate(out):
        expected = sum(factor(step, r, i) for r in range(world)) / world
        if world == 2:
            assert torch.equal(o, expected), i  # a + b is the same sum on both ranks; / 2 is exact
        else:
            torch.testing.assert_close(o, expected, rtol=1e-6, atol=1e-6)
        assert torch.equal(o, o.T) and o.dtype == torch.float32
    t = fused.last_timings
    for g, members in enumerate(GROUPS):
        assert t.launch[g] >= max(t.submit[i] for i in members)
        assert t.wait_end[g] >= t.wait_start[g] >= t.launch[g]
    assert sorted(t.launch_order) == [0, 1, 2]
    return out


def _fused_worker(rank: int, world: int) -> dict:
    kfac_group = dist.new_group(list(range(world)))  # a dedicated group, as recommended for K-FAC traffic
    fused = FusedAllReduce(GROUPS, SIDES, process_group=kfac_group)
    steps = {}
    # Step 1: in index order, with the misuse checks between submits.
    fused.begin_step()
    for i in range(5):
        fused.submit(i, factor(1, rank, i))
    assert fused.launched_groups == (0, 1) and not fused.is_launched(2)
    with pytest.raises(RuntimeError, match=r"factors \[5\] were never submitted"):
        fused.wait()
    with pytest.raises(RuntimeError, match="already submitted"):
        fused.submit(3, factor(1, rank, 3))
    with pytest.raises(RuntimeError, match="unfinished"):
        fused.begin_step()
    # Unrelated traffic on the default group while the factor groups are in flight on their own group.
    x = torch.full((3,), float(rank + 1))
    dist.all_reduce(x)
    assert x.tolist() == [world * (world + 1) / 2] * 3
    fused.submit(5, factor(1, rank, 5))
    out = fused.wait()
    for i, o in enumerate(out):
        assert torch.equal(o, sum(factor(1, r, i) for r in range(world)) / world)
    steps[1] = out
    with pytest.raises(RuntimeError, match="begin_step"):
        fused.submit(0, factor(2, rank, 0))
    # Steps 2 and 3 reuse the executor: other submission orders within groups, same group order.
    steps[2] = _check_step(fused, 2, rank, world, [1, 0, 4, 2, 3, 5])
    steps[3] = _check_step(fused, 3, rank, world, [0, 1, 2, 3, 4, 5])
    # wait_group for finer control, then wait() for the rest.
    fused.begin_step()
    for i in range(6):
        fused.submit(i, factor(4, rank, i))
    g1 = fused.wait_group(1)
    assert fused.outstanding == (0, 2)
    rest = fused.wait()
    assert all(a is b for a, b in zip(g1, rest[2:5]))

    # bfloat16 communication: results float32, exactly symmetric, close to the mean.
    bf = FusedAllReduce(GROUPS, SIDES, process_group=kfac_group, dtype=torch.bfloat16)
    bf.begin_step()
    for i in range(6):
        bf.submit(i, factor(5, rank, i))
    for i, o in enumerate(bf.wait()):
        expected = sum(factor(5, r, i) for r in range(world)) / world
        assert o.dtype == torch.float32 and torch.equal(o, o.T)
        assert (o - expected).abs().max() <= 2.0**-6 * expected.abs().max(), i

    # allow_missing: averages over the ranks that had data; None where no rank had any.
    miss = FusedAllReduce([[0, 1], [2]], [2, 3, 2], process_group=kfac_group, allow_missing=True)
    miss.begin_step()
    miss.submit(0, sym(10 + rank, 2))
    miss.submit(1, sym(20, 3) if rank == 0 else None)
    miss.submit(2, None)
    a, b, c = miss.wait()
    assert torch.equal(a, sum(sym(10 + r, 2) for r in range(world)) / world)
    assert torch.equal(b, sym(20, 3)) and c is None
    return {"steps": steps}


def _broadcast_worker(rank: int, world: int, owners: list[int], sides: list[int]) -> dict:
    def inverse(round_: int, i: int) -> torch.Tensor:
        return sym(7000 * round_ + i, sides[i])

    bc = InverseBroadcaster(owners, sides)
    calls: list[int] = []

    def invert(i: int) -> torch.Tensor:
        calls.append(i)
        return inverse(1, i)

    # Round 1: the canonical loop.
    bc.begin_round()
    bc.exchange(invert)
    assert sorted(calls) == sorted(i for i, o in enumerate(owners) if o in (rank, -1))
    got = bc.wait_all()
    assert sorted(got) == list(range(len(sides)))
    for i, m in got.items():
        assert torch.equal(m, inverse(1, i)), i
    # Round 2: by hand, waited per factor; asymmetric owner inverses are mirrored from the upper
    # triangle, identically on the owner and the receivers.
    bc.begin_round()
    for i in bc.order:
        if i != bc.next_index:
            raise AssertionError("order")
        if owners[i] == rank:
            later = [j for j in bc.order[bc.order.index(i) + 1:] if owners[j] == rank]
            if later:
                with pytest.raises(RuntimeError, match="out of order"):
                    bc.publish(later[0], inverse(2, later[0]))
            noisy = inverse(2, i) + torch.triu(torch.ones(sides[i], sides[i]), 1)  # upper part changed
            bc.publish(i, noisy)
        else:
            with pytest.raises(RuntimeError, match=f"owned by rank {owners[i]}"):
                bc.publish(i, inverse(2, i))
            bc.expect(i)
    for i in bc.replicated:
        bc.publish(i, inverse(2, i))
    second = {i: bc.wait(i) for i in reversed(range(len(sides)))}
    with pytest.raises(RuntimeError, match="already returned"):
        bc.wait(0)
    for i, m in second.items():
        if owners[i] >= 0:
            up = (inverse(2, i) + torch.triu(torch.ones(sides[i], sides[i]), 1)).triu()
            assert torch.equal(m, up + up.triu(1).T), i
    # Round 3: bfloat16 communication: every rank holds bit-identical inverses.
    bf = InverseBroadcaster(owners, sides, dtype=torch.bfloat16)
    bf.begin_round()
    bf.exchange(lambda i: inverse(3, i))
    third = bf.wait_all()
    t = bf.last_timings
    assert all(math.isfinite(t.post[i]) and t.wait_end[i] >= t.wait_start[i] for i in range(len(sides)))
    return {"first": got, "second": second, "third": third}


def _profile_worker(rank: int, world: int) -> dict:
    sizes = [4, 4096, 1 << 16]
    ar = measure_allreduce(sizes, repeats=3)
    bc = measure_broadcast(sizes, repeats=3, src=world - 1)
    obj = broadcast_object({"rank": rank, "alpha": 1e-4 * (rank + 1)})
    return {"allreduce": ar, "broadcast": bc, "object": obj}


def _world3_worker(rank: int, world: int) -> dict:
    fused = FusedAllReduce(GROUPS, SIDES)
    outs = [_check_step(fused, s, rank, world, list(range(6))) for s in (1, 2)]
    bc = _broadcast_worker(rank, world, owners=[2, 2, 0, -1, 2, 0], sides=[3, 4, 2, 5, 1, 6])
    return {"fused": outs, "bc": bc}


def _raising_worker(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("boom from rank 1")
    dist.barrier()  # rank 0 would wait here forever: the harness must kill it


def _sleeping_worker(rank: int, world: int, pid_dir: str) -> None:
    with open(os.path.join(pid_dir, f"{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


# ------------------------------------------------------------------------------------ distributed tests
def test_fused_allreduce_two_ranks():
    r0, r1 = run_distributed(_fused_worker, 2, timeout=50)
    assert_same(r0, r1)


def test_inverse_broadcast_two_ranks():
    owners, sides = [0, 1, -1, 1, 0], [4, 3, 5, 2, 6]
    r0, r1 = run_distributed(_broadcast_worker, 2, owners, sides, timeout=50)
    assert_same(r0, r1)


def test_profile_identical_on_ranks():
    r0, r1 = run_distributed(_profile_worker, 2, timeout=50)
    assert_same(r0, r1)
    for key in ("allreduce", "broadcast"):
        assert len(r0[key]) == 3 and all(t > 0 for t in r0[key])
    assert r0["object"] == {"rank": 0, "alpha": 1e-4}


def test_three_ranks_uneven_owners():
    results = run_distributed(_world3_worker, 3, timeout=55)
    for r in results[1:]:
        assert_same(results[0], r)


def test_harness_propagates_child_exception():
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="boom from rank 1") as info:
        run_distributed(_raising_worker, 2, timeout=30)
    assert "ValueError" in str(info.value) and "rank 1 failed" in str(info.value)
    assert time.monotonic() - t0 < 20  # the hanging rank 0 was killed, not waited for


def test_harness_kills_hanging_ranks(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="timed out"):
        run_distributed(_sleeping_worker, 2, str(tmp_path), timeout=5)
    assert time.monotonic() - t0 < 15
    pids = [int((tmp_path / f"{r}.pid").read_text()) for r in range(2)]
    for pid in pids:
        assert not _alive(pid), pid


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead, only not yet reaped
    except FileNotFoundError:
        return False


def test_free_port_is_bindable():
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_groups_launch_in_plan_order_even_when_factors_arrive_out_of_order():
    fused = FusedAllReduce([[0], [1, 2], [3]], [2, 3, 2, 4])
    fused.begin_step()
    eye = torch.eye
    fused.submit(3, eye(4))  # group 2 complete, but groups 0 and 1 are not launched yet
    assert fused.launched_groups == ()
    fused.submit(1, eye(3))
    fused.submit(0, eye(2))  # group 0 launches; group 1 still waits for factor 2
    assert fused.launched_groups == (0,)
    fused.submit(2, 2 * eye(2))  # now groups 1 and 2, in order
    assert fused.launched_groups == (0, 1, 2)
    out = fused.wait()
    assert torch.equal(out[2], 2 * eye(2)) and torch.equal(out[3], eye(4))


def test_probe_sizes_span_4kib_to_the_largest_message_within_the_cap():
    from lightning_spdkfac.comm.profile import probe_sizes

    assert probe_sizes(2**20) == [4096, 16384, 65536, 262144, 1048576]
    assert probe_sizes(100) == [4096, 5792, 8192, 11585, 16384]  # at least 16 KiB
    assert probe_sizes(2**20, cap=65536) == [4096, 8192, 16384, 32768, 65536]
