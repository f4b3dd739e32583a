"""inverse_method="eigen": the block (A (x) G + lambda I)^-1 exactly, against a dense Kronecker reference;
its fault ladder, checkpoints, validation, the broadcast of eigen payloads and the 2-rank schedules.

The reference is independent of the library: the factors come from the tests' own captures
(tests/helpers/dense_reference.py), and P from a dense float64 solve with ``torch.kron``. With column-major
vec, vec(G M A) = (A^T (x) G) vec(M) = (A (x) G) vec(M) for symmetric A, so
vec(P) = (A (x) G + lambda I)^-1 vec(M), vec(M) = M.T.reshape(-1).
"""

from __future__ import annotations

import copy
import math
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from helpers.dense_reference import F64, Recorder, assert_close, grad_matrix, ref_factors
from helpers.training import sgd_kfac_steps
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_spdkfac import KFACPreconditioner
from lightning_spdkfac.comm.broadcast import InverseBroadcaster
from lightning_spdkfac.comm.scheduler import SPDDistributor, SPDOptions
from lightning_spdkfac.kfac.inverse import eigen_precondition, robust_eigens
from lightning_spdkfac.kfac.options import KFACOptions
from lightning_spdkfac.multiprocess import run_distributed
from lightning_spdkfac.schedule import AlphaBeta, InverseCost, plan_placement, task_cost
from lightning_spdkfac.schedule.placement import message_bytes

# ----------------------------------------------------------------------------- the dense reference


def kron_precondition(M: torch.Tensor, A: torch.Tensor, G: torch.Tensor, damping: float) -> torch.Tensor:
    """P with vec(P) = (A (x) G + damping I)^-1 vec(M), column-major vec, in float64."""
    M, A, G = M.to(F64), A.to(F64), G.to(F64)
    K = torch.kron(A, G) + damping * torch.eye(A.shape[0] * G.shape[0], dtype=F64)
    v = torch.linalg.solve(K, M.T.reshape(-1))
    return v.reshape(M.shape[1], M.shape[0]).T


def kl_clipped(P: list[torch.Tensor], grads: list[torch.Tensor], kl_clip: float | None, lr: float):
    if kl_clip is None:
        return P, 1.0
    vg = sum(lr * lr * float((p * g).sum()) for p, g in zip(P, grads, strict=True))
    nu = min(1.0, math.sqrt(kl_clip / abs(vg)))
    return [nu * p for p in P], nu


def sq_loss(out):
    return (0.5 * out.pow(2) + 0.1 * out).sum(dim=-1).mean()


def step_with_grads(model, pre, rec, x):
    model.zero_grad(set_to_none=True)
    rec.clear()
    sq_loss(model(x)).backward()
    grads = {n: grad_matrix(m) for n, m in rec.modules.items()}
    pre.step()
    return grads


MODELS = {
    "linear2d": (lambda bias: nn.Sequential(nn.Linear(5, 4, bias=bias), nn.Tanh(), nn.Linear(4, 3, bias=bias)),
                 lambda: torch.randn(7, 5, dtype=F64)),
    "linear3d": (lambda bias: nn.Sequential(nn.Linear(5, 3, bias=bias)), lambda: torch.randn(3, 4, 5, dtype=F64)),
    "conv2d": (lambda bias: nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, bias=bias)),
               lambda: torch.randn(2, 2, 4, 4, dtype=F64)),
}


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kl_clip", [None, 1e-5])
def test_eigen_matches_the_dense_kronecker_solve(kind, bias, kl_clip):
    torch.manual_seed(0)
    build, inputs = MODELS[kind]
    model = build(bias).to(F64)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear | nn.Conv2d)]
    damping, lr = 0.05, 0.3
    # expand: ref_factors builds every im2col row of a Conv2d (the default, "auto", reduces them)
    pre = KFACPreconditioner(model, inverse_method="eigen", damping=damping, kl_clip=kl_clip, lr=lr,
                             factor_dtype=F64, inv_dtype=F64, factor_approx="expand")
    rec = Recorder(model, names)
    grads = step_with_grads(model, pre, rec, inputs())
    refs = {n: ref_factors(rec, n) for n in names}
    P = [kron_precondition(grads[n], refs[n][0], refs[n][1], damping) for n in names]
    P, nu = kl_clipped(P, [grads[n] for n in names], kl_clip, lr)
    if kl_clip is not None:
        assert nu < 0.5  # the clip is really exercised
    for n, p in zip(names, P, strict=True):
        assert pre.layers[n].A_inv.shape == (pre.layers[n].A.shape[0] + 1, pre.layers[n].A.shape[0])
        assert_close(grad_matrix(rec.modules[n]), p, 1e-9)


