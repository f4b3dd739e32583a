"""Diagonal factor sides (max_factor_side, embeddings at any vocabulary) against dense float64 references.

A side above ``max_factor_side`` keeps only the diagonal of its factor; the block is then
``diag(A) (x) G`` (or ``A (x) diag(G)``, or both diagonal), damped and inverted as docs/math.md says. The
references build the dense factors from captured inputs and output gradients, zero the off-diagonal entries of
the diagonal sides, and invert dense matrices (Cholesky: the pi-balanced split; eigen: the explicit Kronecker
product).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_spdkfac.kfac.preconditioner import KFACPreconditioner
from tests.helpers.dense_reference import (
    F64,
    Recorder,
    assert_close,
    damped_invs,
    grad_matrix,
    ref_factors,
)


def _diag(m: torch.Tensor) -> torch.Tensor:
    return torch.diag(torch.diagonal(m))


def _kron_precondition(g: torch.Tensor, A: torch.Tensor, G: torch.Tensor, damping: float) -> torch.Tensor:
    """(A (x) G + damping I)^-1 vec(g), by the explicit Kronecker product (column-major vec)."""
    M = torch.kron(A, G) + damping * torch.eye(A.shape[0] * G.shape[0], dtype=F64)
    v = torch.linalg.solve(M, g.T.reshape(-1))
    return v.reshape(A.shape[0], G.shape[0]).T


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 4, bias=False)).double()


@pytest.mark.parametrize("method", ["cholesky", "eigen"])
@pytest.mark.parametrize("max_side", [100, 8, 5, 1])
def test_linear_block_with_diagonal_sides(method: str, max_side: int) -> None:
    model = _model()
    names = ["0", "2"]
    damping = 3e-2
    pre = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1, kl_clip=None, damping=damping,
                             max_factor_side=max_side, factor_dtype="float64", inv_dtype="float64",
                             inverse_method=method)
    # The layouts follow the size policy: side 7 (6 inputs + bias), 9, 9, 4.
    want = {"0": (7, 9), "2": (9, 4)}
    for name, (a, g) in want.items():
        ly = pre.layers[name]
        assert ly.a_shape == ((a,) if a > max_side else (a, a))
        assert ly.g_shape == ((g,) if g > max_side else (g, g))
    rec = Recorder(model, names)
    x = torch.randn(12, 6, dtype=F64)
    model(x).square().sum().backward()
    grads = {n: grad_matrix(rec.modules[n]) for n in names}
    refs = {}
    for n in names:
        A, G = ref_factors(rec, n)
        A = _diag(A) if A.shape[0] > max_side else A
        G = _diag(G) if G.shape[0] > max_side else G
        if method == "eigen":
            refs[n] = _kron_precondition(grads[n], A, G, damping)
        else:
            Ai, Gi = damped_invs(A, G, damping)
            refs[n] = Gi @ grads[n] @ Ai
    pre.step()
    for n in names:
        assert_close(grad_matrix(rec.modules[n]), refs[n], 1e-8)


def test_diagonal_factor_memory_is_linear_in_the_side() -> None:
    """A 50257-wide head with a diagonal G holds 50257 floats per G-sized tensor, not 50257^2."""
    torch.manual_seed(0)
    head = nn.Linear(16, 50257)
    pre = KFACPreconditioner(head, factor_update_steps=1, inv_update_steps=1, kl_clip=None)
    x = torch.randn(4, 16)
    head(x).logsumexp(-1).sum().backward()
    pre.step()
    ly = pre.layers[""]
    assert ly.g_shape == (50257,) and ly.a_shape == (17, 17)
    assert ly.G is not None and ly.G_inv is not None and ly.G.shape == (50257,) and ly.G_inv.shape == (50257,)
    assert pre.state_bytes() == 4 * (2 * 50257 + 2 * 17 * 17)


@pytest.mark.parametrize("vocab", [50, 30522])
def test_embedding_at_any_vocabulary(vocab: int) -> None:
    """An embedding's A is its token counts (a diagonal of ``vocab`` entries), whatever the vocabulary; the
    preconditioned gradient of its weight is (counts + dA)^-1 per row times the dense G inverse."""
    torch.manual_seed(0)
    emb = nn.Embedding(vocab, 6, padding_idx=0).double()
    head = nn.Linear(6, 3).double()
    damping = 1e-2
    pre = KFACPreconditioner(nn.ModuleDict({"emb": emb, "head": head}), factor_update_steps=1, inv_update_steps=1,
                             kl_clip=None, damping=damping, factor_dtype="float64", inv_dtype="float64")
    assert pre.layers["emb"].a_shape == (vocab,)
    ids = torch.tensor([[0, 1, 2, 2], [3, 1, 0, 4]])
    out = emb(ids)
    gout: list[torch.Tensor] = []
    out.register_hook(lambda g: gout.append(g.detach().clone()))
    head(out).square().sum().backward()
    g = emb.weight.grad.detach().clone().T  # d x vocab
    counts = torch.zeros(vocab, dtype=F64).index_add_(0, ids.reshape(-1), torch.ones(ids.numel(), dtype=F64))
    counts[0] = 0.0  # padding
    a_diag = counts / ids.numel()
    d = gout[0].reshape(-1, 6)
    G = ids.numel() * (d.T @ d)
    if vocab <= 100:  # the dense reference, as defined
        Ai, Gi = damped_invs(torch.diag(a_diag), G, damping)
        want = (Gi @ g @ Ai).T
    else:  # the same, without a vocab x vocab matrix: pi from the traces, the diagonal inverse elementwise
        pi = float((a_diag.mean() / (torch.trace(G) / 6)).sqrt())
        dA, dG = pi * damping**0.5, damping**0.5 / pi
        want = (torch.linalg.inv(G + dG * torch.eye(6, dtype=F64)) @ g / (a_diag + dA)).T
    pre.step()
    assert_close(emb.weight.grad, want, 1e-8)
    assert pre.layers["emb"].A is not None and pre.layers["emb"].A.shape == (vocab,)


def test_diagonal_factor_with_nonfinite_entries_falls_back_to_identity() -> None:
    """A diagonal factor holding a NaN (a poisoned running factor) inverts to a finite scaled identity, with a
    warning, like a dense one."""
    from lightning_spdkfac.kfac.inverse import robust_eigens, robust_inverses

    f = torch.tensor([1.0, float("nan"), 3.0])
    invs, fbs = robust_inverses([f, torch.tensor([1.0, 0.0, 2.0])], [0.5, 0.0], torch.float32)
    assert fbs and fbs[0].index == 0 and fbs[0].level == "identity"
    assert torch.isfinite(invs[0]).all()
    # damping 0 and a zero entry: floored like the dense eigh path, finite.
    assert torch.isfinite(invs[1]).all() and invs[1][0] == 1.0 and invs[1][2] == 0.5
    payloads, fbs = robust_eigens([f], torch.float32)
    assert fbs[0].level == "identity" and payloads[0].shape == (3,) and torch.isfinite(payloads[0]).all()
