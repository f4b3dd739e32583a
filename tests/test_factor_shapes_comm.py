"""Diagonal and grouped factors in the comm and planning stack: packing, fused all-reduces (spd and dpkfac's
reduce-to-owner), inverse broadcasts (cholesky and eigen), the preconditioned-gradient broadcast, the cost
models and placements, and the distributors end to end on 2 gloo processes. Every rank checks its results
against references rebuilt independently (each rank regenerates the other ranks' inputs from their seeds)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers.compare import assert_same

from lightning_spdkfac.comm import FusedAllReduce, InverseBroadcaster
from lightning_spdkfac.comm.consistency import plan_fingerprint
from lightning_spdkfac.comm.dpkfac import DPKFACDistributor, GradientBroadcaster
from lightning_spdkfac.comm.scheduler import SPDDistributor, SPDOptions
from lightning_spdkfac.comm.triangle import pack_factors, pack_triu, packed_size, unpack_factors, unpack_triu
from lightning_spdkfac.factor_shapes import (
    as_shape,
    check_shapes,
    inverse_shape,
    packed_numel,
    preconditioned_shape,
)
from lightning_spdkfac.kfac.distributor import DistributorContext
from lightning_spdkfac.multiprocess import run_distributed
from lightning_spdkfac.schedule import (
    AlphaBeta,
    InverseCost,
    broadcast_order,
    layer_state_bytes,
    plan_layer_placement,
    plan_placement,
    precondition_flops,
    preconditioned_order,
    simulate_placement,
    task_cost,
)
from lightning_spdkfac.schedule.placement import message_bytes, message_elements

pytestmark = pytest.mark.timeout(120)

# diagonal, dense, grouped, a 1x1 dense, a grouped one of 1x1 blocks, another diagonal
SHAPES = [(5,), (4, 4), (3, 4, 4), (1, 1), (2, 1, 1), (7,)]
GROUPS = [[0, 1], [2], [3, 4, 5]]


def sym(seed: int, shape, dtype=torch.float32) -> torch.Tensor:
    """A random factor of ``shape`` from a seed: positive entries for a diagonal one, exactly symmetric PSD
    blocks for a dense or grouped one."""
    shape = as_shape(shape)
    g = torch.Generator().manual_seed(seed)
    if len(shape) == 1:
        return (torch.rand(shape, generator=g, dtype=torch.float64) + 0.1).to(dtype)
    n = shape[-1]
    x = torch.randn(*shape[:-1], n + 2, generator=g, dtype=torch.float64)
    m = x @ x.transpose(-1, -2) / (n + 2)
    return ((m + m.transpose(-1, -2)) / 2).to(dtype)


def mirror(t: torch.Tensor) -> torch.Tensor:
    """What unpacking gives for ``t``: each dense block's upper triangle mirrored; a diagonal as it is."""
    if t.dim() == 1:
        return t.clone()
    up = t.triu()
    return up + up.triu(1).transpose(-1, -2)


# ------------------------------------------------------------------------------------------- packing
def test_pack_unpack_mixed_layouts_round_trip_exactly():
    mats = [sym(i, s, torch.float64) for i, s in enumerate(SHAPES)]
    flat = pack_factors(mats)
    assert flat.numel() == packed_size(SHAPES) == sum(packed_numel(s) for s in SHAPES)
    assert flat.numel() == 5 + 10 + 3 * 10 + 1 + 2 + 7
    back = unpack_factors(flat, SHAPES)
    for m, b in zip(mats, back):
        assert b.shape == m.shape and b.dtype == torch.float64
        assert torch.equal(b, m)
    # Only the upper triangles are read: a changed lower part does not travel, and results are exactly symmetric.
    noisy = [m if m.dim() == 1 else m + torch.tril(torch.ones_like(m), -1) for m in mats]
    for m, b in zip(mats, unpack_factors(pack_factors(noisy), SHAPES)):
        assert torch.equal(b, m)
    # Grouped blocks are packed block after block, each as its own triangle.
    g = mats[2]
    assert torch.equal(pack_factors([g]), torch.cat([pack_triu([blk]) for blk in g]))
    # ints are (n, n): the dense-only entry points agree with the general ones.
    assert torch.equal(unpack_factors(pack_triu([mats[1]]), [4])[0], unpack_triu(pack_triu([mats[1]]), [4])[0])