def test_eigen_damping_schedule_changes_only_at_inverse_steps():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 3)).to(F64)

    def damping(k):
        return 0.1 * (k + 1)

    pre = KFACPreconditioner(model, inverse_method="eigen", damping=damping, kl_clip=None, factor_update_steps=1,
                             inv_update_steps=2, factor_decay=0.5, factor_dtype=F64, inv_dtype=F64)
    rec = Recorder(model, ["0"])
    grads0 = step_with_grads(model, pre, rec, torch.randn(6, 4, dtype=F64))
    A0, G0 = ref_factors(rec, "0")
    assert_close(grad_matrix(rec.modules["0"]), kron_precondition(grads0["0"], A0, G0, damping(0)), 1e-9)
    # Step 1 is no inverse step: the payloads of step 0 with the damping of step 0 (not damping(1)).
    grads1 = step_with_grads(model, pre, rec, torch.randn(6, 4, dtype=F64))
    assert pre.layers["0"].inv_damping == damping(0)
    assert_close(grad_matrix(rec.modules["0"]), kron_precondition(grads1["0"], A0, G0, damping(0)), 1e-9)
    step_with_grads(model, pre, rec, torch.randn(6, 4, dtype=F64))
    assert pre.layers["0"].inv_damping == damping(2)


# ----------------------------------------------------------------------------- eigen vs cholesky


def one_step(method, damping, seed=2):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4))
    pre = KFACPreconditioner(model, inverse_method=method, damping=damping, kl_clip=None)
    x = torch.randn(9, 6)
    sq_loss(model(x)).backward()
    before = [p.grad.clone() for p in model.parameters()]
    pre.step()
    return before, [p.grad.clone() for p in model.parameters()]


def test_eigen_and_cholesky_differ_but_both_finite():
    _, eig = one_step("eigen", 0.05)
    _, chol = one_step("cholesky", 0.05)
    assert all(torch.isfinite(t).all() for t in eig + chol)
    assert any(not torch.allclose(a, b, rtol=1e-3, atol=1e-6) for a, b in zip(eig, chol))


def test_eigen_large_damping_is_a_scaled_gradient():
    lam = 1e6
    before, after = one_step("eigen", lam)
    for g, p in zip(before, after):
        torch.testing.assert_close(p, g / lam, rtol=1e-4, atol=1e-12)


def test_eigen_precondition_zero_damping_stays_finite():
    A = torch.zeros(3, 3)
    A[0, 0] = 1.0
    payloads, fallbacks = robust_eigens([A, torch.zeros(2, 2)], torch.float32)
    assert not fallbacks
    P = eigen_precondition(torch.randn(2, 3), payloads[0], payloads[1], 0.0)
    assert torch.isfinite(P).all()


# ----------------------------------------------------------------------------- the fault ladder


