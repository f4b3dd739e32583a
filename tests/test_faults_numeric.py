"""Numeric faults: non-finite activations, output gradients, received factors and gradients, too many
bad steps in a row, and ill-conditioned, rank-deficient or indefinite factors at inversion.

Each test injects the fault and checks the outcome against a reference computed independently:
copies of the running factors taken before the fault, a run that never saw the bad batch, the
gradients before the step, or a float64 eigendecomposition of the factor.
"""

from __future__ import annotations

import csv
import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_spdkfac import KFACPreconditioner
from lightning_spdkfac.kfac.distributor import Distributor
from lightning_spdkfac.kfac.inverse import robust_inverses

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*GPU available but not used.*")


# --------------------------------------------------------------------------- helpers
def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def batches(n_batches: int, n: int = 8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)) for _ in range(n_batches)]


def backward(model, x, y):
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()


def run_without_the_bad_batch(data):
    """The reference of the skip tests: a fresh model and preconditioner that only ever saw batches 0 and 2."""
    ref_model = mlp()
    ref = KFACPreconditioner(ref_model, kl_clip=None, factor_update_steps=1, inv_update_steps=10)
    for x, y in (data[0], data[2]):
        backward(ref_model, x, y)
        ref.step()
    return ref_model, ref


def factors(pre):
    return {n: (ly.A.clone(), ly.G.clone()) for n, ly in pre.layers.items()}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, NaNs included (float32)."""
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def assert_factors_equal(pre, saved):
    for n, (A, G) in saved.items():
        assert torch.equal(pre.layers[n].A, A) and torch.equal(pre.layers[n].G, G), n


class Poison:
    """Injects a non-finite value while ``on`` is true: into the module's input (NaN) with
    ``kind="activation"``, into the gradient of its output (inf) with ``kind="output_grad"``, or
    into the output gradient K-FAC sees but not the one backpropagated (``kind="factor_only"``).

    The output-gradient hook is registered ahead of K-FAC's (``prepend=True`` on the forward hook
    that registers it), so K-FAC's G hook sees the inf, as it would an overflow from later layers;
    with "factor_only" a hook after K-FAC's puts the clean gradient back.
    """

    def __init__(self, module: nn.Module, kind: str):
        self.on = False
        self.clean = None
        if kind == "activation":
            module.register_forward_pre_hook(self._input)
        else:
            module.register_forward_hook(self._output, prepend=True)
        if kind == "factor_only":
            module.register_forward_hook(self._restore)

    def _input(self, module, inputs):
        if not self.on:
            return None
        x = inputs[0].clone()
        x[0, 0] = float("nan")
        return (x,) + inputs[1:]

    def _output(self, module, inputs, output):
        if self.on:
            output.register_hook(self._inject)

    def _inject(self, grad):
        self.clean = grad
        return grad.index_fill(1, torch.tensor([0]), float("inf"))

    def _restore(self, module, inputs, output):
        if self.on:
            output.register_hook(lambda grad: self.clean)


# --------------------------------------------------------------------------- non-finite factors
@pytest.mark.parametrize("kind, where, what", [
    ("activation", "2", "activations (A factor)"),
    ("output_grad", "0", "output gradients (G factor)"),
])
def test_nonfinite_factor_input_skips_the_update_and_the_next_good_step_resumes(kind, where, what, caplog):
    caplog.set_level(logging.INFO, logger="lightning_spdkfac")
    data = batches(3)
    model = mlp()
    pre = KFACPreconditioner(model, kl_clip=None, factor_update_steps=1, inv_update_steps=10)
    poison = Poison(model[int(where)], kind)
    backward(model, *data[0])
    pre.step()
    saved = factors(pre)

    poison.on = True
    backward(model, *data[1])
    poison.on = False
    raw = [p.grad.clone() for p in model.parameters()]
    pre.step()
    assert_factors_equal(pre, saved)  # bitwise: the last good value
    assert pre.skipped_factor_steps == 1 and pre.consecutive_bad_steps == 1
    assert pre.last_bad_step["step"] == 1 and what in pre.last_bad_step["bad"][where]
    (record,) = caplog.records  # non-finite factors: a warning in the log, naming the layer
    assert record.levelno == logging.WARNING and f"layer '{where}'" in record.getMessage()
    # The poison made gradients non-finite too: they reach the optimizer exactly as they were.
    assert pre.skipped_precondition_steps == 1
    assert all(same_bits(p.grad, r) for p, r in zip(model.parameters(), raw))
    assert not all(torch.isfinite(p.grad).all() for p in model.parameters())

    backward(model, *data[2])
    pre.step()
    assert pre.consecutive_bad_steps == 0 and pre.skipped_factor_steps == 1
    # Reference: a run that never saw the bad batch has the same factors and gradients.
    ref_model, ref = run_without_the_bad_batch(data)
    for n, layer in pre.layers.items():
        assert not torch.equal(layer.A, saved[n][0]) or not torch.equal(layer.G, saved[n][1])
        torch.testing.assert_close(layer.A, ref.layers[n].A, rtol=0, atol=0)
        torch.testing.assert_close(layer.G, ref.layers[n].G, rtol=0, atol=0)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_nonfinite_gradient_skips_preconditioning_and_the_optimizer_sees_it(caplog):
    caplog.set_level(logging.INFO, logger="lightning_spdkfac")
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = mlp()
            self.gain = nn.Parameter(torch.ones(()))  # not a K-FAC layer

        def forward(self, x):
            return self.body(x) * self.gain

    torch.manual_seed(0)
    model = Net()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    pre = KFACPreconditioner(model, kl_clip=None, factor_update_steps=1, inv_update_steps=10,
                             grad_scaler=scaler)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batches(3)
    for i, (x, y) in enumerate(data):
        opt.zero_grad(set_to_none=True)
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        if i == 1:
            model.gain.grad.fill_(float("nan"))  # only the non-K-FAC parameter overflows
            saved = factors(pre)
        scaler.unscale_(opt)
        raw = [p.grad.clone() for p in model.parameters()]
        params = [p.detach().clone() for p in model.parameters()]
        pre.step()
        if i == 1:
            # Untouched, bitwise, K-FAC layers included: nothing is preconditioned this step.
            assert all(same_bits(p.grad, r) for p, r in zip(model.parameters(), raw))
            assert_factors_equal(pre, saved)
            assert (pre.skipped_factor_steps, pre.skipped_precondition_steps) == (1, 1)
            assert pre.last_bad_step["bad"] == {"parameter 'gain'": ["gradient"]}
            # A gradient overflow alone is routine under fp16 loss scaling: logged at INFO.
            (record,) = caplog.records
            assert record.levelno == logging.INFO and "parameter 'gain': gradient" in record.getMessage()
        else:
            assert not torch.equal(model.body[0].weight.grad, raw[0])  # preconditioned
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if i == 1:  # the optimizer's own overflow handling saw the NaN: step skipped, scale lowered
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
            assert scaler.get_scale() == scale / 2
    assert pre.skipped_precondition_steps == 1 and pre.consecutive_bad_steps == 0


# --------------------------------------------------------------------------- received factors
class CorruptingDistributor(Distributor):
    """One process, but through the distributed code path: reduce_factors returns a NaN A factor
    of layer ``index`` on the steps in ``bad_steps``, as a faulty rank or link would."""

    def __init__(self, index: int, bad_steps: set[int]):
        self.index, self.bad_steps, self.step = index, bad_steps, -1

    def begin_step(self, step):
        self.step += 1

    def reduce_factors(self, local):
        out = dict(local)
        if self.step in self.bad_steps:
            A = out[(self.index, "A")].clone()
            A[1, 1] = float("nan")
            out[(self.index, "A")] = A
        return out


def test_nonfinite_received_factor_skips_the_update_but_preconditions():
    data = batches(3)
    model = mlp()
    pre = KFACPreconditioner(model, kl_clip=None, factor_update_steps=1, inv_update_steps=10,
                             distributor=CorruptingDistributor(index=1, bad_steps={1}))
    assert not pre.core.local  # the distributed path (_fold_reduced) runs
    backward(model, *data[0])
    pre.step()
    saved = factors(pre)
    inverses = {n: (ly.A_inv.clone(), ly.G_inv.clone()) for n, ly in pre.layers.items()}

    backward(model, *data[1])
    raw = {n: torch.cat([ly.helper.module.weight.grad, ly.helper.module.bias.grad[:, None]], 1)
           for n, ly in pre.layers.items()}
    pre.step()
    assert_factors_equal(pre, saved)
    assert (pre.skipped_factor_steps, pre.skipped_precondition_steps) == (1, 0)
    assert pre.last_bad_step["bad"] == {"2": ["received A factor (non-finite after the reduction over ranks)"]}
    # Gradients were finite: preconditioned with the last good inverses, G_inv [dW, db] A_inv.
    for n, layer in pre.layers.items():
        want = inverses[n][1] @ raw[n] @ inverses[n][0]
        got = torch.cat([layer.helper.module.weight.grad, layer.helper.module.bias.grad[:, None]], 1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)

    backward(model, *data[2])
    pre.step()
    _, ref = run_without_the_bad_batch(data)
    for n, layer in pre.layers.items():
        torch.testing.assert_close(layer.A, ref.layers[n].A, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(layer.G, ref.layers[n].G, rtol=1e-6, atol=1e-7)


def test_received_factor_blame_says_when_this_rank_produced_it():
    model = mlp()
    pre = KFACPreconditioner(model, distributor=CorruptingDistributor(index=0, bad_steps=set()), lr=0.1)
    poison = Poison(model[0], "activation")
    poison.on = True
    backward(model, *batches(1)[0])
    pre.step()
    assert "activations (A factor) on this rank" in pre.last_bad_step["bad"]["0"]


# --------------------------------------------------------------------------- max_bad_steps
def run_steps(pre, model, poison, pattern):
    """One step per character: 'b' poisoned, 'g' good."""
    for i, c in enumerate(pattern):
        poison.on = c == "b"
        backward(model, *batches(1, n=4 + i % 3)[0])
        pre.step()


def test_k_consecutive_bad_steps_raise_naming_the_layer():
    model = mlp()
    pre = KFACPreconditioner(model, max_bad_steps=3, factor_update_steps=1, inv_update_steps=10, lr=0.1)
    poison = Poison(model[0], "output_grad")
    run_steps(pre, model, poison, "gbb")
    with pytest.raises(RuntimeError) as err:
        run_steps(pre, model, poison, "b")
    msg = str(err.value)
    assert "3 consecutive factor steps" in msg and "max_bad_steps=3" in msg and "at step 3" in msg
    assert "layer '0': output gradients (G factor), gradient" in msg  # factors first, then the gradient
    assert "layer '2'" not in msg  # its output gradient and gradients were finite
    for fix in ("lower the learning rate", "raise damping", "loss scaling", "check the input data"):
        assert fix in msg


def test_k_minus_one_bad_steps_then_a_good_one_do_not_raise():
    model = mlp()
    pre = KFACPreconditioner(model, max_bad_steps=3, factor_update_steps=1, inv_update_steps=10, lr=0.1)
    poison = Poison(model[0], "output_grad")
    run_steps(pre, model, poison, "gbbgbbgbb")
    assert pre.skipped_factor_steps == 6 and pre.consecutive_bad_steps == 2
    unlimited = KFACPreconditioner(mlp(), max_bad_steps=None, factor_update_steps=1, inv_update_steps=10, lr=0.1)
    run_steps(unlimited, unlimited.model, Poison(unlimited.model[0], "output_grad"), "gbbbbbb")
    assert unlimited.consecutive_bad_steps == 6


@pytest.mark.parametrize("value, error", [(0, ValueError), (-2, ValueError), (1.5, TypeError), (True, TypeError)])
def test_max_bad_steps_is_validated(value, error):
    with pytest.raises(error, match=r"max_bad_steps must be None \(never raise\) or a positive integer"):
        KFACPreconditioner(mlp(), max_bad_steps=value, lr=0.1)


# --------------------------------------------------------------------------- host syncs
class SyncCounter(TorchFunctionMode):
    SYNCS = {"tolist", "item", "__bool__", "__float__", "__int__", "__index__"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.SYNCS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_blame_costs_host_syncs_only_on_bad_steps():
    model = mlp()
    pre = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=10, lr=0.1)
    poison = Poison(model[0], "output_grad")
    counts = []
    for c in "ggbg":  # step 0 also inverts; steps 1-3 do not
        poison.on = c == "b"
        backward(model, *batches(1)[0])
        with SyncCounter() as sc:
            pre.step()
        counts.append(sc.count)
    assert counts[0] == 2  # finiteness + the batched Cholesky check
    assert counts[1] == 1 and counts[3] == 1  # healthy factor step: the finiteness check only
    assert counts[2] > 1  # the bad step pays for the blame


# --------------------------------------------------------------------------- inversion fallbacks
def ref_inverse(f: torch.Tensor, damping: float, floor: float = 0.0) -> torch.Tensor | None:
    """float64 (sym(F) with negative eigenvalues clamped to 0 + damping I)^-1; None where undefined.

    With ``floor``, eigenvalues below ``floor`` times the largest are raised to it (the documented
    regularization of kfac.inverse for singular factors without damping)."""
    f = f.double()
    evals, evecs = torch.linalg.eigh(0.5 * (f + f.T))
    shifted = evals.clamp(min=0.0) + damping
    shifted = shifted.clamp(min=floor * float(shifted.max()))
    if float(shifted.min()) <= 0.0:
        return None
    return (evecs / shifted) @ evecs.T


def spectrum(evals, seed=0):
    q, _ = torch.linalg.qr(torch.randn(len(evals), len(evals), generator=torch.Generator().manual_seed(seed),
                                       dtype=torch.float64))
    return (q * torch.as_tensor(evals, dtype=torch.float64)) @ q.T


def rank_deficient(side=16, rows=4):
    x = torch.randn(rows, side, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    return x.T @ x / rows


CASES = {
    "rank_deficient": rank_deficient(),  # 4 rows, side 16: rank 4
    "near_singular": spectrum(torch.logspace(0, -12, 16)),  # condition number 1e12
    "indefinite": spectrum(torch.cat([torch.linspace(1.0, 0.1, 15), torch.tensor([-0.3])])),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("damping", [0.0, 1e-8, 1e-2])
@pytest.mark.parametrize("case", list(CASES))
def test_ill_conditioned_factors_invert_to_the_float64_reference(case, damping, dtype):
    f = CASES[case].to(dtype)  # the stored factor; the reference starts from the same values
    (inv,), fallbacks = robust_inverses([f], damping, dtype)
    assert inv.dtype == dtype and torch.isfinite(inv).all()
    want = ref_inverse(f, damping)
    if want is None:  # singular for this damping: the documented floor of 1e-10 x the largest eigenvalue
        want = ref_inverse(f, damping, floor=1e-10)
    err = float((inv.double() - want).norm() / want.norm())
    assert err < 1e-3, (err, fallbacks)
    if case == "indefinite" or (damping == 0.0 and dtype == torch.float32):
        assert [fb.level for fb in fallbacks] == ["eigh"]


def test_badly_scaled_but_well_conditioned_factor_stays_on_cholesky():
    # D S D with S well-conditioned: condition number ~1e12, yet Cholesky is accurate (its accuracy
    # depends on the diagonally scaled matrix S), so the ill-conditioning test must not reject it.
    d = torch.logspace(-3, 3, 16, dtype=torch.float64)
    f = (d[:, None] * spectrum(torch.linspace(1.0, 0.5, 16), seed=3) * d[None, :]).float()
    (inv,), fallbacks = robust_inverses([f], 0.0, torch.float32)
    assert fallbacks == []
    want = ref_inverse(f, 0.0)
    assert float((inv.double() - want).norm() / want.norm()) < 1e-4


def test_eigh_failure_retries_with_larger_damping(monkeypatch):
    def no_convergence(*args, **kwargs):
        raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")

    monkeypatch.setattr(torch.linalg, "eigh", no_convergence)
    f = CASES["indefinite"]  # smallest eigenvalue -0.3: Cholesky fails at damping 0.1, works at 1.0
    (inv,), (fb,) = robust_inverses([f], 0.1, torch.float64)
    assert (fb.level, fb.damping) == ("damping", pytest.approx(1.0))
    assert "eigendecomposition failed (linalg.eigh: The algorithm failed to converge)" in fb.reason
    torch.testing.assert_close(inv, torch.linalg.inv(f + torch.eye(16, dtype=torch.float64)))


def test_hopeless_factors_get_the_scaled_identity(monkeypatch):
    bad = spectrum([1e6] * 15 + [-1e6])  # indefinite beyond any retried damping (up to 100)
    nan = CASES["rank_deficient"].clone()
    nan[3, 3] = float("nan")
    monkeypatch.setattr(torch.linalg, "eigh", lambda *a, **k: (_ for _ in ()).throw(
        torch.linalg.LinAlgError("no convergence")))
    invs, fbs = robust_inverses([bad, nan], 0.1, torch.float32)
    assert [fb.level for fb in fbs] == ["identity", "identity"]
    eye = torch.eye(16)
    torch.testing.assert_close(invs[0], eye / (float(bad.trace()) / 16 + 0.1))
    torch.testing.assert_close(invs[1], eye / 0.1)  # non-finite trace: I / damping
    assert "non-finite" in fbs[1].reason


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_zero_factor_without_damping_gets_the_identity(dtype):
    # e.g. the G factor of a layer whose outputs all got zero gradient; 1/tiny would overflow later.
    (inv,), (fb,) = robust_inverses([torch.zeros(5, 5, dtype=dtype)], 0.0, dtype)
    assert fb.level == "identity" and torch.equal(inv, torch.eye(5, dtype=dtype))


def test_tiny_factor_without_damping_stays_finite_in_float32():
    f = (rank_deficient() * 1e-36).float()  # inverse far beyond float32: eigh gives inf
    (inv,), (fb,) = robust_inverses([f], 0.0, torch.float32)
    assert fb.level in ("damping", "identity") and torch.isfinite(inv).all()


class ReplacingDistributor(Distributor):
    """Hands back the given matrices as this step's factors (factor_decay=0 makes them the running ones)."""

    def __init__(self, replace: dict):
        self.replace = replace

    def reduce_factors(self, local):
        return {key: self.replace.get(key, m) for key, m in local.items()}


