"""Dense float64 references for K-FAC, built from the definitions (the spec in tests/test_reference.py),
not from the library: hooks that capture each layer's inputs, outputs and output gradients, im2col
rows built with explicit loops, factors, damped inverses, preconditioned gradients and the KL clip.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

F64 = torch.float64

# ----------------------------------------------------------------------------- capture


class Recorder:
    """Stores, per module and per forward call, the input, output and output gradient."""

    def __init__(self, model: nn.Module, names: list[str]):
        mods = dict(model.named_modules())
        self.modules = {n: mods[n] for n in names}
        self.inputs: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        self.outputs: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        self.gouts: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in self.modules.items()]

    def _hook(self, name):
        def hook(module, inputs, output):
            self.inputs[name].append(inputs[0].detach().clone())
            self.outputs[name].append(output.detach().clone())

            def ghook(g):
                self.gouts[name].append(g.detach().clone())

            output.register_hook(ghook)

        return hook

    def clear(self):
        for d in (self.inputs, self.outputs, self.gouts):
            for v in d.values():
                v.clear()

    def remove(self):
        for h in self.handles:
            h.remove()


# ----------------------------------------------------------------------------- reference math


def im2col_loops(x: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    """Patch rows (B*Ho*Wo, C*kh*kw), ordered (b, oh, ow), columns ordered like weight.view(out, -1)."""
    x = x.to(F64)
    B, C, H, W = x.shape
    kh, kw = conv.kernel_size
    sh, sw = conv.stride
    ph, pw = conv.padding
    dh, dw = conv.dilation
    if conv.padding_mode == "zeros":
        xp = torch.zeros(B, C, H + 2 * ph, W + 2 * pw, dtype=F64)
        xp[:, :, ph : ph + H, pw : pw + W] = x
    else:  # e.g. reflect: pad like the module does (validated against the output in a_rows)
        xp = F.pad(x, (pw, pw, ph, ph), mode=conv.padding_mode)
    Ho = (H + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    Wo = (W + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    rows = []
    for b in range(B):
        for oh in range(Ho):
            for ow in range(Wo):
                patch = torch.empty(C, kh, kw, dtype=F64)
                for i in range(kh):
                    for j in range(kw):
                        patch[:, i, j] = xp[b, :, oh * sh + i * dh, ow * sw + j * dw]
                rows.append(patch.reshape(-1))
    return torch.stack(rows)


def a_rows(module: nn.Module, x: torch.Tensor, check_out: torch.Tensor | None = None) -> torch.Tensor:
    """Reference rows a_r (bias column of ones appended when the layer has a bias)."""
    if isinstance(module, nn.Conv2d):
        rows = im2col_loops(x, module)
    else:
        rows = x.to(F64).reshape(-1, x.shape[-1])
    if check_out is not None:  # validate the reference rows against the layer's own output
        w = module.weight.detach().to(F64).reshape(module.weight.shape[0], -1)
        out = rows @ w.T
        if module.bias is not None:
            out = out + module.bias.detach().to(F64)
        if isinstance(module, nn.Conv2d):
            want = check_out.to(F64).permute(0, 2, 3, 1).reshape(-1, w.shape[0])
        else:
            want = check_out.to(F64).reshape(-1, w.shape[0])
        tol = 1e-10 if check_out.dtype == F64 else 1e-5
        torch.testing.assert_close(out, want, rtol=tol, atol=tol)
    if module.bias is not None:
        rows = torch.cat([rows, torch.ones(rows.shape[0], 1, dtype=F64)], dim=1)
    return rows


def d_rows(module: nn.Module, g: torch.Tensor) -> torch.Tensor:
    g = g.to(F64)
    if isinstance(module, nn.Conv2d):
        return g.permute(0, 2, 3, 1).reshape(-1, g.shape[1])  # (b, oh, ow) order
    return g.reshape(-1, g.shape[-1])


def ref_factors(rec: Recorder, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A and G of one optimizer step from every captured call (all micro-batches)."""
    m = rec.modules[name]
    As = [a_rows(m, x, o) for x, o in zip(rec.inputs[name], rec.outputs[name], strict=True)]
    Ds = [d_rows(m, g) for g in rec.gouts[name]]
    assert len(As) == len(Ds) > 0
    a = torch.cat(As)
    d = torch.cat(Ds)
    # N: one example per image (Conv2d), per row of a 2-D Linear input, and per position of a
    # Linear input with more dims (K-FAC-expand: each position carries a loss term).
    n_examples = sum(x.shape[0] if isinstance(m, nn.Conv2d) or x.dim() <= 2 else x.numel() // x.shape[-1]
                     for x in rec.inputs[name])
    A = a.T @ a / a.shape[0]
    G = n_examples * (d.T @ d)
    return A, G


def grad_matrix(module: nn.Module) -> torch.Tensor:
    g = module.weight.grad.detach().to(F64).reshape(module.weight.shape[0], -1).clone()
    if module.bias is not None:
        g = torch.cat([g, module.bias.grad.detach().to(F64).reshape(-1, 1)], dim=1)
    return g


def check_grad_consistency(rec: Recorder, name: str, grad: torch.Tensor, tol: float) -> None:
    """Sanity of the captures themselves: dW (with db) == sum_r d_r a_r^T over all calls."""
    m = rec.modules[name]
    a = torch.cat([a_rows(m, x) for x in rec.inputs[name]])
    d = torch.cat([d_rows(m, g) for g in rec.gouts[name]])
    assert_close(d.T @ a, grad, tol)


def damped_inv(Fm: torch.Tensor, damping: float) -> torch.Tensor:
    Fm = Fm.to(F64)
    return torch.linalg.inv(Fm + damping * torch.eye(Fm.shape[0], dtype=F64))


def pi_dampings(A: torch.Tensor, G: torch.Tensor, damping: float) -> tuple[float, float]:
    """The damping of A and of G for a block damping ``damping``: pi sqrt(damping), sqrt(damping) / pi
    with pi^2 = (mean eigenvalue of A) / (mean eigenvalue of G) (Martens & Grosse 2015, sec. 6.3)."""
    pi = ((torch.trace(A.to(F64)) / A.shape[0]) / (torch.trace(G.to(F64)) / G.shape[0])).sqrt().item()
    return pi * damping**0.5, damping**0.5 / pi


def damped_invs(A: torch.Tensor, G: torch.Tensor, damping: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(A + pi sqrt(damping) I)^-1 and (G + sqrt(damping)/pi I)^-1: the block damping convention."""
    dA, dG = pi_dampings(A, G, damping)
    return damped_inv(A, dA), damped_inv(G, dG)


def ref_precondition(grads, A_invs, G_invs, kl_clip, lr):
    """Preconditioned (and KL-clipped) gradients of all layers, and nu (1.0 when kl_clip is None)."""
    P = [Gi @ g @ Ai for g, Ai, Gi in zip(grads, A_invs, G_invs, strict=True)]
    if kl_clip is None:
        return P, 1.0
    vg = sum(lr * lr * float((p * g).sum()) for p, g in zip(P, grads, strict=True))
    nu = min(1.0, math.sqrt(kl_clip / abs(vg)))
    return [nu * p for p in P], nu


def assert_close(got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    got = got.detach().to(F64)
    ref = ref.detach().to(F64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    scale = float(ref.abs().max()) if ref.numel() else 1.0
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol * max(scale, 1e-30))
