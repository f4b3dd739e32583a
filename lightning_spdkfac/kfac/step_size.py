"""K-FAC's step size from the exact local quadratic model (Martens & Grosse 2015, sections 6.4 and 7).

With ``step_size="quadratic"`` the optimizer's own update ``u`` (whatever it is: SGD's, with its momentum, or
Adam's normalized one, of the preconditioned gradient) is rescaled after ``optimizer.step()`` to ``alpha * u``,
where ``alpha`` minimizes the damped quadratic model of the loss along ``u``::

    M(alpha u) = alpha g.u + alpha^2 / 2 (u^T C u + lambda |u|^2),   alpha* = -g.u / (u^T C u + lambda |u|^2)

``g`` is the batch's gradient (before preconditioning), ``C = J^T H_L J`` the exact generalized Gauss-Newton
matrix of the loss on the batch (the Fisher for the usual losses), and ``lambda`` the model's damping (K-FAC's
``damping`` unless ``step_size_damping`` is given). ``u^T C u = (J u)^T H_L (J u)`` takes one forward-mode pass of
the model with ``u`` as tangent (``J u``; reverse-over-reverse where an operation has no forward-mode rule)
and one Hessian-vector product of the loss in the outputs. ``"quadratic_momentum"`` is the full rule of the
paper: the update is ``alpha u + mu delta``, ``delta`` the previous update applied, and ``(alpha, mu)`` minimize
the model on the plane of ``u`` and ``delta`` (a 2x2 solve; a second tangent).

The model is measured every ``step_size_every`` steps and its ``alpha`` (and ``mu``) is reused in between, clipped
to ``step_size_clip`` (``mu`` to ``[0, 1)``). Under DDP the only rank-dependent numbers (the curvature terms of
each rank's batch) are averaged with one all-reduce of three scalars (``Distributor.average_scalars``: this module
never touches torch.distributed), so every rank computes the same ``alpha``
and the replicas stay bitwise equal. See docs/math.md, "The step size".

The model needs the loss as a function of the model's outputs, which K-FAC cannot see: a ``loss_parts`` pair
``(forward, loss)``, where ``forward()`` recomputes the outputs from the current parameters and ``loss(outputs)``
is the scalar the training step minimizes (with its reduction, label smoothing, ``ignore_index``...). The
``KFAC`` callback takes it from the LightningModule's ``kfac_loss_parts(batch)``; plain PyTorch passes it to
``KFACPreconditioner.step(optimizer, loss_parts=...)``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
from torch import nn
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

MU_MAX = 0.99  # "quadratic_momentum": mu's range is [0, MU_MAX]
LM_DAMPING_RANGE = (1e-6, 10.0)  # adapt_damping: the damping stays inside

LossParts = tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]

LOSS_PARTS_HELP = (
    "define kfac_loss_parts(self, batch) on your LightningModule (plain PyTorch: pass "
    "KFACPreconditioner.step(optimizer, loss_parts=(forward, loss))): forward() returns the model's outputs on the "
    "batch, recomputed from the current parameters, and loss(outputs) the scalar the training step minimizes, e.g.\n"
    "    def kfac_loss_parts(self, batch):\n"
    "        x, y = batch\n"
    "        return (lambda: self(x)), (lambda logits: F.cross_entropy(logits, y))\n"
    "or set step_size=None"
)


class _Call(nn.Module):
    """Runs ``forward()`` with the module's parameters swapped by ``functional_call`` (the closure uses ``model``)."""

    def __init__(self, model: nn.Module, forward: Callable[[], torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self._forward = forward

    def forward(self) -> torch.Tensor:
        out = self._forward()
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"kfac_loss_parts: forward() must return the model's output tensor, got "
                            f"{type(out).__name__} (return the logits or predictions the loss takes)")
        return out


def _jvps(call: _Call, names: list[str], primals: list[torch.Tensor], buffers: dict[str, torch.Tensor],
          tangents: Sequence[list[torch.Tensor]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The outputs at ``primals`` and ``J t`` for each tangent list ``t``: forward mode, or reverse-over-reverse
    where an operation of the model has no forward-mode rule."""

    def f(*p: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = functional_call(call, {**buffers, **dict(zip(names, p, strict=True))}, ())
        return out

    try:
        outs = [_forward_mode(f, primals, t) for t in tangents]
        return outs[0][0], [o[1] for o in outs]
    except (NotImplementedError, RuntimeError) as e:
        if "forward" not in str(e).lower() and "not implemented" not in str(e).lower():
            raise
    # J t = d/dw (J^T w . t) at any w: two reverse passes through a graph kept once.
    leaves = [p.detach().requires_grad_() for p in primals]
    with torch.enable_grad():
        z = f(*leaves)
        w = torch.zeros_like(z, requires_grad=True)
        vjp = torch.autograd.grad(z, leaves, w, create_graph=True, allow_unused=True)
        used = [(v, i) for i, v in enumerate(vjp) if v is not None]
        jts = []
        for t in tangents:
            jt = torch.autograd.grad([v for v, _ in used], w, [t[i] for _, i in used], retain_graph=True)[0]
            jts.append(jt)
    return z.detach(), jts


def _forward_mode(f: Callable[..., torch.Tensor], primals: list[torch.Tensor],
                  tangent: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(f(primals), J t) by dual numbers (torch.autograd.forward_ad: unlike torch.func.jvp, a module may update its
    buffers in place, as BatchNorm does in training mode)."""
    with fwAD.dual_level():
        out = f(*(fwAD.make_dual(p, t) for p, t in zip(primals, tangent, strict=True)))  # type: ignore[no-untyped-call]
        z, jt = fwAD.unpack_dual(out)  # type: ignore[no-untyped-call]
    if jt is None:  # the outputs do not depend on these parameters
        jt = torch.zeros_like(z)
    return z.detach(), jt.detach()


def _loss_hvps(loss: Callable[[torch.Tensor], torch.Tensor], z: torch.Tensor,
               vs: list[torch.Tensor]) -> list[torch.Tensor]:
    """H_L v for each v: the Hessian of ``loss`` in the outputs, by double backward."""
    z = z.detach().requires_grad_()
    with torch.enable_grad():
        value = loss(z)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise ValueError("kfac_loss_parts: loss(outputs) must return the scalar loss, got "
                             f"{type(value).__name__ if not isinstance(value, torch.Tensor) else tuple(value.shape)}")
        (gz,) = torch.autograd.grad(value, z, create_graph=True)
        out = []
        for i, v in enumerate(vs):
            if not gz.requires_grad:  # a loss linear in the outputs: no curvature
                out.append(torch.zeros_like(z))
                continue
            (hv,) = torch.autograd.grad(gz, z, v.to(z.dtype), retain_graph=i < len(vs) - 1, allow_unused=True)
            out.append(torch.zeros_like(z) if hv is None else hv)
    return out


def _dot(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack([torch.vdot(x.flatten().double(), y.flatten().double()) for x, y in zip(a, b, strict=True)]).sum()


class QuadraticStepSize:
    """The state and work of ``step_size="quadratic"`` / ``"quadratic_momentum"`` for one preconditioner."""

    def __init__(self, mode: str | None, every: int, clip: tuple[float, float], damping: float | None,
                 adapt_damping: bool = False, on_damping: Callable[[float], None] | None = None) -> None:
        self.mode = mode  # None: alpha stays 1 (adapt_damping alone)
        self.every = every
        self.clip = clip
        self.damping_override = damping
        # Levenberg-Marquardt: K-FAC's damping follows the reduction ratio rho of each measured step; on_damping
        # hands the new value to the preconditioner.
        self.adapt_damping = adapt_damping
        self.on_damping = on_damping
        self.damping: float | None = None  # the adapted damping (None until the first measurement)
        self.rho = math.nan
        self.alpha = 1.0
        self.mu = 0.0
        self.measurements = 0
        self.last_damping = math.nan  # the model's damping at the last measurement (telemetry)
        self.prev: dict[str, torch.Tensor] = {}  # "quadratic_momentum": the last update applied, by parameter name
        self._hooks: dict[int, Any] = {}
        self._named: dict[int, tuple[Any, list[tuple[str, nn.Parameter]]]] = {}
        self._pending: dict[str, Any] | None = None
        self._warned: set[str] = set()

    # ---------------------------------------------------------------- before the optimizer step
    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int, damping: float,
                loss_parts: LossParts | None, loss_scale: float,
                average: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
                paused: Callable[[], AbstractContextManager[None]] = nullcontext) -> None:
        """Snapshot what the rescaling needs (parameters, and on a measuring step the gradient), then arm the
        optimizer's post-step hook. Called by ``KFACPreconditioner.step`` before it preconditions."""
        named = self._stepped(model, optimizer)
        measure = step % self.every == 0
        if measure and loss_parts is None:
            what = f"step_size={self.mode!r}" if self.mode is not None else "adapt_damping=True"
            raise ValueError(f"{what} needs the loss as a function of the model's outputs: " + LOSS_PARTS_HELP)
        if loss_parts is not None and not (isinstance(loss_parts, tuple) and len(loss_parts) == 2
                                           and all(callable(f) for f in loss_parts)):
            raise TypeError(f"loss_parts must be a pair (forward, loss) of callables, got {type(loss_parts).__name__}")
        key = id(optimizer)
        if key not in self._hooks:
            self._hooks[key] = optimizer.register_step_post_hook(lambda opt, args, kwargs: self.finish())
        if not measure and self.alpha == 1.0 and self.mode != "quadratic_momentum":
            self._pending = None  # nothing to measure and nothing to rescale (adapt_damping alone): no copies
            return
        self._pending = {
            "model": model, "named": named, "measure": measure, "damping": damping,
            "old": torch._foreach_mul([p.detach() for _, p in named], 1.0) if named else [],  # copies, one call
            "grads": [None if p.grad is None else p.grad.detach().clone() for _, p in named] if measure else None,
            "loss_parts": loss_parts if measure else None, "loss_scale": loss_scale, "average": average,
            "paused": paused,
        }

    def _stepped(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, nn.Parameter]]:
        """The model's trainable parameters this optimizer steps, by name; cached while its groups hold the same."""
        key = tuple(id(p) for g in optimizer.param_groups for p in g["params"])
        cached = self._named.get(id(optimizer))
        if cached is None or cached[0] != key or not all(p.requires_grad for _, p in cached[1]):
            stepped = set(key)
            self._named[id(optimizer)] = cached = (
                key, [(n, p) for n, p in model.named_parameters() if id(p) in stepped and p.requires_grad])
        return cached[1]

    def remove_hooks(self) -> None:
        for h in self._hooks.values():
            h.remove()
        self._hooks.clear()
        self._pending = None

    # ---------------------------------------------------------------- after it
    @torch.no_grad()
    def finish(self) -> None:
        """The optimizer has stepped: measure (on a measuring step), then set each parameter to old + alpha u
        (+ mu delta)."""
        pend, self._pending = self._pending, None
        if pend is None:  # an optimizer step without a K-FAC step before it (another optimizer's, a skipped one)
            return
        named, old = pend["named"], pend["old"]
        if not named:
            return
        params = [p.detach() for _, p in named]
        momentum = self.mode == "quadratic_momentum"
        u = torch._foreach_sub(params, old) if pend["measure"] or momentum else []
        prev = [self.prev.get(n) for n, _ in named] if momentum else []
        use_prev = bool(prev) and all(d is not None and d.shape == x.shape for d, x in zip(prev, u, strict=True))
        model_terms = self._measure(pend, u, prev if use_prev else None) if pend["measure"] else None  # type: ignore[arg-type]
        mu = self.mu if use_prev else 0.0
        if momentum:
            for i, ((name, p), o) in enumerate(zip(named, old, strict=True)):
                step = u[i].mul(self.alpha)
                if mu:
                    step.add_(prev[i], alpha=mu)  # type: ignore[arg-type]
                p.copy_(o + step)
                self.prev[name] = step
        elif self.alpha != 1.0:  # theta <- old + alpha (theta - old) = alpha theta + (1 - alpha) old, two calls
            torch._foreach_mul_(params, self.alpha)
            torch._foreach_add_(params, old, alpha=1.0 - self.alpha)
        if model_terms is not None and self.adapt_damping:
            self._adapt(pend, model_terms, mu)

    def _adapt(self, pend: dict[str, Any], terms: dict[str, Any], mu: float) -> None:
        """Levenberg-Marquardt (Martens & Grosse 2015, section 6.5): rho = the loss's actual change on the batch over
        the undamped quadratic model's; rho > 3/4 lowers the damping by omega = 0.95**step_size_every, rho < 1/4
        raises it by 1/omega. The new loss is taken with the measurement's dropout masks (same random state)."""
        a = self.alpha
        c, gu, gd = terms["curv"], terms["gu"], terms["gd"]
        predicted = a * gu + 0.5 * a * a * c[0]
        if len(c) == 3:
            predicted += mu * gd + a * mu * c[1] + 0.5 * mu * mu * c[2]
        with torch.random.fork_rng(devices=terms["devices"]), pend["paused"]():
            torch.set_rng_state(terms["rng"])
            if terms["cuda_rng"] is not None:
                torch.cuda.set_rng_state(terms["cuda_rng"])
            buffers = {"model." + n: b.clone() for n, b in pend["model"].named_buffers()}
            params = {"model." + n: p.detach() for n, p in pend["named"]}
            z_new = functional_call(terms["call"], {**buffers, **params}, ())
            new_loss = pend["loss_parts"][1](z_new.detach())
        change = torch.stack([new_loss.detach().double().reshape(()) - terms["old_loss"]])
        actual = float(pend["average"](change).cpu()[0])
        if not (math.isfinite(actual) and math.isfinite(predicted)) or predicted >= 0.0:
            self.rho = math.nan  # no predicted decrease: nothing to compare with
            return
        self.rho = actual / predicted
        omega = 0.95 ** self.every
        lam = self.damping if self.damping is not None else pend["damping"]
        if self.rho > 0.75:
            lam *= omega
        elif self.rho < 0.25:
            lam /= omega
        self.damping = min(max(lam, LM_DAMPING_RANGE[0]), LM_DAMPING_RANGE[1])
        if self.on_damping is not None:
            self.on_damping(self.damping)

    def _measure(self, pend: dict[str, Any], u: list[torch.Tensor],
                 prev: list[torch.Tensor] | None) -> dict[str, Any]:
        """Solve the damped model for alpha (and mu); return its undamped terms for the damping's adaptation."""
        named, old, grads = pend["named"], pend["old"], pend["grads"]
        keep = [i for i, g in enumerate(grads) if g is not None]  # parameters without a gradient: no curvature
        names = [named[i][0] for i in keep]
        tangents = [[u[i] for i in keep]] + ([[prev[i] for i in keep]] if prev is not None else [])
        lam = (self.damping_override if self.damping_override is not None
               else self.damping if self.damping is not None else pend["damping"])
        self.last_damping = lam
        forward, loss = pend["loss_parts"]
        model: nn.Module = pend["model"]
        call = _Call(model, forward)
        buffers = {"model." + n: b.clone() for n, b in model.named_buffers()}  # BatchNorm statistics stay as they are
        devices = [old[0].device] if old and old[0].is_cuda else []
        # SDPA's fused kernels have neither forward-mode nor double-backward rules; the math backend computes the
        # same attention from differentiable primitives.
        # Dropout masks drawn here leave the training's random stream alone.
        with torch.random.fork_rng(devices=devices), pend["paused"](), sdpa_kernel(SDPBackend.MATH):
            rng = torch.get_rng_state()
            cuda_rng = torch.cuda.get_rng_state() if devices else None
            z, jts = _jvps(call, ["model." + n for n in names], [old[i] for i in keep], buffers, tangents)
            hjts = _loss_hvps(loss, z, jts)
            old_loss = loss(z).detach().double().reshape(()) if self.adapt_damping else None
        # [u C u, u C d, d C d]: the only per-rank numbers (each rank's batch), averaged across ranks
        curv = [_dot([jts[0]], [hjts[0]])]
        if prev is not None:
            curv += [_dot([jts[0]], [hjts[1]]), _dot([jts[1]], [hjts[1]])]
        c = pend["average"](torch.stack(curv)).cpu()
        scale = pend["loss_scale"]
        g = [grads[i] for i in keep]
        uk = [u[i] for i in keep]
        gu = float(_dot(g, uk)) / scale
        uu = float(_dot(uk, uk))
        self.measurements += 1
        terms: dict[str, Any] = {"curv": [float(x) for x in c], "gu": gu, "gd": 0.0, "old_loss": old_loss,
                                 "call": call, "rng": rng, "cuda_rng": cuda_rng, "devices": devices}
        if prev is None:
            if self.mode is not None:
                self._solve_alpha(gu, float(c[0]) + lam * uu)
            self.mu = 0.0
            return terms
        pk = [prev[i] for i in keep]
        gd, ud, dd = float(_dot(g, pk)) / scale, float(_dot(uk, pk)), float(_dot(pk, pk))
        terms["gd"] = gd
        m = [[float(c[0]) + lam * uu, float(c[1]) + lam * ud], [float(c[1]) + lam * ud, float(c[2]) + lam * dd]]
        det = m[0][0] * m[1][1] - m[0][1] ** 2
        if not (math.isfinite(det) and det > 1e-12 * max(m[0][0] * m[1][1], 1e-300)):
            self._solve_alpha(gu, m[0][0])
            self.mu = 0.0
            return terms
        alpha = -(m[1][1] * gu - m[0][1] * gd) / det
        mu = -(m[0][0] * gd - m[0][1] * gu) / det
        if not 0.0 <= mu <= MU_MAX:  # the minimizer on the edge of mu's range: alpha re-solved with mu held there
            mu = min(max(mu, 0.0), MU_MAX)
            alpha = -(gu + mu * m[0][1]) / m[0][0]
        lo, hi = self.clip
        self.alpha = min(max(alpha, lo), hi)
        self.mu = mu
        return terms

    def _solve_alpha(self, gu: float, quad: float) -> None:
        lo, hi = self.clip
        if not (math.isfinite(quad) and math.isfinite(gu)) or quad <= 0.0:
            self._warn_once("curvature", f"step_size={self.mode!r}: the loss has no positive curvature along the "
                            f"update (u^T C u + damping |u|^2 = {quad:.3g}), so this measurement keeps alpha="
                            f"{self.alpha:.3g}; the rule needs a loss convex in the model's outputs (cross-entropy, "
                            "MSE, ...), returned by kfac_loss_parts")
            return
        alpha = -gu / quad
        self.alpha = min(max(alpha, lo), hi)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=3)

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        state = {"mode": self.mode, "alpha": self.alpha, "mu": self.mu, "measurements": self.measurements,
                 "prev": dict(self.prev)}
        if self.damping is not None:
            state["damping"] = self.damping
        return state

    def load_state_dict(self, state: dict[str, Any], params: dict[str, nn.Parameter]) -> None:
        self.alpha = float(state["alpha"])
        self.mu = float(state["mu"])
        self.measurements = int(state["measurements"])
        self.damping = float(state["damping"]) if state.get("damping") is not None else None
        if self.damping is not None and self.adapt_damping and self.on_damping is not None:
            self.on_damping(self.damping)
        self.prev = {n: t.to(device=params[n].device, dtype=params[n].dtype).clone()
                     for n, t in (state.get("prev") or {}).items() if n in params}
        self._pending = None


def check_step_size_state(state: object) -> list[str]:
    """Problems of a saved ``step_size`` entry (empty when it is well formed)."""
    if not isinstance(state, dict):
        return [f"step_size: expected a dict, got {type(state).__name__}"]
    problems = []
    for key, kind in (("alpha", float), ("mu", float), ("measurements", int), ("damping", float)):
        if key == "damping" and state.get(key) is None:
            continue
        value = state.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(float(value)):
            problems.append(f"step_size.{key}: expected a finite {kind.__name__}, got {value!r}")
    prev = state.get("prev", {})
    if not isinstance(prev, dict) or not all(isinstance(t, torch.Tensor) for t in prev.values()):
        problems.append("step_size.prev: expected a dict of tensors")
    return problems