@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16, torch.float16])
def test_pack_unpack_mixed_layouts_with_dtype_casts(wire):
    mats = [sym(10 + i, s, torch.float64) for i, s in enumerate(SHAPES)]
    buf = torch.empty(packed_size(SHAPES), dtype=wire)
    pack_factors(mats, out=buf)
    # into existing tensors of another dtype, one of them not contiguous
    outs = [torch.empty(s, dtype=torch.float64) for s in SHAPES]
    outs[2] = torch.empty(4, 4, 3, dtype=torch.float64).permute(2, 0, 1)
    assert not outs[2].is_contiguous()
    back = unpack_factors(buf, SHAPES, out=outs)
    for m, b, o in zip(mats, back, outs):
        assert b is o
        expect = m.to(wire).to(torch.float64)  # one rounding to the wire dtype, nothing else
        assert torch.equal(b, mirror(expect))
    as_f32 = unpack_factors(buf, SHAPES, dtype=torch.float32)
    assert all(t.dtype == torch.float32 for t in as_f32)


def test_packing_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"mats\[1\] must be a factor of shape \(n,\) \(diagonal\)"):
        pack_factors([torch.ones(3), torch.ones(2, 3)])
    with pytest.raises(ValueError, match=r"flat must be a flat tensor of 15 elements for shapes \[diag 5, 4x4\]"):
        unpack_factors(torch.zeros(14), [(5,), 4])
    with pytest.raises(ValueError, match=r"out\[0\] must have shape \(2, 3, 3\)"):
        unpack_factors(torch.zeros(12), [(2, 3, 3)], out=[torch.empty(3, 3, 2)])
    with pytest.raises(TypeError, match=r"shapes\[1\] must be an int n \(an n x n factor\) or a tuple of ints"):
        unpack_factors(torch.zeros(3), [(1,), "2"])
    with pytest.raises(ValueError, match=r"sides\[0\] must be \(n,\) \(diagonal\), \(n, n\) \(dense\) or \(b, n, n\)"):
        check_shapes("sides", [(2, 3)])
    with pytest.raises(ValueError, match=r"sides\[1\] must have every dimension >= 1"):
        check_shapes("sides", [3, (0, 2, 2)])


# ------------------------------------------------------------------------------------ one process
def test_fused_allreduce_single_process_mixed_shapes():
    fused = FusedAllReduce(GROUPS, SHAPES, allow_missing=True)
    assert fused.shapes == tuple(SHAPES) and fused.sides == [5, 4, 4, 1, 1, 7]
    fused.begin_step()
    with pytest.raises(ValueError, match=r"factor 2 \(2\) must have shape \(3, 4, 4\) \(3 x 4x4, as given in sides\)"):
        fused.submit(2, torch.zeros(4, 4))
    mats = [sym(i, s) for i, s in enumerate(SHAPES)]
    for i, m in enumerate(mats):
        fused.submit(i, None if i == 5 else m)
    out = fused.wait()
    for i, (m, r) in enumerate(zip(mats, out)):
        if i == 5:
            assert r is None
        else:
            assert torch.equal(r, m)


def test_inverse_broadcaster_single_process_shapes():
    bc = InverseBroadcaster([0, 0, 0], [(5,), (3, 4, 4), 4], inverse_method="eigen")
    assert [bc.shape(i) for i in range(3)] == [(5,), (3, 5, 4), (5, 4)]
    assert [bc.message_size(i) for i in range(3)] == [5, 60, 20]
    bc = InverseBroadcaster([0, 0, 0], [(5,), (3, 4, 4), 4])
    assert [bc.shape(i) for i in range(3)] == [(5,), (3, 4, 4), (4, 4)]
    assert [bc.message_size(i) for i in range(3)] == [5, 30, 10]
    bc.begin_round()
    with pytest.raises(ValueError, match=r"inverse 0 \(0\) must have shape \(5,\) \(factor diag 5"):
        bc.publish(0, torch.ones(5, 5))


