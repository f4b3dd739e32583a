"""Inversions batched by shape (kfac/inverse.py): bitwise the per-factor results, one host read per call.

The reference is the per-factor implementation as it was before batching (tests/helpers/inverse_per_factor.py),
called one factor at a time, as the owners used to call it.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch
from helpers import inverse_per_factor as ref

from lightning_spdkfac.kfac import inverse
from lightning_spdkfac.kfac.inverse import pi_split, robust_eigens, robust_inverses

INVERSE_PY = os.path.abspath(inverse.__file__)
REFERENCE_PY = os.path.abspath(ref.__file__)
HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")


def _spd(shape, seed, dtype=torch.float32):
    """A random PSD factor: ``n x n``, ``b x n x n`` (grouped) or ``n`` (diagonal)."""
    g = torch.Generator().manual_seed(seed)
    if len(shape) == 1:
        return torch.rand(shape, generator=g, dtype=dtype)
    n = shape[-1]
    x = torch.randn(*shape[:-2], 3 * n, n, generator=g, dtype=dtype)
    return x.mT @ x / (3 * n)


def _factors(shapes, src_dtypes=(torch.float32,)):
    return [_spd(s, i, src_dtypes[i % len(src_dtypes)]) for i, s in enumerate(shapes)]


def _dampings(factors, kind, seed=1):
    """One damping per factor: numbers, or float64 tensors as pi_split gives them (one per block when grouped)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for f in factors:
        d = torch.rand(f.shape[0] if f.dim() == 3 else (), generator=g, dtype=torch.float64) * 0.1 + 1e-3
        out.append(float(d.max()) if kind == "float" else d)
    return out


def _per_factor_inverses(factors, dampings, dtype):
    """The reference: robust_inverses one factor at a time, fallback indices mapped back to the batch."""
    invs, fbs = [], []
    for i, (f, d) in enumerate(zip(factors, dampings)):
        (inv,), fb = ref.robust_inverses([f], [d], dtype)
        invs.append(inv)
        fbs += [(i, x.level, x.damping, x.reason) for x in fb]
    return invs, fbs


def _per_factor_eigens(factors, dtype):
    payloads, fbs = [], []
    for i, f in enumerate(factors):
        (p,), fb = ref.robust_eigens([f], dtype)
        payloads.append(p)
        fbs += [(i, x.level, x.damping, x.reason) for x in fb]
    return payloads, fbs


