"""The K-FAC summary's peak (issue 35, Deliver 5): what an inverse step holds at its most, measured deterministically
and compared with what the summary computes from the layouts before anything is allocated.

The measure (tests/helpers/alloc_tracker.py) counts the bytes of live tensor storages at the dispatcher, from the
tensors K-FAC holds when the step starts (adopted: counted, freed when they die) through every storage the step
creates, with LAPACK's eigendecomposition work arrays added from LAPACK's formula: no RSS, no timing. The references
are the tensors themselves (their sizes), never the code under test.

What the design promises (kfac/summary.py, docs/guide/summary-memory.md): the new inverses are written into the
held ones (no second set), equal-shaped factors are stacked in bounded chunks, a layer's P goes to its gradient at
once, so on a model of many layers the peak is within 10% of the steady state. It cannot be where one factor is
large next to the rest: its eigendecomposition (the stacked copy, the eigenvectors and LAPACK's 2n^2 work array) or
its Cholesky (two copies) is then a large share of what is held; those are stated, not promised.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
from torch import nn

from lightning_spdkfac.factor_shapes import inverse_shape
from lightning_spdkfac.kfac import distributor as dist
from lightning_spdkfac.kfac.inverse import robust_eigens, robust_inverses
from lightning_spdkfac.kfac.inverse_memory import inversion_workspace
from lightning_spdkfac.kfac.preconditioner import KFACPreconditioner
from lightning_spdkfac.kfac.summary import format_bytes
from tests.helpers.alloc_tracker import AllocTracker

# --------------------------------------------------------------------------------------------- models


def mlp() -> nn.Module:
    """An MLP with biases: its middle layer's factors (129 x 129, 128 x 128) are a third of what is held."""
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


def conv() -> nn.Module:
    """A convolution, a grouped one and a wide head (its A, 1025 x 1025, dominates)."""
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1, groups=4),
                         nn.Flatten(), nn.Linear(16 * 8 * 8, 10))


def equal_layers(bias: bool = False) -> nn.Module:
    """Sixteen equal-shaped layers: their factors are inverted as stacks of one shape (batched)."""
    return nn.Sequential(*[nn.Linear(64, 64, bias=bias) for _ in range(16)])


def one_big_factor() -> nn.Module:
    """One 257 x 257 A next to a tiny G: its eigendecomposition's workspace dominates what is held."""
    return nn.Linear(256, 4)


def token_lm() -> nn.Module:
    """An embedding (its A diagonal) and a head whose G is diagonal (max_factor_side=500): their P, vocabulary x
    width, are larger than their factors."""
    return nn.Sequential(nn.Embedding(1000, 32), nn.Linear(32, 1000))


INPUTS: dict[Callable[..., nn.Module], Callable[[], torch.Tensor]] = {
    mlp: lambda: torch.randn(32, 64),
    conv: lambda: torch.randn(4, 3, 8, 8),
    equal_layers: lambda: torch.randn(32, 64),
    one_big_factor: lambda: torch.randn(32, 256),
    token_lm: lambda: torch.randint(0, 1000, (4, 16)),
}


# --------------------------------------------------------------------------------------------- measure

def held_tensors(pre: KFACPreconditioner) -> list[torch.Tensor]:
    """Every tensor of K-FAC state held between steps: factors, accumulators, inverses, grafting moments and the
    inverses in flight (async_inverses; waited for, so that the measure does not depend on the worker's pace)."""
    out = [t for ly in pre.layers.values() for t in (ly.A, ly.G, ly.A_inv, ly.G_inv, ly.xx, ly.dd, ly.x_sum)
           if t is not None]
    out += [st.v for st in pre.preconditioning.graft_states.values() if st.v is not None]
    if pre.inverter.in_flight is not None:
        out += [inv for _, _, inv in pre.inverter.in_flight.pending.wait()]
    return out


def nbytes(tensors: list[torch.Tensor]) -> int:
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