def test_gradient_broadcaster_checks_grouped_shapes():
    with pytest.raises(TypeError, match=r"shapes\[1\] must be a gradient shape, \(rows, columns\) or \(b, rows, columns\)"):
        GradientBroadcaster([0, 0], [(2, 3), (4,)], order=[0, 1])
    bc = GradientBroadcaster([0, 0], [(2, 3), (5, 2, 3)], order=[1, 0])
    bc.begin_round([0, 1])
    with pytest.raises(ValueError, match=r"must have shape \(5, 2, 3\)"):
        bc.offer(1, torch.zeros(2, 3))
    p = torch.arange(30.0).reshape(5, 2, 3)
    bc.offer(1, p)
    out = bc.finish()
    assert out[0] is None and torch.equal(out[1], p)


def test_preconditioned_shape():
    assert preconditioned_shape(10, 3) == (3, 10)
    assert preconditioned_shape((10,), (50257,)) == (50257, 10)
    assert preconditioned_shape((8, 9, 9), (8, 1, 1)) == (8, 1, 9)
    assert preconditioned_shape((8, 9, 9), 16) == (8, 16, 9)
    assert preconditioned_shape(9, (4, 2, 2)) == (4, 2, 9)
    with pytest.raises(ValueError, match="different block counts"):
        preconditioned_shape((8, 9, 9), (4, 2, 2))


# -------------------------------------------------------------------------------------- planning
INV = InverseCost(c0=1e-5, c1=1e-10, c2=1e-9, c3=1e-10)
BCAST = AlphaBeta(5e-5, 1e-9)


def test_inverse_cost_of_shapes():
    n = 512
    assert INV.time_of(n) == INV.time(n) == INV.time_of((n, n))
    assert INV.time_of((50257,)) == pytest.approx(INV.c0 + INV.c1 * 50257)
    assert INV.time_of((50257,)) < 1e-6 * INV.time(50257)  # a diagonal factor is elementwise: tiny
    block = INV.time(9) - INV.c0
    assert INV.time_of((768, 9, 9)) == pytest.approx(INV.c0 + 768 * block)  # one batched call, b blocks' work
    with pytest.raises(ValueError, match=r"shape must be \(n,\) \(diagonal\)"):
        INV.time_of((2, 3))


def test_message_sizes_and_state_bytes_of_shapes():
    assert message_elements(4) == message_elements((4, 4)) == 10
    assert message_elements(4, "eigen") == 20
    assert message_elements((6,)) == message_elements((6,), "eigen") == 6
    assert message_elements((3, 4, 4)) == 30 and message_elements((3, 4, 4), "eigen") == 60
    assert message_bytes((3, 4, 4), 2) == 60
    assert task_cost((7,), INV, BCAST) == pytest.approx(INV.time_of((7,)) + BCAST.time(28))
    # factors and inverses (cholesky: the factor's shape; eigen: the payload's)
    assert layer_state_bytes((5,), 3) == (5 + 5 + 9 + 9) * 4
    assert layer_state_bytes((2, 3, 3), (2, 1, 1), 1, "eigen") == (18 + 24) + (2 + 4)
    assert precondition_flops(3, 2) == 2 * 3 * 2 * (3 + 2)
    assert precondition_flops((3,), (2,)) == 2 * 3 * 2
    assert precondition_flops((4, 3, 3), (4, 2, 2)) == 4 * precondition_flops(3, 2)


