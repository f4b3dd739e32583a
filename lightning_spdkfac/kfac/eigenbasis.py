"""``update="eigen_adam"``: Adam's second moment kept in the Kronecker eigenbasis of each layer's factors (EKFAC,
George et al. 2018; SOAP, Vyas et al. 2025), as K-FAC's preconditioned direction.

For a layer with gradient matrix ``M`` (g x a) and factor eigendecompositions ``A = Q_A diag(e_A) Q_A^T``,
``G = Q_G diag(e_G) Q_G^T`` (the eigen payloads the inverse steps compute, placed and broadcast as inverses are):

    R = Q_G^T M Q_A                        the gradient in the Kronecker eigenbasis
    v <- beta2 v + (1 - beta2) R * R        a running second moment per entry (EKFAC's corrected eigenvalues)
    s = sqrt(v / (1 - beta2^t))             its bias-corrected root
    P = Q_G [R / (s + damping * rms(s) + eps)] Q_A^T

The eigenvalues e_A, e_G are not used: the per-entry scale comes from the measured second moment. ``damping`` is a
small safety term relative to the block's root-mean-square ``rms(s)``: an entry whose moment is far below the block's
(a direction the data never spanned, where R holds only rounding) would otherwise be divided by its own size and
become an O(1) step in a direction of pure rounding noise. A diagonal side has the identity as its basis; a grouped
side (an expert stack, a grouped convolution) one basis per block (and one ``rms`` per block).

When the inverse step refreshes a layer's basis, its moment is carried into the new basis: with ``W = Q_new^T
Q_old`` per side, ``v_new = (W_G * W_G) v (W_A * W_A)^T``, the second moment of the rotated entries when the old
ones are uncorrelated. It is exact for a basis that only reorders or flips eigenvectors, and it keeps the total
(``sum v``) when the bases span the same space. SOAP carries its first moment through the change of basis and
reorders its second; this carries the second, the only one kept here (momentum is the base optimizer's).

:class:`EigenMoments` is owned by the preconditioning part (kfac/preconditioning.py); under ``schedule="dpkfac"``
each layer's moment lives on its owner only, like its inverses. docs/math.md, "The eigenbasis mode", has the math and
how it composes with the base optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..factor_shapes import preconditioned_shape
from .inverse import split_payload
from .layer_state import KFACLayer

# The distributor's gather_layers (kfac/distributor.py OwnerHeld): each layer's tensors from its owner, on every rank.
Gather = Callable[..., dict[int, Any]]


@dataclass
class EigenMoment:
    """One layer's second moment in its eigenbasis, the steps it has seen, and the basis it is expressed in."""

    v: torch.Tensor  # the gradient matrix's shape
    t: int
    basis: int  # the layer's inv_version the moment is in
    QA: torch.Tensor | None  # copies of that basis's eigenvectors (None: diagonal side), to carry v at a refresh
    QG: torch.Tensor | None


def rotate(M: torch.Tensor, QA: torch.Tensor | None, QG: torch.Tensor | None) -> torch.Tensor:
    """``Q_G^T M Q_A`` (a None side is the identity)."""
    r = M if QG is None else QG.transpose(-1, -2) @ M
    return r if QA is None else r @ QA


def rotate_back(R: torch.Tensor, QA: torch.Tensor | None, QG: torch.Tensor | None) -> torch.Tensor:
    """``Q_G R Q_A^T`` (a None side is the identity)."""
    r = R if QG is None else QG @ R
    return r if QA is None else r @ QA.transpose(-1, -2)


def carry(v: torch.Tensor, old: tuple[torch.Tensor | None, torch.Tensor | None],
          new: tuple[torch.Tensor | None, torch.Tensor | None]) -> torch.Tensor:
    """The second moment ``v`` (in basis ``old`` = (Q_A, Q_G)) carried into basis ``new``."""
    (qa_old, qg_old), (qa_new, qg_new) = old, new
    out = v
    if qg_new is not None and qg_old is not None:
        wg = qg_new.transpose(-1, -2) @ qg_old
        out = (wg * wg) @ out
    if qa_new is not None and qa_old is not None:
        wa = qa_new.transpose(-1, -2) @ qa_old
        out = out @ (wa * wa).transpose(-1, -2)
    return out