@pytest.fixture
def tracked_workers(monkeypatch: pytest.MonkeyPatch):
    """The asynchronous inverses' worker tracked by the tracker of the step (a dispatch mode is per thread), and
    waited for where it is launched, so that the step's order is deterministic: the inversions, then the
    preconditioning (the summary counts them overlapped: its peak is then an upper bound)."""
    current: list[AllocTracker] = []
    real_work = dist.PendingInverses._work

    def work(self, run):  # type: ignore[no-untyped-def]
        if not current:  # (the steps before the measured one)
            real_work(self, run)
            return
        with current[0].on_this_thread():
            real_work(self, run)

    monkeypatch.setattr(dist.PendingInverses, "_work", work)
    real_async = dist.Distributor.invert_async

    def invert_async(self, tasks, invert_fn):  # type: ignore[no-untyped-def]
        pending = real_async(self, tasks, invert_fn)
        pending.wait()
        return pending

    monkeypatch.setattr(dist.Distributor, "invert_async", invert_async)
    return current


def measure(model: nn.Module, x: torch.Tensor, steps: int = 3, workers: list[AllocTracker] | None = None,
            **options: object) -> tuple[KFACPreconditioner, int, int]:
    """(the preconditioner, bytes held before the last step, the peak during it): every step an inverse step."""
    torch.manual_seed(0)
    pre = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1, lr=0.1, **options)  # type: ignore[arg-type]
    for i in range(steps):
        model.zero_grad()
        model(x).square().sum().backward()
        if i < steps - 1:
            pre.step()
            continue
        tracker = AllocTracker()
        if workers is not None:
            workers[:] = [tracker]
        tracker.adopt(held_tensors(pre))
        before = tracker.live
        with tracker:
            pre.step()
        return pre, before, tracker.peak
    raise AssertionError("unreachable")


def within(a: float, b: float, share: float = 0.10) -> bool:
    return abs(a - b) <= share * b


# --------------------------------------------------------------------------------------------- the peak

CASES = [(mlp, {}), (mlp, {"inverse_method": "eigen"}), (conv, {}), (conv, {"inverse_method": "eigen"}),
         (conv, {"max_factor_side": 100}), (equal_layers, {}), (equal_layers, {"inverse_method": "eigen"}),
         (one_big_factor, {"inverse_method": "eigen"}), (mlp, {"grafting": "sgd"}), (mlp, {"grafting": "adam"}),
         (mlp, {"inv_dtype": "float64"}), (token_lm, {"max_factor_side": 500}),
         (token_lm, {"max_factor_side": 500, "inverse_method": "eigen"})]


@pytest.mark.parametrize(("make", "options"), CASES, ids=lambda v: getattr(v, "__name__", None) or str(v))
def test_measured_peak_is_within_10_percent_of_the_summary(make, options) -> None:
    torch.manual_seed(0)
    model = make()
    pre, before, peak = measure(model, INPUTS[make](), **options)
    s = pre.summary()
    assert s.steady_bytes == before, (s.steady_bytes, before)  # the steady state: exactly what is held
    assert within(s.peak_bytes, peak), (s.peak_bytes, peak, s.workspace)
    assert f"{format_bytes(s.peak_bytes)} at the peak of an inverse step" in str(s)