def test_placement_with_shapes_is_cost_aware_and_deterministic():
    dense, diag, grouped = (1024, 1024), (50257,), (64, 128, 128)
    shapes = [dense, diag, grouped, (256, 256), (768,), (8, 9, 9)]
    a = plan_placement(shapes, 4, INV, BCAST, policy="lbp")
    b = plan_placement(list(reversed(list(reversed(shapes)))), 4, INV, BCAST, policy="lbp")
    assert a == b
    # a diagonal factor is cheaper to invert everywhere than to broadcast: replicated
    assert a.owners[1] == -1 and a.owners[4] == -1
    assert a.owners[0] != -1 and a.owners[2] != -1
    # grouped: b times a block (plus one call's overhead); the placement charges that
    assert task_cost(grouped, INV, BCAST) == pytest.approx(
        INV.c0 + 64 * (INV.time(128) - INV.c0) + BCAST.time(4 * 64 * 128 * 129 // 2))
    for policy in ("lbp_channel", "round_robin", "replicated"):
        p = plan_placement(shapes, 3, INV, BCAST, policy=policy)
        assert p == plan_placement(shapes, 3, INV, BCAST, policy=policy)
        simulate_placement(p, shapes, INV, BCAST)
    # ints are dense shapes: the same plan either way
    ints = [1024, 256, 64]
    assert plan_placement(ints, 2, INV, BCAST) == plan_placement([(n, n) for n in ints], 2, INV, BCAST)
    owners = [0, 1, 0, 1, 0, 1]
    assert broadcast_order(owners, shapes, INV) == broadcast_order(owners, shapes, INV)
    assert broadcast_order(owners, shapes, INV)[0] == 1  # the diagonal one is ready first


def test_layer_placement_with_shapes():
    sides = [((9,), (50257,)), ((4, 9, 9), (4, 16, 16)), (512, 512), (64, 10)]
    p = plan_layer_placement(sides, 2, INV)
    assert p == plan_layer_placement(sides, 2, INV)
    assert p.owners[2] != p.owners[0] or p.owners[2] != p.owners[1]  # the big dense layer is balanced against the rest
    assert preconditioned_order(sides, p.owners, INV) == preconditioned_order(sides, p.owners, INV)
    ints = [(512, 512), (64, 10)]
    assert plan_layer_placement(ints, 2, INV) == plan_layer_placement([((a, a), (g, g)) for a, g in ints], 2, INV)


def test_plan_fingerprint_includes_shapes():
    base = {"order": [(0, "A"), (0, "G")], "groups": [[0, 1]], "owners": [0, 1]}
    dense = plan_fingerprint(**base, sides=[4, 3])
    assert dense == plan_fingerprint(**base, sides=[(4, 4), (3, 3)])  # an int n is (n, n)
    diag = plan_fingerprint(**base, sides=[(4,), (3, 3)])
    grouped = plan_fingerprint(**base, sides=[(2, 4, 4), (3, 3)])
    assert dense["sides"] != diag["sides"] != grouped["sides"] != dense["sides"]
    assert {k for k in dense if dense[k] != diag[k]} == {"sides"}


# ------------------------------------------------------------------------------- distributed workers
def factor(step: int, rank: int, index: int, shapes=SHAPES) -> torch.Tensor:
    return sym(100_000 * step + 1000 * rank + index, shapes[index])


def _fused_worker(rank: int, world: int) -> dict:
    out = {}
    fused = FusedAllReduce(GROUPS, SHAPES)
    for step in (1, 2):
        fused.begin_step()
        for i in reversed(range(len(SHAPES))):  # out of plan order: launched in group order all the same
            fused.submit(i, factor(step, rank, i))
        got = fused.wait()
        for i, r in enumerate(got):
            expect = sum(factor(step, k, i) for k in range(world)) / world  # independent mean, in float32
            assert r.shape == SHAPES[i]
            torch.testing.assert_close(r, expect, rtol=1e-6, atol=1e-7)
            assert torch.equal(r, mirror(r))  # exactly symmetric blocks
        out[step] = got
    # allow_missing: rank 1 has no data for factors 0 (diag) and 2 (grouped), nobody for factor 3
    missing = {1: {0, 2}, 0: {3}}
    fm = FusedAllReduce(GROUPS, SHAPES, allow_missing=True, dtype=torch.bfloat16, result_dtype=torch.float64)
    fm.begin_step()
    for i in range(len(SHAPES)):
        absent = i in missing.get(rank, set()) or i == 3
        fm.submit(i, None if absent else factor(3, rank, i))
    got = fm.wait()
    assert got[3] is None
    for i in (0, 2):
        assert torch.equal(got[i], mirror(factor(3, 0, i).to(torch.bfloat16).to(torch.float64)))
    for i in (1, 4, 5):
        expect = sum(factor(3, k, i).to(torch.bfloat16).float() for k in range(world)) / world
        torch.testing.assert_close(got[i], expect.double(), rtol=1e-2, atol=1e-2)  # summed in bfloat16
    out[3] = got
    # dpkfac: each group reduced to one rank only, a group of each layout on each rank
    dst = [1, 0, 1]
    fr = FusedAllReduce(GROUPS, SHAPES, destinations=dst)
    fr.begin_step()
    for i in range(len(SHAPES)):
        fr.submit(i, factor(4, rank, i))
    got = fr.wait()
    for g, members in enumerate(GROUPS):
        for i in members:
            if dst[g] == rank:
                expect = sum(factor(4, k, i) for k in range(world)) / world
                torch.testing.assert_close(got[i], expect, rtol=1e-6, atol=1e-7)
            else:
                assert got[i] is None
    return {k: v for k, v in out.items() if k != 4}


def fake_inverse(f: torch.Tensor, method: str) -> torch.Tensor:
    """A deterministic 'inverse' of the right kind and shape for factor ``f``."""
    if f.dim() == 1:
        return 1.0 / (f + 1.0) if method == "cholesky" else f + 1.0
    eye = torch.eye(f.shape[-1], dtype=f.dtype)
    if method == "cholesky":
        inv = torch.linalg.inv(f + eye)
        return (inv + inv.transpose(-1, -2)) / 2
    evals, evecs = torch.linalg.eigh(f + eye)
    return torch.cat([evecs, evals.unsqueeze(-2)], dim=-2)


def _broadcast_worker(rank: int, world: int) -> dict:
    owners = [0, 1, -1, 1, 0, 1]
    out = {}
    for method in ("cholesky", "eigen"):
        for dtype in (torch.float32, torch.bfloat16):
            bc = InverseBroadcaster(owners, SHAPES, inverse_method=method, dtype=dtype, result_dtype=torch.float64)
            bc.begin_round()
            bc.exchange(lambda i: fake_inverse(sym(50 + i, SHAPES[i], torch.float64), method))  # noqa: B023
            got = bc.wait_all()
            for i, t in got.items():
                want = fake_inverse(sym(50 + i, SHAPES[i], torch.float64), method)
                assert t.shape == inverse_shape(SHAPES[i], method) and t.dtype == torch.float64
                if owners[i] == -1:
                    assert torch.equal(t, want)  # replicated: as computed here
                elif method == "eigen":
                    assert torch.equal(t, want.to(dtype).to(torch.float64))  # the whole payload, rounded once
                else:
                    assert torch.equal(t, mirror(want.to(dtype).to(torch.float64)))
            out[(method, str(dtype))] = got
    return out


def _gradient_worker(rank: int, world: int) -> dict:
    shapes = [(3, 5), (4, 2, 3), (6, 1, 9), (2, 2)]
    owners = [0, 1, 1, 0]
    bc = GradientBroadcaster(owners, shapes, dtype=torch.float64, order=[1, 0, 2, 3])
    bc.begin_round([0, 1, 2, 3])
    for i, o in enumerate(owners):
        if o == rank and i != 3:  # layer 3 left unpreconditioned by its owner
            bc.offer(i, sym(70 + i, (shapes[i][-1],), torch.float64).expand(shapes[i]).contiguous() * (i + 1))
    got = bc.finish()
    for i, s in enumerate(shapes):
        if i == 3:
            assert got[i] is None
        else:
            assert got[i].shape == s and got[i].dtype == torch.float64
            assert torch.equal(got[i], sym(70 + i, (s[-1],), torch.float64).expand(s) * (i + 1))
    return got


LAYERS = [((6,), (5, 5)), ((3, 4, 4), (3, 2, 2)), ((7, 7), (9,)), (3, 4)]  # diag A, grouped both, diag G, ints


def _layer_keys():
    return [(i, w) for i in range(len(LAYERS)) for w in ("A", "G")]


def _layer_factor(step, rank, key):
    i, w = key
    shape = LAYERS[i][0 if w == "A" else 1]
    return sym(10_000 * step + 100 * rank + 2 * i + (w == "G"), shape)


def _distributor_worker(rank: int, world: int, schedule: str, method: str) -> dict:
    opts = SPDOptions.from_schedule(schedule, profile_steps=(0, 1)) if schedule in ("spd", "dpkfac") else \
        SPDOptions.from_schedule(schedule)
    cls = DPKFACDistributor if schedule == "dpkfac" else SPDDistributor
    d = cls(opts, process_group=dist.new_group())
    d.setup(LAYERS, DistributorContext(inverse_method=method))  # checks the plan (fingerprint of the shapes included) across ranks
    results = {}
    for step in range(3):
        d.begin_step(step)
        local = {k: _layer_factor(step, rank, k) for k in _layer_keys()}
        reduced = d.reduce_factors(local)
        for k in _layer_keys():
            mine = d.layer_owners is None or d.layer_owners[k[0]] == rank
            if not mine:
                assert reduced[k] is None
                continue
            expect = sum(_layer_factor(step, r, k) for r in range(world)) / world
            torch.testing.assert_close(reduced[k], expect, rtol=1e-6, atol=1e-7)
        tasks = [(i, w, reduced[(i, w)]) for i, w in _layer_keys() if reduced[(i, w)] is not None]
        got: dict = {}
        d.invert(tasks, lambda ts: [fake_inverse(t[2], method) for t in ts],
                 lambda i, w, inv: got.__setitem__((i, w), inv))  # noqa: B023 - called before the next step
        assert sorted(got) == sorted((t[0], t[1]) for t in tasks)
        for i, w, f in tasks:
            assert got[(i, w)].shape == inverse_shape(as_shape(f.shape), method)
        if schedule == "dpkfac":
            d.begin_share(list(range(len(LAYERS))))
            for i in range(len(LAYERS)):
                if d.layer_owners[i] == rank:
                    d.offer(i, torch.full(preconditioned_shape(*LAYERS[i]), float(i + step)))
            shared = d.finish_share()
            for i in range(len(LAYERS)):
                assert torch.equal(shared[i], torch.full(preconditioned_shape(*LAYERS[i]), float(i + step)))
            results[step] = shared
        else:
            results[step] = got
    results["describe"] = {k: v for k, v in d.describe().items() if k in ("order", "groups", "owners")}
    d.close()
    return results


# ----------------------------------------------------------------------------------- distributed tests
def test_fused_allreduce_mixed_shapes_two_ranks():
    r0, r1 = run_distributed(_fused_worker, 2, timeout=90)
    assert_same(r0, r1)


def test_inverse_broadcast_diag_and_grouped_two_ranks():
    r0, r1 = run_distributed(_broadcast_worker, 2, timeout=90)
    assert_same(r0, r1)


def test_gradient_broadcaster_grouped_shapes_two_ranks():
    r0, r1 = run_distributed(_gradient_worker, 2, timeout=90)
    assert_same(r0, r1)


@pytest.mark.parametrize("schedule, method", [("spd", "cholesky"), ("mpd", "eigen"), ("dpkfac", "cholesky"),
                                              ("dpkfac", "eigen")])
def test_distributors_with_diag_and_grouped_factors_two_ranks(schedule, method):
    r0, r1 = run_distributed(_distributor_worker, 2, schedule, method, timeout=110)
    assert_same(r0, r1)