def test_non_finite_factor_gives_the_identity_level_warned_once_per_layer():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    pre = KFACPreconditioner(model, inverse_method="eigen", factor_update_steps=1, inv_update_steps=1, damping=0.1, lr=0.1)
    x = torch.randn(5, 4)
    sq_loss(model(x)).backward()
    pre.step()
    pre.layers["0"].A[0, 0] = float("nan")  # a running factor gone bad (the guard only sees step factors)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model.zero_grad()
            sq_loss(model(x)).backward()
            pre.step()
    msgs = [str(w.message) for w in caught if "eigendecomposition" in str(w.message)]
    assert len(msgs) == 1, msgs  # once per layer, though it happened twice
    assert "K-FAC layer '0'" in msgs[0] and "non-finite" in msgs[0] and "isotropic" in msgs[0]
    assert pre.inverse_fallbacks == 2
    A_inv = pre.layers["0"].A_inv
    n = A_inv.shape[1]
    assert torch.equal(A_inv[:n], torch.eye(n))
    assert torch.all(A_inv[n] == 0.0)  # trace/n of a non-finite factor is not a usable eigenvalue: 0
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_float32_eigh_failure_is_retried_in_float64_and_counted(monkeypatch):
    real = torch.linalg.eigh

    def eigh(m, *a, **k):
        if m.dtype == torch.float32:
            raise torch.linalg.LinAlgError("no convergence (simulated)")
        return real(m, *a, **k)

    monkeypatch.setattr(torch.linalg, "eigh", eigh)
    x = torch.randn(6, 3)
    payloads, fallbacks = robust_eigens([x.T @ x], torch.float32)
    assert [fb.level for fb in fallbacks] == ["float64"]
    assert payloads[0].dtype == torch.float32 and payloads[0].shape == (4, 3)
    evals, _ = real((x.T @ x).double())
    torch.testing.assert_close(payloads[0][3].double(), evals, rtol=1e-5, atol=1e-6)

    def always(m, *a, **k):
        raise torch.linalg.LinAlgError("no convergence (simulated)")

    monkeypatch.setattr(torch.linalg, "eigh", always)
    payloads, fallbacks = robust_eigens([x.T @ x], torch.float32)
    assert [fb.level for fb in fallbacks] == ["identity"] and "float64" in fallbacks[0].reason
    torch.testing.assert_close(payloads[0][3], torch.full((3,), float(torch.trace(x.T @ x)) / 3))


# ----------------------------------------------------------------------------- validation


def test_inverse_method_is_validated():
    with pytest.raises(ValueError, match=r"inverse_method must be one of 'cholesky', 'eigen', got 'svd'"):
        KFACOptions(inverse_method="svd")
    with pytest.raises(TypeError, match="inverse_method"):
        KFACOptions(inverse_method=3)
    assert KFACOptions().inverse_method == "cholesky"
    from lightning_spdkfac import KFAC

    with pytest.raises(ValueError, match="inverse_method"):
        KFAC(inverse_method="svd")
    assert KFAC(inverse_method="eigen").options.inverse_method == "eigen"


# ----------------------------------------------------------------------------- checkpoints


def ckpt_model():
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def batches(n):
    g = torch.Generator().manual_seed(5)
    return [torch.randn(8, 4, generator=g) for _ in range(n)]


def train(model, pre, xs):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in xs:
        opt.zero_grad()
        sq_loss(model(x)).backward()
        pre.step()
        opt.step()


def make_pre(model, method):
    return KFACPreconditioner(model, inverse_method=method, factor_update_steps=1, inv_update_steps=2,
                              damping=lambda k: 0.05 + 0.01 * k, lr=0.1)


