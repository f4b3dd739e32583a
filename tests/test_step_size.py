"""step_size="quadratic" / "quadratic_momentum" (kfac/step_size.py) against dense references.

The reference builds the generalized Gauss-Newton matrix C = J^T H_L J explicitly in float64 (the Jacobian of the
outputs in the flattened parameters, the Hessian of the loss in the outputs, both by torch.autograd.functional)
and solves the damped quadratic model by hand; the rule computes it with a forward-mode pass and a Hessian-vector
product of the loss.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.functional import hessian, jacobian

from lightning_spdkfac import KFACOptions, KFACPreconditioner
from lightning_spdkfac.kfac import step_size as step_size_module

WIDE = (1e-9, 1e9)  # a clip range that never binds: alpha is the model's own


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5)).double()


LOSSES = {
    "cross_entropy": lambda z, y: F.cross_entropy(z, y),
    "label_smoothing": lambda z, y: F.cross_entropy(z, y, label_smoothing=0.1),
    "ignore_index": lambda z, y: F.cross_entropy(z, y, ignore_index=2),
    "sum_reduction": lambda z, y: F.cross_entropy(z, y, reduction="sum"),
    "mse": lambda z, y: F.mse_loss(z, F.one_hot(y, 5).double()),
}


def _batch(seed: int = 1, n: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randint(0, 5, (n,), generator=g)


def _flat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def _dense_ggn(net: nn.Module, params: list[torch.Tensor], x: torch.Tensor, loss) -> tuple[torch.Tensor, torch.Tensor]:
    """(C, g) at ``params``: C = J^T H_L J and the loss gradient, dense, float64."""
    shapes = [p.shape for p in params]
    names = [n for n, _ in net.named_parameters()]

    def unflat(v: torch.Tensor) -> dict[str, torch.Tensor]:
        out, i = {}, 0
        for n, s in zip(names, shapes):
            k = int(torch.Size(s).numel())
            out[n] = v[i:i + k].reshape(s)
            i += k
        return out

    theta = _flat(params).detach()
    outputs = lambda v: torch.func.functional_call(net, unflat(v), (x,)).reshape(-1)  # noqa: E731
    z = outputs(theta).detach()
    J = jacobian(outputs, theta)
    zshape = torch.func.functional_call(net, unflat(theta), (x,)).shape
    H = hessian(lambda zz: loss(zz.reshape(zshape)), z)
    g = torch.autograd.functional.vjp(lambda v: loss(torch.func.functional_call(net, unflat(v), (x,))), theta)[1]
    return J.T @ H @ J, g


def _steps(net: nn.Module, opt: torch.optim.Optimizer, pre: KFACPreconditioner, loss, batches) -> list[dict]:
    """Train; for each step record the parameters before, the optimizer's own update and the result."""
    record = []
    for x, y in batches:
        opt.zero_grad()
        loss(net(x), y).backward()
        before = [p.detach().clone() for p in net.parameters()]
        # the optimizer's own update: the same step on a copy of the optimizer, without the rule
        probe_net = copy.deepcopy(net)
        probe_opt = type(opt)(probe_net.parameters(), lr=opt.defaults["lr"])  # the rest from the state below
        probe_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # (state_dict shares its tensors)
        pre.step(opt, loss_parts=((lambda x=x: net(x)), (lambda z, y=y: loss(z, y))))
        for pp, p in zip(probe_net.parameters(), net.parameters()):
            pp.grad = p.grad.clone()
        probe_opt.step()
        opt.step()
        record.append({"before": before, "u": [q.detach() - b for q, b in zip(probe_net.parameters(), before)],
                       "after": [p.detach().clone() for p in net.parameters()], "x": x, "y": y})
    return record


@pytest.mark.parametrize("loss_name", sorted(LOSSES))
def test_alpha_is_the_dense_quadratic_models_minimizer(loss_name: str) -> None:
    """alpha = -g.u / (u^T C u + lambda |u|^2) with C the dense GGN, for each loss; the step is old + alpha u."""
    loss = LOSSES[loss_name]
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.3)
    pre = KFACPreconditioner(net, step_size="quadratic", step_size_every=1, step_size_clip=WIDE, inv_dtype="float64",
                             factor_dtype="float64", damping=1e-2)
    record = _steps(net, opt, pre, loss, [_batch(1), _batch(2), _batch(3)])
    for r in record:
        C, g = _dense_ggn(net, r["before"], r["x"], lambda z, y=r["y"]: loss(z, y))
        u = _flat(r["u"])
        alpha = float(-(g @ u) / (u @ C @ u + 1e-2 * (u @ u)))
        assert 1e-3 < abs(alpha) < 1e3  # a real measurement, not a clip bound
        moved = _flat(r["after"]) - _flat(r["before"])
        torch.testing.assert_close(moved, alpha * u, rtol=1e-8, atol=1e-12)
    assert pre.step_size is not None and pre.step_size.measurements == 3


