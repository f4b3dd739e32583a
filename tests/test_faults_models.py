"""Unusual models under K-FAC: layers that never run, run twice, change input shape, sit under
torch.compile or activation checkpointing, or are frozen mid-training.

Each case either works, checked against an independent reference, or would be skipped with one
warning; none crashes. What the preconditioner does:
- a registered layer that never runs gets no factors and its gradient is left untouched;
- a layer called several times per forward (shared weights) accumulates every call: A is the mean
  over the rows of all calls, G counts the examples once per forward (docs/math.md);
- input shapes may change between steps (sequence length, image size, batch size): only the
  number of rows changes, the factors keep their size;
- under torch.compile the hooks run outside the compiled graph (``torch.compiler.disable``: a graph
  break at each K-FAC layer), so the model trains exactly as in eager mode;
- activation checkpointing: the forward that checkpointing re-runs during backward is recognised
  (it runs inside autograd's backward pass) and not counted again; the reentrant variant, whose
  first forward runs without grad, is counted once, at the recomputation;
- a layer whose parameters stop requiring grad is neither collected nor preconditioned (its gradient
  is left as it is) until they require grad again; no warning, freezing is deliberate.

References are dense float64 computations from the layer inputs and output gradients captured with
the test's own hooks (tests/helpers/dense_reference.py's Recorder), or a second run that must agree
(the same model without torch.compile / without checkpointing / never frozen).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import types
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers.checkpointed import Checkpointed
from helpers.dense_reference import Recorder, a_rows, assert_close, d_rows, damped_invs, grad_matrix
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_spdkfac import KFACPreconditioner
from lightning_spdkfac.comm.scheduler import SPDDistributor, SPDOptions
from lightning_spdkfac.multiprocess import run_distributed

DAMPING = 0.05


class Reference:
    """Running factors and preconditioned gradients computed densely (float64) from captured calls."""

    def __init__(self, decay: float, damping: float = DAMPING):
        self.decay, self.damping = decay, damping
        self.A: dict[str, torch.Tensor] = {}
        self.G: dict[str, torch.Tensor] = {}

    def update(self, rec: Recorder, name: str, examples: int) -> None:
        m = rec.modules[name]
        a = torch.cat([a_rows(m, x) for x in rec.inputs[name]])
        d = torch.cat([d_rows(m, g) for g in rec.gouts[name]])
        A_new, G_new = a.T @ a / a.shape[0], examples * (d.T @ d)
        if name not in self.A:
            self.A[name], self.G[name] = A_new, G_new
        else:
            self.A[name] = self.decay * self.A[name] + (1 - self.decay) * A_new
            self.G[name] = self.decay * self.G[name] + (1 - self.decay) * G_new

    def precondition(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        A_inv, G_inv = damped_invs(self.A[name], self.G[name], self.damping)
        return G_inv @ grad @ A_inv

    def check(self, pre: KFACPreconditioner, rec: Recorder, name: str, raw_grad: torch.Tensor, tol=2e-4) -> None:
        """pre's factors of ``name`` and its preconditioned gradient (kl_clip=None) equal the reference."""
        layer = pre.layers[name]
        assert_close(layer.A, self.A[name], tol)
        assert_close(layer.G, self.G[name], tol)
        assert_close(grad_matrix(rec.modules[name]), self.precondition(name, raw_grad), tol)


def kfac(model, decay=0.5, **kw):
    # Factors and inverses every step, expand rows for Conv2d: what Reference computes (not the
    # defaults, which update factors every 5 steps and use reduce rows for Conv2d).
    return KFACPreconditioner(model, factor_decay=decay, damping=DAMPING, kl_clip=None, factor_update_steps=1,
                              inv_update_steps=1, factor_approx="expand", **kw)


# --------------------------------------------------------------------------- never runs
class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(6, 5)
        self.branch = nn.Linear(5, 5)  # only used when use_branch
        self.head = nn.Linear(5, 3)
        self.use_branch = False

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        if self.use_branch:
            h = torch.tanh(self.branch(h))
        return self.head(h)