def test_eigen_checkpoint_resumes_bitwise():
    xs = batches(6)
    model = ckpt_model()
    pre = make_pre(model, "eigen")
    train(model, pre, xs[:3])  # step 3 comes next: no inverse step, the payloads and damping of step 2
    saved_model, saved_pre = copy.deepcopy(model.state_dict()), copy.deepcopy(pre.state_dict())
    assert saved_pre["inverse_method"] == "eigen" and set(saved_pre["inverse_damping"]) == {"0", "2"}
    train(model, pre, xs[3:])

    resumed = ckpt_model()
    resumed.load_state_dict(saved_model)
    pre2 = make_pre(resumed, "eigen")
    pre2.load_state_dict(saved_pre)
    train(resumed, pre2, xs[3:])
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("saved", "resumed"), [("eigen", "cholesky"), ("cholesky", "eigen")])
def test_resume_with_another_method_warns_and_recomputes(saved, resumed):
    xs = batches(4)
    model = ckpt_model()
    pre = make_pre(model, saved)
    train(model, pre, xs[:3])
    state = pre.state_dict()
    pre2 = make_pre(model, resumed)
    with pytest.warns(UserWarning, match=rf"inverse_method='{saved}'.*dropped and recomputed"):
        pre2.load_state_dict(state)
    assert all(ly.A_inv is None and ly.G_inv is None for ly in pre2.layers.values())
    assert all(ly.A is not None for ly in pre2.layers.values())
    train(model, pre2, xs[3:])  # step 3 is no inverse step, but the dropped inverses are recomputed
    assert pre2.last_step_inverted
    for ly in pre2.layers.values():
        n = ly.A.shape[0]
        assert ly.A_inv.shape == ((n + 1, n) if resumed == "eigen" else (n, n))


def test_eigen_state_without_its_damping_is_refused():
    model = ckpt_model()
    pre = make_pre(model, "eigen")
    train(model, pre, batches(1))
    state = pre.state_dict()
    del state["inverse_damping"]["0"]
    with pytest.raises(ValueError, match=r"inverse_damping"):
        make_pre(ckpt_model(), "eigen").load_state_dict(state)
    state = pre.state_dict()
    state["layers"]["0"]["A_inv"] = state["layers"]["0"]["A_inv"][:-1]  # an n x n "payload"
    with pytest.raises(ValueError, match=r"eigen payloads"):
        make_pre(ckpt_model(), "eigen").load_state_dict(state)


# ----------------------------------------------------------------------------- the broadcast and the planner


def test_broadcaster_carries_eigen_payloads_rounded_to_the_comm_dtype():
    bc = InverseBroadcaster([0, 0], [3, 2], dtype=torch.bfloat16, result_dtype=torch.float32,
                            inverse_method="eigen")
    payload = torch.randn(4, 3)
    bc.begin_round()
    with pytest.raises(ValueError, match=r"shape \(4, 3\).*eigen"):
        bc.publish(0, torch.randn(3, 3))
    bc.publish(0, payload)
    bc.publish(1, torch.randn(3, 2))
    got = bc.wait_all()
    assert got[0].shape == (4, 3) and got[0].dtype == torch.float32
    assert torch.equal(got[0], payload.to(torch.bfloat16).float())  # the owner's copy is the rounded one
    assert bc.message_size(0) == 12


def test_planner_costs_eigen_broadcasts_at_n_times_n_plus_1():
    assert message_bytes(3, 4, "eigen") == 48 and message_bytes(3, 4, "cholesky") == 24
    inv, bcast = InverseCost(c3=1e-9), AlphaBeta(alpha=0.0, beta=1e-6)
    assert task_cost(100, inv, bcast, inverse_method="eigen") == pytest.approx(
        inv.time(100) + 2 * bcast.time(message_bytes(100, 4)))
    # Broadcasts twice as costly: LBP replicates more with eigen.
    ns = [8, 32, 64, 128, 256, 512]
    owned = {m: sum(o >= 0 for o in plan_placement(ns, 4, InverseCost(c3=2e-10), AlphaBeta(1e-5, 2e-9),
                                                    policy="lbp", inverse_method=m).owners)
             for m in ("cholesky", "eigen")}
    assert owned["eigen"] <= owned["cholesky"]
    with pytest.raises(ValueError, match="inverse_method"):
        plan_placement(ns, 2, inv, bcast, inverse_method="svd")


# ----------------------------------------------------------------------------- 2 ranks (gloo DDP)