class EigenMoments:
    """The eigenbasis mode's state: each layer's :class:`EigenMoment` (by layer index), and its direction."""

    def __init__(self, beta2: float, eps: float) -> None:
        self.beta2 = beta2
        self.eps = eps
        self.states: dict[int, EigenMoment] = {}

    def _basis(self, layer: KFACLayer) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        assert layer.A_inv is not None and layer.G_inv is not None  # (called with both payloads held)
        return split_payload(layer.A_inv)[0], split_payload(layer.G_inv)[0]

    def sync(self, layer: KFACLayer) -> EigenMoment | None:
        """The layer's moment, carried into the basis the layer holds now (None before its first step)."""
        st = self.states.get(layer.index)
        if st is None or st.basis == layer.inv_version:
            return st
        qa, qg = self._basis(layer)
        st.v = carry(st.v, (st.QA, st.QG), (qa, qg)).clamp_(min=0.0)
        st.QA = None if qa is None else qa.clone()
        st.QG = None if qg is None else qg.clone()
        st.basis = layer.inv_version
        return st

    def direction(self, layer: KFACLayer, grad: torch.Tensor) -> torch.Tensor:
        """P of ``grad`` (the layer's gradient matrix in inv_dtype) in the eigenbasis mode; updates the moment."""
        damping = layer.inv_damping or 0.0  # (the damping of the inverse step that computed the basis)
        qa, qg = self._basis(layer)
        r = rotate(grad, qa, qg)
        st = self.sync(layer)
        if st is None:
            st = self.states[layer.index] = EigenMoment(
                torch.zeros_like(r), 0, layer.inv_version, None if qa is None else qa.clone(),
                None if qg is None else qg.clone())
        st.t += 1
        st.v.mul_(self.beta2).addcmul_(r, r, value=1.0 - self.beta2)
        v_hat = st.v / (1.0 - self.beta2 ** st.t)
        # The damping, relative to the block's root-mean-square second moment: an entry whose moment is far below the
        # block's (a direction the data has not spanned, where R holds only rounding) is not blown up to O(1).
        floor = v_hat.mean(dim=(-2, -1), keepdim=True).sqrt_().mul_(damping).add_(self.eps)
        return rotate_back(r / v_hat.sqrt_().add_(floor), qa, qg)  # (not in place: with two diagonal sides r is the gradient)

    def forget(self, keep: set[int] | None = None) -> None:
        """Drop every moment (``keep``: but those of these layer indices)."""
        self.states = {} if keep is None else {i: st for i, st in self.states.items() if i in keep}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for st in self.states.values()
                   for t in (st.v, st.QA, st.QG) if t is not None)

    def saved(self, layers: dict[str, KFACLayer], gather: Gather | None, dtype: torch.dtype) -> dict[str, dict[str, Any]]:
        """The moments by layer name for a checkpoint, each carried into the basis the layer holds (the inverses saved
        beside it). Under distributed preconditioning ``gather`` (the distributor's ``gather_layers``, a collective)
        brings every owner's moments to every rank."""
        by_index = {ly.index: ly for ly in layers.values()}
        for i in list(self.states):
            if by_index[i].A_inv is not None and by_index[i].G_inv is not None:
                self.sync(by_index[i])
        found: dict[int, tuple[torch.Tensor, int]] = {i: (st.v, st.t) for i, st in self.states.items()}
        if gather is not None:
            # (gather_layers moves a layer's first two tensors from its owner: here the moment and its step count)
            held = {i: (v, torch.full((1,), float(t), dtype=v.dtype, device=v.device), None, None, None)
                    for i, (v, t) in found.items()}
            order = sorted(layers.values(), key=lambda ly: ly.index)
            shapes = [(preconditioned_shape(ly.a_shape, ly.g_shape), (1,), (1,), (1,)) for ly in order]
            got = gather(held, shapes, (dtype, dtype))
            found = {i: (entry[0], int(float(entry[1][0]))) for i, entry in got.items()
                     if entry[0] is not None and entry[1] is not None}
        return {by_index[i].name: {"v": v, "t": t} for i, (v, t) in sorted(found.items())}

    def load(self, entries: Mapping[str, Any], layers: dict[str, KFACLayer], mine: Callable[[KFACLayer], bool],
             dtype: torch.dtype) -> None:
        """Restore :meth:`saved` (verified by the checkpoint part): each moment in the basis of the inverses loaded
        beside it, for the layers this rank holds (``mine``) and has eigen payloads for; the others start fresh."""
        self.states = {}
        for name, entry in entries.items():
            layer = layers[name]
            if not mine(layer) or layer.A_inv is None or layer.G_inv is None:
                continue
            qa, qg = self._basis(layer)
            v = entry["v"].to(device=layer.A_inv.device, dtype=dtype).clone()
            self.states[layer.index] = EigenMoment(v, int(entry["t"]), layer.inv_version,
                                                   None if qa is None else qa.clone(), None if qg is None else qg.clone())