def _assert_bitwise(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous(), i
        assert torch.equal(a, b), f"factor {i} {tuple(a.shape)}: max diff {(a - b).abs().max()}"


def _tuples(fallbacks):
    return [dataclasses.astuple(fb) for fb in fallbacks]


SHAPE_SETS = {
    "duplicated": [(64, 64)] * 4,
    "sizes": [(1, 1), (2, 2), (3, 3), (5, 5), (8, 8), (13, 13), (5, 5), (2, 2)],
    "mixed": [(64, 64), (50,), (128, 128), (3, 16, 16), (64, 64), (50,), (256, 256), (3, 16, 16), (7,), (128, 128)],
    "grouped": [(4, 8, 8), (2, 8, 8), (4, 8, 8), (4, 9, 9), (4, 8, 8)],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["float", "tensor"])
@pytest.mark.parametrize("shapes", SHAPE_SETS.values(), ids=SHAPE_SETS.keys())
def test_batched_inverses_equal_the_per_factor_inverses_bitwise(shapes, kind, dtype):
    factors = _factors(shapes, (torch.float32, torch.float64))  # stored in either dtype, inverted in dtype
    dampings = _dampings(factors, kind)
    invs, fallbacks = robust_inverses(factors, dampings, dtype)
    want, want_fallbacks = _per_factor_inverses(factors, dampings, dtype)
    assert fallbacks == [] and want_fallbacks == []
    _assert_bitwise(invs, want)
    # Each inverse its own tensor (not a view of the stack, which would keep it alive and be saved whole).
    assert all(inv.untyped_storage().nbytes() == inv.numel() * inv.element_size() for inv in invs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shapes", SHAPE_SETS.values(), ids=SHAPE_SETS.keys())
def test_batched_eigens_equal_the_per_factor_payloads_bitwise(shapes, dtype):
    factors = _factors(shapes, (torch.float32, torch.float64))
    payloads, fallbacks = robust_eigens(factors, dtype)
    want, want_fallbacks = _per_factor_eigens(factors, dtype)
    assert fallbacks == [] and want_fallbacks == []
    _assert_bitwise(payloads, want)
    assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in payloads)


def _bad_factors():
    """Healthy factors of three shapes with, among them, every kind of factor the ladder takes."""
    healthy = _factors([(64, 64), (50,), (3, 16, 16), (64, 64), (32, 32)])
    nan = _spd((64, 64), 10)
    nan[7, 3] = float("nan")  # the lower triangle, which Cholesky reads
    q, _ = torch.linalg.qr(torch.randn(64, 64, generator=torch.Generator().manual_seed(11)))
    indefinite = (q * torch.linspace(-1.0, 2.0, 64)) @ q.T
    grouped = _spd((3, 16, 16), 12)
    grouped[1] = -grouped[1]  # one indefinite block
    diag_inf = _spd((50,), 13)
    diag_inf[2] = float("inf")
    huge = _spd((32, 32), 14, torch.float64) * 1e300  # finite in float64, not in float32
    return [healthy[0], nan, healthy[1], indefinite, grouped, healthy[2], diag_inf, healthy[3], torch.zeros(5, 5),
            huge, healthy[4]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["float", "tensor"])
def test_batched_fallbacks_equal_the_per_factor_ladder(kind, dtype):
    factors = _bad_factors()
    dampings = _dampings(factors, kind)
    dampings[8] = 0.0 if kind == "float" else torch.zeros((), dtype=torch.float64)  # a zero factor, no damping
    invs, fallbacks = robust_inverses(factors, dampings, dtype)
    want, want_fallbacks = _per_factor_inverses(factors, dampings, dtype)
    assert _tuples(fallbacks) == want_fallbacks
    assert [fb.index for fb in fallbacks][:4] == [1, 3, 4, 6]
    _assert_bitwise(invs, want)
    assert all(torch.isfinite(inv).all() for inv in invs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batched_eigen_fallbacks_equal_the_per_factor_ladder(dtype):
    factors = _bad_factors()
    payloads, fallbacks = robust_eigens(factors, dtype)
    want, want_fallbacks = _per_factor_eigens(factors, dtype)
    assert _tuples(fallbacks) == want_fallbacks
    assert [fb.index for fb in fallbacks][:2] == [1, 6]
    _assert_bitwise(payloads, want)


def test_a_batched_eigh_that_raises_sends_its_group_down_the_ladder(monkeypatch):
    factors = _factors([(16, 16), (8, 8), (16, 16), (16, 16)])
    want, _ = _per_factor_eigens(factors, torch.float32)
    real = torch.linalg.eigh

    def eigh(a, *args, **kwargs):
        if a.dim() == 3 and a.shape[-1] == 16:  # the stacked 16 x 16 group
            raise torch.linalg.LinAlgError("no convergence (test)")
        return real(a, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "eigh", eigh)
    payloads, fallbacks = robust_eigens(factors, torch.float32)
    assert fallbacks == []  # each factor's own eigh succeeds
    _assert_bitwise(payloads, want)


class HostReads:
    """Counts the device-to-host reads (Tensor.item, tolist, bool(), float(), ...) issued from kfac/inverse.py,
    and apart from those, from the per-factor reference."""

    def __init__(self, monkeypatch):
        self.count = self.ref_count = 0
        for name in HOST_READS:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(getattr(torch.Tensor, name)))

    def _wrap(self, real):
        def read(t, *args, **kwargs):
            caller = os.path.abspath(sys._getframe(1).f_code.co_filename)
            if caller == INVERSE_PY:
                self.count += 1
            elif caller == REFERENCE_PY:
                self.ref_count += 1
            return real(t, *args, **kwargs)

        return read

    def reset(self):
        n, self.count = self.count, 0
        return n


SEVEN = [(64, 64), (32, 32), (64, 64), (3, 16, 16), (32, 32), (64, 64), (3, 16, 16)]  # 7 factors, 3 shapes
ODD = [(65, 65), (33, 33), (65, 65), (3, 7, 7), (33, 33), (65, 65), (3, 7, 7)]  # split into single calls on CPUs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_results_do_not_depend_on_which_factors_share_the_call(dtype):
    """A batched LAPACK call at a factor's offset in the stack can round differently from a call on the factor
    alone (odd sizes, with MKL); such groups run factor by factor on CPUs (kfac/inverse.py, _shape_groups)."""
    factors = _factors(ODD + SEVEN)
    alone = [robust_inverses([f], 0.01, dtype)[0][0] for f in factors]
    _assert_bitwise(robust_inverses(factors, 0.01, dtype)[0], alone)
    _assert_bitwise(robust_inverses(factors[::-1], 0.01, dtype)[0], alone[::-1])
    alone = [robust_eigens([f], dtype)[0][0] for f in factors]
    _assert_bitwise(robust_eigens(factors, dtype)[0], alone)
    _assert_bitwise(robust_eigens(factors[::-1], dtype)[0], alone[::-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_host_read_per_call_on_healthy_factors(monkeypatch, dtype):
    factors = _factors(SEVEN)
    A, G = factors[0], factors[2]
    reads = HostReads(monkeypatch)
    # The dampings as an inverse step computes them: pi_split on the device, from a number or a 0-d tensor.
    dA, dG = pi_split(A, G, 0.01)
    tA, tG = pi_split(A, G, torch.tensor(0.01, dtype=torch.float64))
    assert reads.reset() == 0
    assert torch.equal(dA, tA) and torch.equal(dG, tG)
    dampings = [dA, dG, dA, dA.expand(3).clone(), dG, dG, dG]
    invs, fallbacks = robust_inverses(factors, dampings, dtype)
    assert (reads.reset(), fallbacks) == (1, [])
    invs, fallbacks = robust_inverses(factors, 0.01, dtype)
    assert (reads.reset(), fallbacks) == (1, [])
    payloads, fallbacks = robust_eigens(factors, dtype)
    assert (reads.reset(), fallbacks) == (1, [])
    odd = _factors(ODD)  # groups split into single factors still share the one read
    assert robust_inverses(odd, 0.01, dtype)[1] == [] and reads.reset() == 1
    assert robust_eigens(odd, dtype)[1] == [] and reads.reset() == 1
    # What it replaces: the owners called the per-factor implementation once per factor (a read each), and its
    # eigen method read twice per factor.
    for f, d in zip(factors, dampings):
        ref.robust_inverses([f], [d], dtype)
    assert reads.ref_count == 7
    ref.robust_eigens(factors, dtype)
    assert reads.ref_count == 7 + 14 and reads.reset() == 0


def test_one_bad_factor_falls_back_with_its_index_and_more_reads(monkeypatch):
    factors = _factors(SEVEN)
    factors[4] = factors[4].clone()
    factors[4][2, 1] = float("nan")
    q, _ = torch.linalg.qr(torch.randn(64, 64, generator=torch.Generator().manual_seed(3)))
    indefinite = [*_factors(SEVEN)[:5], (q * torch.linspace(-1.0, 2.0, 64)) @ q.T, _factors(SEVEN)[6]]
    reads = HostReads(monkeypatch)
    invs, fallbacks = robust_inverses(factors, 0.01, torch.float32)
    assert [(fb.index, fb.level) for fb in fallbacks] == [(4, "identity")] and reads.reset() > 1
    invs, fallbacks = robust_inverses(indefinite, 0.01, torch.float32)
    assert [(fb.index, fb.level) for fb in fallbacks] == [(5, "eigh")] and reads.reset() > 1
    payloads, fallbacks = robust_eigens(factors, torch.float32)
    assert [(fb.index, fb.level) for fb in fallbacks] == [(4, "identity")] and reads.reset() > 1
    assert all(torch.isfinite(t).all() for t in invs + payloads)


def test_a_large_group_is_stacked_in_chunks(monkeypatch):
    """The stack of a shape is bounded (kfac/inverse.py MAX_STACK_BYTES): a group over it is split, with the same
    results and still one read."""
    monkeypatch.setattr(inverse, "MAX_STACK_BYTES", 3 * 64 * 64 * 4)  # three float32 64 x 64 factors
    calls = []
    real = torch.linalg.cholesky_ex
    monkeypatch.setattr(torch.linalg, "cholesky_ex", lambda a, **kw: calls.append(a.shape[0]) or real(a, **kw))
    factors = _factors([(64, 64)] * 7 + [(32, 32)] * 2)
    alone = [robust_inverses([f], 0.01, torch.float32)[0][0] for f in factors]
    calls.clear()
    reads = HostReads(monkeypatch)
    invs, fallbacks = robust_inverses(factors, 0.01, torch.float32)
    assert (calls, fallbacks, reads.reset()) == ([3, 3, 1, 2], [], 1)
    _assert_bitwise(invs, alone)