@pytest.mark.parametrize("method", ["cholesky", "eigen"])
@pytest.mark.parametrize("async_inverses", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_many_equal_layers_peak_within_10_percent_of_the_steady_state(tracked_workers, method, async_inverses,
                                                                       bias) -> None:
    """Batched stacks of one shape, async on and off: what the design promises (the module docstring)."""
    torch.manual_seed(0)
    pre, before, peak = measure(equal_layers(bias), torch.randn(32, 64), workers=tracked_workers,
                                inverse_method=method, async_inverses=async_inverses)
    s = pre.summary()
    assert s.steady_bytes == before
    assert within(s.peak_bytes, peak), (s.peak_bytes, peak, s.workspace)
    assert peak <= s.peak_bytes * 1.01  # overlapped (async) the summary is an upper bound
    assert s.peak_bytes <= 1.10 * s.steady_bytes, (s.peak_bytes, s.steady_bytes, s.workspace)
    # No second set of inverses beside the held one: the old and new together would be this much more (async:
    # the in-flight set is held already, in the steady state).
    inverses = nbytes([t for ly in pre.layers.values() for t in (ly.A_inv, ly.G_inv) if t is not None])
    assert peak < before + inverses


def test_one_large_factor_cannot_stay_within_10_percent_and_the_summary_says_so() -> None:
    """A 257 x 257 A beside a 4 x 4 G: its eigendecomposition works on the stacked copy, the eigenvectors and LAPACK's
    2n^2 work array, each about as large as everything held; the summary states that peak."""
    pre, before, peak = measure(one_big_factor(), torch.randn(32, 256), inverse_method="eigen")
    s = pre.summary()
    n2 = 257 * 257 * 4
    assert peak >= before + 3 * n2  # the copy, the eigenvectors, the work array (about 2 n^2)
    assert within(s.peak_bytes, peak) and s.peak_bytes > 1.5 * s.steady_bytes


def test_the_double_buffer_is_gone_where_it_was(monkeypatch) -> None:
    """Before issue 35 the new inverses were made beside the old ones (a second set): the peak was at least the held
    state plus one set of inverses. Now the synchronous path writes into the held tensors (the same objects)."""
    torch.manual_seed(0)
    model = equal_layers()
    pre, before, peak = measure(model, torch.randn(32, 64), steps=2)
    held = {ly.name: (ly.A_inv, ly.G_inv) for ly in pre.layers.values()}
    model.zero_grad()
    model(torch.randn(32, 64)).square().sum().backward()
    pre.step()
    assert all(ly.A_inv is held[ly.name][0] and ly.G_inv is held[ly.name][1] for ly in pre.layers.values())
    inverses = nbytes([t for pair in held.values() for t in pair])
    assert peak < before + inverses / 4


# --------------------------------------------------------------------------------------------- the pieces

def _spd(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if len(shape) == 1:
        return torch.rand(shape, generator=g)
    n = shape[-1]
    x = torch.randn(*shape[:-2], 3 * n, n, generator=g)
    return x.mT @ x / (3 * n)


@pytest.mark.parametrize("method", ["cholesky", "eigen"])
@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("shapes", [[(64, 64)] * 8 + [(33, 33)] * 2, [(128, 128), (10, 10)], [(4, 16, 16)] * 3,
                                    [(300,)] * 4 + [(8, 8)], [(256, 256)]], ids=str)
def test_inversion_workspace_is_what_an_inversion_allocates(method, in_place, shapes) -> None:
    from lightning_spdkfac.kfac.inverse_memory import stack_budget

    factors = [_spd(s, i) for i, s in enumerate(shapes)]
    held = [torch.zeros(inverse_shape(s, method)) for s in shapes] if in_place else None
    budget = stack_budget([f.numel() * 4 for f in factors])
    tracker = AllocTracker()
    with tracker:
        if method == "cholesky":
            out, _ = robust_inverses(factors, 0.01, torch.float32, out=held, stack_bytes=budget)
        else:
            out, _ = robust_eigens(factors, torch.float32, out=held, stack_bytes=budget)
    est = inversion_workspace(shapes, method, torch.float32, in_place=in_place)
    assert within(est, tracker.peak, 0.05), (est, tracker.peak)
    if held is not None:
        assert all(o is h for o, h in zip(out, held))


@pytest.mark.parametrize("method", ["cholesky", "eigen"])
def test_writing_into_the_held_inverses_is_bitwise_the_new_ones(method) -> None:
    shapes = [(64, 64)] * 5 + [(4, 16, 16)] * 2 + [(300,)] + [(33, 33)]
    factors = [_spd(s, i) for i, s in enumerate(shapes)]
    fn = robust_inverses if method == "cholesky" else (lambda fs, d, dt, **kw: robust_eigens(fs, dt, **kw))
    fresh, _ = fn(factors, 0.01, torch.float32)
    held = [torch.full(inverse_shape(s, method), 7.0) for s in shapes]
    written, _ = fn(factors, 0.01, torch.float32, out=held, stack_bytes=64 * 64 * 4)
    assert all(w is h for w, h in zip(written, held))
    assert all(torch.equal(a, b) for a, b in zip(written, fresh))


@pytest.mark.parametrize("kl_clip", [None, 0.001])
@pytest.mark.parametrize("method", ["cholesky", "eigen"])
@pytest.mark.parametrize("make", [mlp, equal_layers, conv, token_lm], ids=lambda f: f.__name__)
def test_p_written_through_is_bitwise_the_p_kept_to_the_end(monkeypatch, kl_clip, method, make) -> None:
    """A layer's P written to its gradient at once, then scaled in place by the KL clip: the same gradients, bitwise,
    as P kept to the end of the step and written with its scale (with and without a bias, a convolution in
    channels_last, a diagonal A and G)."""
    def run(through: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = make()
        if make is conv:
            model = model.to(memory_format=torch.channels_last)
        pre = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=2, lr=0.1, kl_clip=kl_clip,
                                 inverse_method=method, max_factor_side=500)
        if not through:
            monkeypatch.setattr(pre.preconditioning, "_write_through", lambda g: False)
        grads = []
        for _ in range(3):
            model.zero_grad()
            model(INPUTS[make]()).square().sum().backward()
            pre.step()
            grads += [p.grad.clone() for p in model.parameters()]
        return grads

    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False)))