def test_momentum_solves_the_two_by_two_model() -> None:
    """quadratic_momentum: (alpha, mu) minimize the model on the plane of u and the previous update delta."""
    loss = LOSSES["cross_entropy"]
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.3)
    lam = 3e-3
    pre = KFACPreconditioner(net, step_size="quadratic_momentum", step_size_every=1, step_size_clip=WIDE,
                             step_size_damping=lam, inv_dtype="float64", factor_dtype="float64")
    record = _steps(net, opt, pre, loss, [_batch(i) for i in range(1, 7)])
    mus = []
    for prev, r in zip(record, record[1:]):
        C, g = _dense_ggn(net, r["before"], r["x"], lambda z, y=r["y"]: loss(z, y))
        u, d = _flat(r["u"]), _flat(prev["after"]) - _flat(prev["before"])
        M = torch.stack([torch.stack([u @ C @ u + lam * u @ u, u @ C @ d + lam * u @ d]),
                         torch.stack([u @ C @ d + lam * u @ d, d @ C @ d + lam * d @ d])])
        alpha, mu = torch.linalg.solve(M, -torch.stack([g @ u, g @ d])).tolist()
        if not 0 <= mu <= 0.99:  # the constrained minimizer: mu on its bound, alpha optimal for it
            mu = min(max(mu, 0.0), 0.99)
            alpha = float(-(g @ u + mu * M[0, 1]) / M[0, 0])
        mus.append(mu)
        moved = _flat(r["after"]) - _flat(r["before"])
        torch.testing.assert_close(moved, alpha * u + mu * d, rtol=1e-7, atol=1e-12)
    assert any(0 < m < 0.99 for m in mus), f"no step with mu inside its range: {mus}"


def test_reverse_over_reverse_equals_forward_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a model has no forward-mode rule, J u comes from two reverse passes: the same alpha."""
    alphas = []
    for forward_mode in (True, False):
        if not forward_mode:
            def no_forward_mode(*args, **kwargs):
                raise NotImplementedError("Trying to use forward AD with an op that does not support it")
            monkeypatch.setattr(step_size_module, "_forward_mode", no_forward_mode)
        net = _net()
        pre = KFACPreconditioner(net, step_size="quadratic", step_size_every=1, step_size_clip=WIDE)
        opt = torch.optim.SGD(net.parameters(), lr=0.3)
        _steps(net, opt, pre, LOSSES["label_smoothing"], [_batch(1), _batch(2)])
        alphas.append(pre.step_size.alpha)
    assert alphas[0] == pytest.approx(alphas[1], rel=1e-9)


def test_batchnorm_statistics_and_rng_are_untouched() -> None:
    """The measurement's forward leaves BatchNorm's running statistics and the global RNG stream alone."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Dropout(0.2), nn.ReLU(), nn.Linear(8, 5))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    pre = KFACPreconditioner(net, step_size="quadratic", step_size_every=1)
    x, y = _batch(1)
    x = x.float()
    opt.zero_grad()
    F.cross_entropy(net(x), y).backward()
    stats = [b.clone() for b in net.buffers()]
    pre.step(opt, loss_parts=((lambda: net(x)), (lambda z: F.cross_entropy(z, y))))
    rng = torch.get_rng_state()
    opt.step()
    assert pre.step_size.measurements == 1
    assert torch.equal(torch.get_rng_state(), rng)
    for a, b in zip(stats, net.buffers()):
        assert torch.equal(a, b)


def test_adam_update_is_rescaled_and_reused_between_measurements() -> None:
    """Under Adam the whole update is rescaled; alpha is measured every step_size_every steps and reused."""
    net = _net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    pre = KFACPreconditioner(net, step_size="quadratic", step_size_every=2, step_size_clip=WIDE)
    record = _steps(net, opt, pre, LOSSES["cross_entropy"], [_batch(i) for i in range(1, 5)])
    assert pre.step_size.measurements == 2
    ratios = []
    for r in record:
        moved, u = _flat(r["after"]) - _flat(r["before"]), _flat(r["u"])
        ratios.append(float(moved @ u / (u @ u)))
        torch.testing.assert_close(moved, ratios[-1] * u, rtol=1e-7, atol=1e-12)
    assert ratios[0] == pytest.approx(ratios[1]) and ratios[2] == pytest.approx(ratios[3])
    assert ratios[0] != pytest.approx(ratios[2])