def test_registered_layer_that_never_runs():
    model = Branchy()
    pre = kfac(model)
    assert "branch" in pre.layers
    rec = Recorder(model, ["trunk", "head"])
    ref = Reference(0.5)
    g = torch.Generator().manual_seed(1)
    stale = torch.full_like(model.branch.weight, 3.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about
        for step in range(3):
            model.zero_grad(set_to_none=True)
            rec.clear()
            model(torch.randn(8, 6, generator=g)).pow(2).mean().backward()
            raw = {n: grad_matrix(rec.modules[n]) for n in ("trunk", "head")}
            if step == 2:
                model.branch.weight.grad = stale.clone()  # e.g. left over from an earlier step
            pre.step()
            for name in ("trunk", "head"):
                ref.update(rec, name, 8)
                ref.check(pre, rec, name, raw[name])
    branch = pre.layers["branch"]
    assert branch.A is None and branch.G is None and branch.A_inv is None
    assert torch.equal(model.branch.weight.grad, stale) and model.branch.bias.grad is None  # untouched
    state = pre.state_dict()
    assert "branch" not in state["layers"] and state["layer_dims"]["branch"] == [6, 5]
    # the branch runs from now on: it gets factors and is preconditioned like any layer
    model.use_branch = True
    rec.remove()
    rec = Recorder(model, ["branch"])
    model.zero_grad(set_to_none=True)
    model(torch.randn(8, 6, generator=g)).pow(2).mean().backward()
    raw = grad_matrix(model.branch)
    pre.step()
    ref.update(rec, "branch", 8)
    ref.check(pre, rec, "branch", raw)


# --------------------------------------------------------------------------- called twice
class Shared(nn.Module):
    """One Linear applied twice per forward, and one Conv2d applied to two image sizes."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, 5)
        self.shared = nn.Linear(5, 5)
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.head = nn.Linear(5 + 3, 3)

    def forward(self, x, img):
        h = self.shared(torch.tanh(self.inp(x)))
        h = self.shared(torch.tanh(h))  # second call, other input
        big = self.conv(img).mean(dim=(2, 3))
        small = self.conv(img[:, :, 1:-1, 1:-1]).mean(dim=(2, 3))  # second call, 6x6 instead of 8x8
        return self.head(torch.cat([torch.tanh(h), big * small], dim=1))


def test_layer_called_twice_per_forward_accumulates_both_calls():
    model = Shared()
    pre = kfac(model)
    names = ["shared", "conv", "head"]
    rec = Recorder(model, names)
    ref = Reference(0.5)
    g = torch.Generator().manual_seed(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for micro_batches in (1, 2, 1):  # the second step accumulates two micro-batches of 8
            model.zero_grad(set_to_none=True)
            rec.clear()
            for _ in range(micro_batches):
                x, img = torch.randn(8, 6, generator=g), torch.randn(8, 2, 8, 8, generator=g)
                (model(x, img).pow(2).mean() / micro_batches).backward()
            assert len(rec.inputs["shared"]) == len(rec.inputs["conv"]) == 2 * micro_batches
            raw = {n: grad_matrix(rec.modules[n]) for n in names}
            pre.step()
            for name in names:
                # A: mean over the rows of every call; G: the examples counted once per forward
                ref.update(rec, name, 8 * micro_batches)
                ref.check(pre, rec, name, raw[name])
    assert pre.layers["shared"].calls_per_micro_batch == pre.layers["conv"].calls_per_micro_batch == 2
    assert pre.layers["head"].calls_per_micro_batch == 1


# --------------------------------------------------------------------------- shapes change
class SeqAndImage(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Linear(4, 6)  # on (B, T, 4): T changes between steps
        self.conv = nn.Conv2d(1, 4, 3, stride=2, padding=1)  # on (B, 1, H, W): H, W change
        self.head = nn.Linear(6 + 4, 2)

    def forward(self, seq, img):
        s = torch.tanh(self.tok(seq)).mean(dim=1)
        c = torch.tanh(self.conv(img)).mean(dim=(2, 3))
        return self.head(torch.cat([s, c], dim=1))


def test_input_shapes_change_between_steps():
    model = SeqAndImage()
    pre = kfac(model)
    names = ["tok", "conv", "head"]
    rec = Recorder(model, names)
    ref = Reference(0.5)
    g = torch.Generator().manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for B, T, H, W in ((4, 5, 8, 8), (6, 3, 6, 10), (2, 7, 11, 5), (5, 1, 3, 3)):
            model.zero_grad(set_to_none=True)
            rec.clear()
            seq, img = torch.randn(B, T, 4, generator=g), torch.randn(B, 1, H, W, generator=g)
            model(seq, img).pow(2).mean().backward()
            raw = {n: grad_matrix(rec.modules[n]) for n in names}
            pre.step()
            for name in names:
                ref.update(rec, name, B * T if name == "tok" else B)  # a sequence's positions are examples
                ref.check(pre, rec, name, raw[name])
    assert pre.layers["tok"].A.shape == (5, 5) and pre.layers["conv"].A.shape == (10, 10)


# --------------------------------------------------------------------------- torch.compile
def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def train_pair(compiled_fn, steps=4, batch=16):
    """The same training eager and compiled; (eager model, eager pre, compiled-side model, its pre)."""
    eager, other = mlp(), mlp()
    pe = kfac(eager, lr=0.1)
    compiled = compiled_fn(other)
    # K-FAC on the compiled module itself: its layers are "_orig_mod.0", ...
    pc = kfac(compiled, lr=0.1)
    assert list(pc.layers) == [f"_orig_mod.{n}" for n in pe.layers]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (eager, other)]
    g = torch.Generator().manual_seed(4)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(steps):
            x, y = torch.randn(batch, 6, generator=g), torch.randint(0, 3, (batch,), generator=g)
            for model, pre, opt in ((eager, pe, opts[0]), (compiled, pc, opts[1])):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                pre.step()
                opt.step()
    assert not [str(w.message) for w in record if "K-FAC" in str(w.message)]
    return eager, pe, other, pc


def assert_pair(eager, pe, other, pc, rtol, atol):
    for (n, le), lc in zip(pe.layers.items(), pc.layers.values()):
        assert lc.A is not None, f"{n}: no factors under torch.compile"
        torch.testing.assert_close(lc.A, le.A, rtol=rtol, atol=atol)
        torch.testing.assert_close(lc.G, le.G, rtol=rtol, atol=atol)
    for a, b in zip(eager.parameters(), other.parameters()):
        torch.testing.assert_close(b.detach(), a.detach(), rtol=rtol, atol=atol)


def test_torch_compile_aot_eager_trains_like_eager():
    # aot_eager: dynamo graphs + AOTAutograd, eager kernels, so the numbers are comparable bitwise.
    torch._dynamo.reset()
    eager, pe, other, pc = train_pair(lambda m: torch.compile(m, backend="aot_eager"))
    assert pc.steps == 4
    assert_pair(eager, pe, other, pc, rtol=0, atol=1e-6)


def _kfac_code_objects() -> list[types.CodeType]:
    """Every function's code in the preconditioner module and the factor statistics' (the hooks' part), nested
    functions (the hooks) included."""
    import lightning_spdkfac.kfac.factor_updates as stats
    import lightning_spdkfac.kfac.preconditioner as mod

    out = []
    for owner in (mod, mod.KFACPreconditioner, mod.KFACLayer, stats, stats.FactorStatistics):
        for value in vars(owner).values():
            fn = getattr(value, "fget", getattr(value, "__func__", value))
            code = getattr(fn, "__code__", None)
            if code is None or getattr(fn, "__module__", None) not in (mod.__name__, stats.__name__):
                continue
            stack = [code]
            while stack:
                code = stack.pop()
                out.append(code)
                stack += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return out


def test_torch_compile_runs_the_hooks_untraced():
    # Dynamo must not trace K-FAC's hooks: they mutate per-layer Python state and persistent buffers,
    # which compiled code would guard on and replay. A code object dynamo compiled has cache entries.
    cache_entries = pytest.importorskip("torch._dynamo.eval_frame")._debug_get_cache_entry_list
    torch._dynamo.reset()
    model = mlp()
    pre = kfac(model)
    compiled = torch.compile(model, backend="aot_eager")
    for _ in range(2):
        model.zero_grad()
        compiled(torch.randn(4, 6)).pow(2).mean().backward()
        pre.step()
    assert pre.layers["0"].A is not None
    codes = _kfac_code_objects()
    assert {"forward_hook", "grad_hook", "_accumulate_a", "_accumulate_g"} <= {c.co_name for c in codes}
    assert [c.co_name for c in codes if cache_entries(c)] == []


@pytest.mark.slow
def test_torch_compile_inductor_trains_like_eager():
    # inductor compiles C++ kernels with the machine's compiler (~20 s cold); fused kernels round
    # differently, hence the tolerance.
    if not any(shutil.which(c) for c in (os.environ.get("CXX") or "g++", "g++", "c++", "clang++")):
        pytest.skip("torch.compile's inductor backend needs a C++ compiler on CPU (none found)")
    torch._dynamo.reset()
    eager, pe, other, pc = train_pair(lambda m: torch.compile(m))
    assert_pair(eager, pe, other, pc, rtol=1e-4, atol=1e-5)


def test_compiled_block_inside_an_eager_model():
    torch._dynamo.reset()

    class Model(nn.Module):
        def __init__(self, compile_block):
            super().__init__()
            torch.manual_seed(0)
            self.stem = nn.Linear(6, 8)
            block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
            self.block = torch.compile(block, backend="aot_eager") if compile_block else block
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            return self.head(torch.tanh(self.block(torch.tanh(self.stem(x)))))

    runs = []
    for compile_block in (False, True):
        model = Model(compile_block)
        pre = kfac(model)
        g = torch.Generator().manual_seed(5)
        for _ in range(3):
            model.zero_grad()
            model(torch.randn(8, 6, generator=g)).pow(2).mean().backward()
            pre.step()
        runs.append((pre, [p.grad.clone() for p in model.parameters()]))
    (pe, ge), (pc, gc) = runs
    assert [n.replace("._orig_mod", "") for n in pc.layers] == list(pe.layers)
    for le, lc in zip(pe.layers.values(), pc.layers.values()):
        torch.testing.assert_close(lc.A, le.A, rtol=0, atol=1e-6)
        torch.testing.assert_close(lc.G, le.G, rtol=0, atol=1e-6)
    for a, b in zip(ge, gc):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


# --------------------------------------------------------------------------- activation checkpointing
def train_checkpointed(mode, steps=3, micro_batches=2):
    model = Checkpointed(mode)
    pre = KFACPreconditioner(model, factor_decay=0.5, damping=DAMPING, factor_update_steps=1, inv_update_steps=1,
                             lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "2 forward call(s) but 1 backward call(s)" must not happen
        for _ in range(steps):
            opt.zero_grad()
            for _ in range(micro_batches):
                x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
                (F.cross_entropy(model(x), y) / micro_batches).backward()
            pre.step()
            opt.step()
    return model, pre


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_counts_each_call_once(use_reentrant):
    plain, p_plain = train_checkpointed(None)
    ckpt, p_ckpt = train_checkpointed(use_reentrant)
    for name, lp in p_plain.layers.items():
        lc = p_ckpt.layers[name]
        torch.testing.assert_close(lc.A, lp.A, rtol=0, atol=1e-6)
        torch.testing.assert_close(lc.G, lp.G, rtol=0, atol=1e-6)
        # the pipelining call count (calls per micro-batch) is not confused by the recomputation
        assert lc.calls_per_micro_batch == lp.calls_per_micro_batch == (2 if name == "block.b" else 1)
    for a, b in zip(plain.parameters(), ckpt.parameters()):
        torch.testing.assert_close(b.detach(), a.detach(), rtol=0, atol=1e-6)
    assert p_ckpt.skipped_factor_steps == 0 and p_ckpt.steps == 3


def _checkpointed_on_ranks(rank, world):
    """Per rank: the plain and the non-reentrant checkpointed model under DDP + pipelined SPD-KFAC."""
    torch.set_num_threads(1)
    out = {}
    for mode in (None, False):
        model = Checkpointed(mode)
        ddp = DDP(model)
        distributor = SPDDistributor(SPDOptions.from_schedule("spd", profile_steps=(1, 2)),
                                     process_group=dist.new_group())
        pre = KFACPreconditioner(model, distributor=distributor, factor_decay=0.5, damping=DAMPING,
                                 factor_update_steps=1, inv_update_steps=1, lr=0.1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(10 + rank)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(5):  # steps 0-2 profile (factors held to step()), steps 3-4 pipelined
                opt.zero_grad()
                for mb in range(2):
                    pre.final_micro_batch = mb == 1
                    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
                    ctx = ddp.no_sync() if mb == 0 else contextlib.nullcontext()
                    with ctx:
                        (F.cross_entropy(ddp(x), y) / 2).backward()
                pre.step()
                opt.step()
        assert distributor.pipelined
        out[mode] = ({n: (ly.A.clone(), ly.G.clone()) for n, ly in pre.layers.items()},
                     [p.detach().clone() for p in model.parameters()])
    return out


def test_activation_checkpointing_with_pipelined_spd_on_two_ranks():
    runs = run_distributed(_checkpointed_on_ranks, 2, timeout=120)
    for out in runs:
        (plain_f, plain_p), (ckpt_f, ckpt_p) = out[None], out[False]
        for name, (A, G) in plain_f.items():
            torch.testing.assert_close(ckpt_f[name][0], A, rtol=0, atol=1e-6)
            torch.testing.assert_close(ckpt_f[name][1], G, rtol=0, atol=1e-6)
        for a, b in zip(plain_p, ckpt_p):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    for a, b in zip(runs[0][False][1], runs[1][False][1]):
        assert torch.equal(a, b)  # the replicas agree


# --------------------------------------------------------------------------- frozen mid-training
def three_layers():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def test_layer_frozen_mid_training_then_unfrozen():
    """'2' is frozen for steps 3-5 and unfrozen from step 6. The twin run never freezes it; in both
    runs '2' has learning rate 0, so its weights, hence every activation and output gradient, are the
    same in both runs, and with kl_clip=None the other layers must match the twin bitwise."""
    frozen, twin = three_layers(), three_layers()
    pf, pt = kfac(frozen, lr=0.1), kfac(twin, lr=0.1)
    opts = []
    for m in (frozen, twin):
        mid = list(m[2].parameters())
        rest = [p for i in (0, 4) for p in m[i].parameters()]
        opts.append(torch.optim.SGD([{"params": rest}, {"params": mid, "lr": 0.0}], lr=0.1, momentum=0.9))
    rec = Recorder(frozen, ["2"])
    ref = Reference(0.5)
    g = torch.Generator().manual_seed(7)
    marker = torch.full_like(frozen[2].weight, 7.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # freezing is deliberate: no warning
        for step in range(8):
            if step == 3:
                frozen[2].requires_grad_(False)
                saved = [t.clone() for t in (pf.layers["2"].A, pf.layers["2"].G, pf.layers["2"].A_inv)]
            if step == 6:
                frozen[2].requires_grad_(True)
            x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
            for model, pre, opt in ((frozen, pf, opts[0]), (twin, pt, opts[1])):
                opt.zero_grad(set_to_none=True)
                rec.clear()
                F.cross_entropy(model(x), y).backward()
                if model is frozen and 3 <= step < 6:
                    assert frozen[2].weight.grad is None
                    if step == 4:  # a stale gradient on a frozen layer stays as it is
                        frozen[2].weight.grad = marker.clone()
                raw = grad_matrix(frozen[2]) if model is frozen and frozen[2].weight.requires_grad else None
                pre.step()
                if model is frozen and step == 4:
                    assert torch.equal(frozen[2].weight.grad, marker)
                    frozen[2].weight.grad = None
                if model is frozen and (step < 3 or step >= 6):
                    ref.update(rec, "2", 8)  # factors of '2' only from the steps it was trainable
                    ref.check(pf, rec, "2", raw)
                opt.step()
            if 3 <= step < 6:  # frozen: not collected, not inverted again
                ly = pf.layers["2"]
                assert all(torch.equal(a, b) for a, b in zip((ly.A, ly.G, ly.A_inv), saved))
            for i in (0, 4):
                for a, b in zip(frozen[i].parameters(), twin[i].parameters()):
                    assert torch.equal(a, b), f"layer {i} differs from the twin at step {step}"
                assert torch.equal(pf.layers[str(i)].A, pt.layers[str(i)].A)
    assert torch.equal(frozen[2].weight, twin[2].weight)  # lr 0 in both: the premise of the comparison
    assert not torch.equal(pf.layers["2"].A, saved[0])  # unfrozen: collected again


def test_frozen_before_the_preconditioner_is_built_is_left_alone_not_crashed():
    """Not registered while frozen (registered once it trains: test_layer_setups.py), and nothing is collected."""
    model = three_layers()
    model[2].requires_grad_(False)
    pre = kfac(model)
    assert "2" not in pre.layers and "2" in pre.frozen_layers and "2" not in pre.skipped
    model(torch.randn(4, 6)).pow(2).mean().backward()
    pre.step()
    assert model[2].weight.grad is None and "2" not in pre.layers and pre.layers["0"].A is not None