STEPS, BATCH = 5, 8
KFAC_KW = dict(damping=0.05, kl_clip=1e-2, lr=0.1, factor_update_steps=1, inv_update_steps=2, inverse_method="eigen")
SCHEDULES = {
    "dkfac": dict(schedule="dkfac"),
    "mpd": dict(schedule="mpd"),
    "spd": dict(schedule="spd", profile_steps=(1, 3)),
    "spd_bf16": dict(schedule="spd", profile_steps=(1, 3), comm_dtype="bfloat16"),
}


def dist_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 12),
                         nn.Tanh(), nn.Linear(12, 5))


def dist_data(step, world):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH * world, 2, 6, 6, generator=g), torch.randint(0, 5, (BATCH * world,), generator=g)


def train_ranked(rank, world, options):
    torch.set_num_threads(1)
    model = dist_model()
    ddp = DDP(model)
    distributor = SPDDistributor(options, process_group=dist.new_group())
    pre = KFACPreconditioner(model, distributor=distributor, **KFAC_KW)
    sgd_kfac_steps(ddp, pre, dist_data, STEPS, world, rank, BATCH)
    return [p.detach().clone() for p in model.parameters()], list(distributor.placement_owners)


def all_schedules(rank, world):
    return {name: train_ranked(rank, world, SPDOptions.from_schedule(**kw)) for name, kw in SCHEDULES.items()}


def one_process():
    model = dist_model()
    sgd_kfac_steps(model, KFACPreconditioner(model, **KFAC_KW), dist_data, STEPS, 2)
    return [p.detach() for p in model.parameters()]


@pytest.fixture(scope="module")
def job():
    return SimpleNamespace(results=run_distributed(all_schedules, 2, timeout=120), reference=one_process())


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_eigen_schedules_agree_across_ranks_and_with_one_process(job, name):
    params = [r[name][0] for r in job.results]
    for a, b in zip(*params):
        assert torch.equal(a, b), f"{name}: the replicas differ"
    if name == "spd_bf16":  # eigen payloads rounded to bf16: the replicas agree exactly, the values roughly
        return
    if name == "mpd":
        assert sorted(job.results[0][name][1]) == [0, 0, 0, 1, 1, 1]  # eigen payloads were broadcast
    for a, b in zip(params[0], job.reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{name} vs one process")


# ----------------------------------------------------------------------------- DeepSpeed ZeRO-1 (Lightning)


def lightning_eigen_fit(rank, world, deepspeed):
    import os

    from helpers.lightning_models import KW, TinyInterleaved, trainer

    from lightning_spdkfac import KFAC, SPDKFACDeepSpeedStrategy, SPDKFACStrategy

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    model = TinyInterleaved(batch_size=4)
    if deepspeed:
        strategy = SPDKFACDeepSpeedStrategy(stage=1, profile_steps=(1, 3), logging_batch_size_per_gpu=4)
    else:
        strategy = SPDKFACStrategy(schedule="spd", profile_steps=(1, 3))
    import pytorch_lightning as pl

    cb = KFAC(**KW, inverse_method="eigen")
    shapes = []

    class Shapes(pl.Callback):
        def on_train_end(self, trainer, pl_module):
            shapes.extend(tuple(ly.A_inv.shape) for ly in cb.preconditioner.layers.values())

    t = trainer(max_steps=5, devices=world, strategy=strategy, callbacks=[cb, Shapes()], use_distributed_sampler=False)
    t.fit(model)
    return [p.detach().float().clone() for p in model.net.parameters()], shapes


@pytest.mark.slow
def test_eigen_under_deepspeed_zero1_equals_ddp():
    pytest.importorskip("deepspeed")
    ddp = run_distributed(lightning_eigen_fit, 2, False, timeout=240)
    ds = run_distributed(lightning_eigen_fit, 2, True, timeout=240)
    for a, b in zip(ds[0][0], ds[1][0]):
        assert torch.equal(a, b)
    assert ds[0][1] and all(s[0] == s[1] + 1 for s in ds[0][1])  # eigen payloads
    for a, b in zip(ds[0][0], ddp[0][0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