def test_clip_bounds_alpha() -> None:
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=1e-6)  # a tiny step: the model's alpha is huge
    pre = KFACPreconditioner(net, step_size="quadratic", step_size_every=1, step_size_clip=(0.5, 4.0))
    _steps(net, opt, pre, LOSSES["cross_entropy"], [_batch(1)])
    assert pre.step_size.alpha == 4.0


def test_checkpoint_round_trip_continues_exactly() -> None:
    """alpha, mu and the previous update are in the state: a resumed run continues bit for bit."""
    loss = LOSSES["cross_entropy"]
    batches = [_batch(i) for i in range(1, 7)]

    def make():
        net = _net()
        opt = torch.optim.SGD(net.parameters(), lr=0.3)
        pre = KFACPreconditioner(net, step_size="quadratic_momentum", step_size_every=2)
        return net, opt, pre

    net, opt, pre = make()
    _steps(net, opt, pre, loss, batches)
    net2, opt2, pre2 = make()
    _steps(net2, opt2, pre2, loss, batches[:3])
    state = copy.deepcopy((net2.state_dict(), opt2.state_dict(), pre2.state_dict()))
    assert "step_size" in state[2] and state[2]["step_size"]["prev"]
    net3, opt3, pre3 = make()
    net3.load_state_dict(state[0])
    opt3.load_state_dict(state[1])
    pre3.load_state_dict(state[2])
    _steps(net3, opt3, pre3, loss, batches[3:])
    for a, b in zip(net.parameters(), net3.parameters()):
        assert torch.equal(a, b)


def test_corrupt_step_size_state_is_refused() -> None:
    net = _net()
    pre = KFACPreconditioner(net, step_size="quadratic")
    state = pre.state_dict()
    state["step_size"]["alpha"] = float("nan")
    with pytest.raises(ValueError, match="step_size.alpha"):
        pre.load_state_dict(state)


def test_bad_arguments_name_the_argument() -> None:
    with pytest.raises(ValueError, match="step_size"):
        KFACOptions(step_size="adaptive")
    with pytest.raises(ValueError, match="step_size_clip"):
        KFACOptions(step_size_clip=(2.0, 4.0))
    with pytest.raises(ValueError, match="step_size_every"):
        KFACOptions(step_size_every=0)
    net = _net()
    pre = KFACPreconditioner(net, step_size="quadratic")
    net(_batch()[0]).sum().backward()
    with pytest.raises(ValueError, match="kfac_loss_parts"):
        pre.step(torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="optimizer"):
        pre.step()