def test_fallback_warns_once_per_layer_and_gradients_stay_finite():
    model = nn.Sequential(nn.Linear(15, 16), nn.Tanh(), nn.Linear(16, 16, bias=False))  # all factors 16 x 16
    bad = {0: CASES["indefinite"].float(), 1: CASES["near_singular"].float()}  # layer index -> factor
    dist = ReplacingDistributor({(i, which): f for i, f in bad.items() for which in ("A", "G")})
    # A = G: pi = 1, so each factor gets sqrt(damping) = 1e-8 (see kfac.inverse.pi_split)
    pre = KFACPreconditioner(model, damping=1e-16, factor_decay=0.0, factor_update_steps=1, inv_update_steps=1,
                             distributor=dist, lr=0.1)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(3):
            backward(model, torch.randn(4, 15), torch.randint(0, 16, (4,)))
            pre.step()
            for p in model.parameters():
                assert torch.isfinite(p.grad).all()
            for layer in pre.layers.values():
                want = ref_inverse(bad[layer.index], 1e-8)
                for inv in (layer.A_inv, layer.G_inv):
                    assert float((inv.double() - want).norm() / want.norm()) < 1e-3
    msgs = [str(r.message) for r in w if "Cholesky of the damped" in str(r.message)]
    assert pre.inverse_fallbacks == 2 * 2 * 3  # every factor, every step
    assert len(msgs) == 2, msgs  # once per layer, not per factor or step
    assert "layer '0'" in msgs[0] and "step 0" in msgs[0] and "not positive definite" in msgs[0]
    assert "layer '2'" in msgs[1] and "too ill-conditioned for a torch.float32 Cholesky" in msgs[1]