def test_memory_limit_bounds_the_peak_and_names_both_numbers() -> None:
    """A limit between the steady state and the peak refuses the run, naming both; the peak itself is accepted."""
    s = KFACPreconditioner(mlp(), lr=0.1).summary()
    assert s.steady_bytes < s.peak_bytes
    limit = (s.steady_bytes + s.peak_bytes) // 2
    with pytest.raises(MemoryError) as e:
        KFACPreconditioner(mlp(), lr=0.1, memory_limit=limit)
    text = str(e.value)
    assert f"K-FAC would need {format_bytes(s.peak_bytes)} on this rank at the peak of an inverse step" in text
    assert f"({format_bytes(s.steady_bytes)} held between steps" in text
    assert f"memory_limit={format_bytes(limit)}" in text
    for fix in ("Raise memory_limit", "max_factor_side", "skip_layers", "schedule='dpkfac'"):
        assert fix in text, fix
    KFACPreconditioner(mlp(), lr=0.1, memory_limit=s.peak_bytes)  # at the peak: accepted


def test_the_limit_is_checked_against_independent_sizes() -> None:
    """The refusal is about the memory a step really takes: a limit just under the measured peak refuses."""
    torch.manual_seed(0)
    _, before, peak = measure(equal_layers(), torch.randn(32, 64))
    KFACPreconditioner(equal_layers(), lr=0.1, memory_limit=int(1.1 * peak))
    with pytest.raises(MemoryError, match=re.escape("above memory_limit")):
        KFACPreconditioner(equal_layers(), lr=0.1, memory_limit=before + (peak - before) // 2 - 1)


class _Owners(dist.Distributor):
    """schedule="dpkfac"'s layout on rank 0 of 2, for the summary only (no step is taken)."""

    rank = 0
    world_size = 2

    def setup(self, sides, context) -> None:  # type: ignore[no-untyped-def]
        self.layer_owners = tuple(i % 2 for i in range(len(sides)))


def test_dpkfac_peak_counts_the_rank_s_own_inversions_and_every_layer_s_p() -> None:
    pre = KFACPreconditioner(equal_layers(), lr=0.1, distributor=_Owners())
    s = pre.summary()
    one = KFACPreconditioner(equal_layers(), lr=0.1).summary()
    w, w1 = s.workspace, one.workspace
    assert s.rank == 0 and s.steady_bytes < one.steady_bytes
    own = [(64, 64)] * 16  # A and G of the 8 layers rank 0 owns
    assert w.inverses == inversion_workspace(own, "cholesky", torch.float32)
    assert w.inverses < w1.inverses
    # Every layer's P (64 x 64 float32) and gradient matrix are kept to the end: the gradient is a view (no bias),
    # P of every layer is received; plus one layer's temporaries.
    assert w.precondition == 15 * 64 * 64 * 4 + 2 * 64 * 64 * 4  # (the last layer: its P and G^-1 g)
    assert w.overlapped and s.peak_bytes == s.steady_bytes + max(w.factors, w.inverses + w.precondition)