def test_a_loss_without_curvature_keeps_alpha_and_warns() -> None:
    """A loss linear in the outputs has no curvature along the update: alpha is kept, with a warning."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    pre = KFACPreconditioner(net, step_size="quadratic", step_size_every=1, step_size_damping=0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _steps(net, opt, pre, lambda z, y: z.mean(), [_batch(1)])
    assert pre.step_size.alpha == 1.0
    assert any("no positive curvature" in str(w.message) for w in caught)


def _ranked(rank: int, world: int) -> tuple[float, list[torch.Tensor]]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_spdkfac.comm.scheduler import SPDDistributor, SPDOptions

    torch.set_num_threads(1)
    net = _net()
    ddp = DDP(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.3)
    options = SPDOptions.from_schedule(schedule="spd", profile_steps=(1, 2))
    pre = KFACPreconditioner(net, distributor=SPDDistributor(options, process_group=dist.new_group()),
                             step_size="quadratic", step_size_every=1, step_size_clip=WIDE, factor_update_steps=1,
                             inv_update_steps=1)
    for i in range(3):
        x, y = _batch(10 + i, n=12)
        x, y = x[rank * 6:(rank + 1) * 6], y[rank * 6:(rank + 1) * 6]
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        pre.step(opt, loss_parts=((lambda x=x: net(x)), (lambda z, y=y: F.cross_entropy(z, y))))
        opt.step()
    pre.remove_hooks()
    return pre.step_size.alpha, [p.detach().clone() for p in net.parameters()]


def test_two_ranks_equal_each_other_and_one_process() -> None:
    """Under DDP every rank computes the same alpha (the curvature terms averaged): bitwise equal replicas,
    equal to one process on the joint batch."""
    from lightning_spdkfac.multiprocess import run_distributed

    results = run_distributed(_ranked, 2, timeout=120)
    assert results[0][0] == results[1][0]
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.equal(a, b)
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.3)
    pre = KFACPreconditioner(net, step_size="quadratic", step_size_every=1, step_size_clip=WIDE, factor_update_steps=1,
                             inv_update_steps=1)
    _steps(net, opt, pre, LOSSES["cross_entropy"], [_batch(10 + i, n=12) for i in range(3)])
    assert results[0][0] == pytest.approx(pre.step_size.alpha, rel=1e-6)
    for a, b in zip(results[0][1], net.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=1e-4, atol=1e-6)  # float32 factors, reduced vs joint


# ------------------------------------------------------------------------------ the Lightning callback
def test_callback_equals_the_plain_loop_logs_alpha_and_refuses_a_module_without_loss_parts(tmp_path) -> None:
    """KFAC(step_size=...) takes kfac_loss_parts(batch) from the LightningModule: the fit equals the same steps in
    plain PyTorch; alpha, mu and the damping are logged; a module without the method stops at fit start."""
    from helpers.lightning_models import KW, Tiny, data, trainer
    from pytorch_lightning.loggers import CSVLogger

    from lightning_spdkfac import KFAC

    class WithParts(Tiny):
        def kfac_loss_parts(self, batch):
            x, y = batch
            return (lambda: self(x)), (lambda z: F.cross_entropy(z, y))

    rule = dict(step_size="quadratic", step_size_every=2, step_size_clip=(0.2, 5.0))
    model = WithParts()
    cb = KFAC(**KW, **rule)
    t = trainer(max_steps=4, logger=CSVLogger(tmp_path), log_every_n_steps=2, callbacks=[cb])
    t.fit(model)
    state = cb.state_dict()["step_size"]
    assert state["measurements"] == 2 and state["alpha"] != 1.0

    import csv
    with open(f"{t.logger.log_dir}/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("kfac/alpha")]
    assert len(rows) == 2 and float(rows[-1]["kfac/alpha"]) == pytest.approx(state["alpha"])
    assert float(rows[-1]["kfac/mu"]) == 0.0 and float(rows[-1]["kfac/step_size_damping"]) > 0

    ref = WithParts()  # the same steps in plain PyTorch
    opt = torch.optim.SGD(ref.parameters(), lr=ref.lr, momentum=0.9)
    pre = KFACPreconditioner(ref, **KW, **rule)
    x_all, y_all = data(ref.n)
    for i in range(4):
        x, y = x_all[i * 8:(i + 1) * 8], y_all[i * 8:(i + 1) * 8]
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        pre.step(opt, loss_parts=ref.kfac_loss_parts((x, y)))
        opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)

    with pytest.raises(ValueError, match="kfac_loss_parts"):
        trainer(max_steps=1, callbacks=[KFAC(**KW, **rule)]).fit(Tiny())


def test_refused_where_zero_owns_the_update() -> None:
    """Under DeepSpeed (a GradAccess of its own) ZeRO steps its partitioned fp32 copy: refused at construction."""
    from lightning_spdkfac.kfac.gradients import GradAccess

    class ZeroLike(GradAccess):
        pass

    with pytest.raises(ValueError, match="step_size='quadratic' is not supported under SPDKFACDeepSpeedStrategy"):
        KFACPreconditioner(_net(), step_size="quadratic", grad_access=ZeroLike())


def test_transformers_gpt2_alpha_matches_finite_differences() -> None:
    """A model this project did not write (transformers' GPT-2: Conv1D, SDPA attention, tied head), a per-token
    cross-entropy with ignore_index and label smoothing: alpha equals the one built from J u by central finite
    differences of the float64 model (the loss's own Hessian-vector product on top)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=50, n_positions=16,
                                         bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0)  # dropout would make the finite differences noise
        model = transformers.GPT2LMHeadModel(config).double()
    ids = torch.randint(0, 50, (3, 12))

    def forward():
        return model(input_ids=ids).logits[:, :-1]

    def loss(z):
        return F.cross_entropy(z.reshape(-1, 50), ids[:, 1:].reshape(-1), ignore_index=7, label_smoothing=0.1)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pre = KFACPreconditioner(model, step_size="quadratic", step_size_every=1, step_size_clip=WIDE, damping=1e-3)
    opt.zero_grad()
    loss(forward()).backward()
    g = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    old = {n: p.detach().clone() for n, p in model.named_parameters()}
    probe = copy.deepcopy(model)
    probe_opt = torch.optim.AdamW(probe.parameters(), lr=1e-3)
    pre.step(opt, loss_parts=(forward, loss))
    for pp, p in zip(probe.parameters(), model.parameters()):
        pp.grad = p.grad.clone()
    probe_opt.step()
    u = {n: p.detach() - old[n] for n, p in probe.named_parameters()}
    opt.step()

    eps = 1e-4
    with torch.no_grad():
        outs = []
        for sign in (1, -1):
            for n, p in probe.named_parameters():
                p.copy_(old[n] + sign * eps * u[n])
            outs.append(probe(input_ids=ids).logits[:, :-1])
        ju = (outs[0] - outs[1]) / (2 * eps)
        for n, p in probe.named_parameters():
            p.copy_(old[n])
        z = probe(input_ids=ids).logits[:, :-1]
    z = z.detach().requires_grad_()
    (gz,) = torch.autograd.grad(loss(z), z, create_graph=True)
    (hju,) = torch.autograd.grad(gz, z, ju)
    uu = sum((t * t).sum() for t in u.values())
    gu = sum((g[n] * u[n]).sum() for n in u)
    alpha = float(-gu / ((ju * hju).sum() + 1e-3 * uu))
    assert 1e-2 < alpha < 1e4
    assert pre.step_size.alpha == pytest.approx(alpha, rel=1e-5)


def test_levenberg_marquardt_follows_the_reduction_ratio() -> None:
    """adapt_damping: rho = (loss after - loss before) / the undamped model's predicted change, both recomputed here
    on the batch; the damping moves by 0.95**every in the direction rho says, and reaches the preconditioner."""
    loss = LOSSES["cross_entropy"]
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.3)
    pre = KFACPreconditioner(net, step_size="quadratic", step_size_every=1, step_size_clip=WIDE, adapt_damping=True,
                             damping=1e-2, inv_dtype="float64", factor_dtype="float64")
    damping, rhos = 1e-2, []
    for r in _steps(net, opt, pre, loss, [_batch(i) for i in range(1, 5)]):
        C, g = _dense_ggn(net, r["before"], r["x"], lambda z, y=r["y"]: loss(z, y))
        delta = _flat(r["after"]) - _flat(r["before"])
        predicted = float(g @ delta + 0.5 * delta @ C @ delta)
        with torch.no_grad():
            before = torch.nn.utils.vector_to_parameters  # (the reference evaluates both points on a copy)
            probe = copy.deepcopy(net)
            before(_flat(r["before"]), probe.parameters())
            l0 = float(loss(probe(r["x"]), r["y"]))
            before(_flat(r["after"]), probe.parameters())
            l1 = float(loss(probe(r["x"]), r["y"]))
        rho = (l1 - l0) / predicted
        rhos.append(rho)
        damping = damping * 0.95 if rho > 0.75 else damping / 0.95 if rho < 0.25 else damping
    assert pre.step_size.rho == pytest.approx(rhos[-1], rel=1e-6)  # (the last measurement's)
    assert damping != 1e-2, f"the damping never moved (rho {rhos}): the check would not see a wrong rule"
    assert pre.damping == pytest.approx(damping, rel=1e-12)
    assert pre.state_dict()["step_size"]["damping"] == pytest.approx(damping, rel=1e-12)