def test_fallback_warning_names_layer_factor_step_and_damping():
    model = nn.Sequential(nn.Linear(15, 16))
    pre = KFACPreconditioner(model, damping=1e-8, factor_update_steps=1, inv_update_steps=1, lr=0.1)
    layer = pre.layers["0"]
    layer.A, layer.G = CASES["indefinite"].float(), torch.eye(16)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        pre.inverter.update(5)
        pre.inverter.update(6)
    msgs = [str(r.message) for r in w]
    assert len(msgs) == 1 and pre.inverse_fallbacks == 2
    assert "layer '0'" in msgs[0] and "A factor" in msgs[0] and "step 5" in msgs[0] and "damping 1e-08" in msgs[0]
    assert "clamped eigendecomposition" in msgs[0]


# --------------------------------------------------------------------------- the callback
def test_callback_logs_the_counters_and_passes_max_bad_steps(tmp_path):
    import pytorch_lightning as pl
    from pytorch_lightning.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_spdkfac import KFAC

    class Tiny(pl.LightningModule):
        def __init__(self, bad_steps):
            super().__init__()
            self.net = mlp()
            self.bad_steps = bad_steps

        def on_train_start(self):  # after KFAC registered its hooks, so that ours can wrap its G hook
            self.poison = Poison(self.net[0], "factor_only")  # gradients stay finite: SGD trains on

        def training_step(self, batch, _):
            self.poison.on = self.trainer.global_step in self.bad_steps
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            x, y = zip(*batches(6, n=4))
            return DataLoader(TensorDataset(torch.cat(x), torch.cat(y)), batch_size=4)

    def fit(bad_steps, **kw):
        t = pl.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=CSVLogger(tmp_path), log_every_n_steps=1,
                       enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                       callbacks=[KFAC(**kw)])
        t.fit(Tiny(bad_steps))
        return t

    # damping 0 on 4-row batches: A (7 x 7) is rank-deficient, so inversions fall back too.
    with pytest.warns(UserWarning, match="Cholesky of the damped"):
        t = fit({2}, damping=0.0, factor_update_steps=1, inv_update_steps=2)
    with open(f"{t.logger.log_dir}/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("kfac/skipped_factor_steps")]
    assert [float(r["kfac/skipped_factor_steps"]) for r in rows] == [0, 0, 1, 1, 1, 1]
    assert [float(r["kfac/skipped_precondition_steps"]) for r in rows] == [0] * 6
    fallbacks = [float(r["kfac/inverse_fallbacks"]) for r in rows]
    assert fallbacks[0] >= 1 and fallbacks == sorted(fallbacks)
    assert all(torch.isfinite(p.detach()).all() for p in t.lightning_module.parameters())

    with pytest.raises(RuntimeError, match=r"2 consecutive factor steps.*at step 2: layer 'net\.0': output gradients "
                                           r"\(G factor\)\. Training"):
        fit({1, 2, 3}, max_bad_steps=2, factor_update_steps=1, inv_update_steps=10)
    with pytest.raises(ValueError, match="max_bad_steps must be"):
        KFAC(max_bad_steps=0)


def test_decayed_factor_entries_are_flushed_before_they_turn_subnormal():
    """A unit that stops firing leaves its factor entries decaying by factor_decay every step; below
    the smallest normal float they would become subnormal (slow on CPUs, see benchmarks/soak.py). The
    running factors hold zeros there instead, and everything else is the plain running average."""
    torch.manual_seed(0)
    layer = nn.Linear(3, 2, bias=False)
    pre = KFACPreconditioner(layer, factor_decay=0.5, kl_clip=None, factor_update_steps=1, inv_update_steps=1)
    tiny = torch.finfo(torch.float32).tiny
    x = torch.randn(4, 3)
    layer(x).sum().backward()
    pre.step()
    kfl = next(iter(pre.layers.values()))
    A_before = kfl.A.clone()
    kfl.A[0, 1] = kfl.A[1, 0] = 1.5 * tiny  # about to decay below tiny
    kfl.A[0, 2] = kfl.A[2, 0] = 1.0  # a normal entry
    a_start = kfl.A.clone()
    x2 = x.clone()
    x2[:, 0] = 0.0  # input 0 stops firing: rows/cols 0 of the step's A are zero
    layer.zero_grad()
    layer(x2).sum().backward()
    pre.step()
    step_a = x2.T @ x2 / 4
    expected = 0.5 * a_start + 0.5 * step_a
    assert 0 < expected[0, 1].abs() < tiny  # what the plain average would hold: a subnormal
    assert kfl.A[0, 1] == 0.0 and kfl.A[1, 0] == 0.0
    mask = expected.abs() >= tiny
    torch.testing.assert_close(kfl.A[mask], expected[mask], rtol=1e-6, atol=0.0)
    assert not torch.equal(A_before, kfl.A)


def test_inverses_hold_no_subnormal_entries():
    """An inverse whose exact entries fall below the smallest normal float gets zeros there (the
    preconditioning matmuls would otherwise run on subnormals every step until the next inversion)."""
    from lightning_spdkfac.kfac.inverse import robust_inverses

    tiny = torch.finfo(torch.float32).tiny
    # [[1, e], [e, 1]]^-1 = [[1, -e], [-e, 1]] / (1 - e^2): off-diagonal -e, subnormal for e = tiny / 4
    e = tiny / 4
    f = torch.tensor([[1.0, e], [e, 1.0]], dtype=torch.float32)
    assert 0 < f[0, 1] < tiny
    (inv,), fallbacks = robust_inverses([f], 0.0, torch.float32)
    assert fallbacks == []
    assert inv[0, 1] == 0.0 and inv[1, 0] == 0.0
    torch.testing.assert_close(inv.diagonal(), torch.ones(2))