def test_adapt_damping_refuses_a_schedule_and_resumes_its_damping() -> None:
    with pytest.raises(ValueError, match="adapt_damping"):
        KFACOptions(adapt_damping=True, damping=lambda k: 0.01)
    net = _net()
    pre = KFACPreconditioner(net, adapt_damping=True)
    state = pre.state_dict()
    state["step_size"]["damping"] = 0.005
    pre2 = KFACPreconditioner(_net(), adapt_damping=True)
    pre2.load_state_dict(state)
    assert pre2.damping == 0.005 and pre2.step_size.alpha == 1.0


def test_the_demo_digits_cnn_gives_its_training_loss_as_loss_parts() -> None:
    """`spdkfac fit --config configs/digits.yaml --kfac.step_size=quadratic` needs DigitsCNN.kfac_loss_parts: it
    computes exactly the training step's loss."""
    from lightning_spdkfac.demo import DigitsCNN

    torch.manual_seed(0)
    model = DigitsCNN()
    batch = (torch.randn(5, 1, 8, 8), torch.randint(0, 10, (5,)))
    forward, loss = model.kfac_loss_parts(batch)
    model.log = lambda *args, **kwargs: None  # (no Trainer attached)
    assert torch.equal(loss(forward()), model.training_step(batch, 0))
