"""Preconditioning of a step: P = G_inv [dW, db] A_inv per layer (or its eigen form), exchanged from each
layer's owner under distributed preconditioning, grafted, KL-clipped and written back to the gradients, for the
layers the stepping optimizer holds.

:class:`Preconditioning` is a part of :class:`~lightning_spdkfac.kfac.KFACPreconditioner`; the math is in
docs/math.md.
"""

from __future__ import annotations

import torch

from .. import validation as val
from . import factors
from .core import Core
from .eigenbasis import EigenMoments
from .gradients import check_grad_shape
from .grafting import DEFAULT_BETA2, DEFAULT_EPS, AdamGraftState, graft
from .inverse import eigen_precondition
from .layer_state import KFACLayer
from .param_groups import StepGroups, step_groups
from .sharded import OwnerShardedAccess


class Preconditioning:
    """A part of the preconditioner that owns the step's preconditioning: which layers the stepping optimizer holds and
    at which learning rates, the P of the step until its KL clip is known, the exchange of P under distributed
    preconditioning, and grafting's second moments."""

    def __init__(self, core: Core) -> None:
        self.core = core
        # index -> (layer, P, its gradient matrix), kept until the KL clip of the step is known; or, for a layer whose
        # P was written through to its gradient at once (see _write_through), (layer, None, its p.g for the KL clip).
        self._preconditioned: dict[int, tuple[KFACLayer, torch.Tensor | None, torch.Tensor]] = {}
        # The layers the optimizer given to step() steps (layer index -> its param group's lr), or None: every layer,
        # at ``lr``. ``step_groups`` caches, per optimizer (by id; each entry holds its optimizer), which group holds
        # each layer: several optimizers stepping in turn do not rebuild it every step.
        self.stepping: dict[int, float] | None = None
        self.step_groups: dict[int, StepGroups] = {}
        # Distributed preconditioning: while a step exchanges the preconditioned gradients, each exchanged layer and
        # its gradient; and received layers whose owner may have sent nothing (0-dim device flags, read on no host:
        # the gradient is kept where a flag is false).
        self._shared_grads: dict[int, tuple[KFACLayer, torch.Tensor]] = {}
        self._unsure: dict[int, torch.Tensor] = {}
        # grafting="adam": each layer's second moment (by layer index); (beta2, eps) of the stepping optimizer.
        self.graft_states: dict[int, AdamGraftState] = {}
        self._graft_hparams = (DEFAULT_BETA2, DEFAULT_EPS)
        self.skipped_precondition_steps = 0  # steps left unpreconditioned: non-finite gradients
        # update="eigen_adam": each layer's second moment in its Kronecker eigenbasis (kfac/eigenbasis.py).
        o = core.options
        self.eigen_moments = EigenMoments(o.eigen_beta2, o.eigen_eps) if o.update == "eigen_adam" else None

    def precondition_layer(self, layer: KFACLayer) -> None:
        """P = G_inv [dW, db] A_inv (or its eigen form) for one layer, kept until the KL clip of the step is known."""
        # Not whether this rank ran the layer, which is local (data-dependent control flow): the gradient,
        # the inverses and the optimizer's groups are the same on every rank; deciding on them keeps every
        # rank preconditioning the same layers, and the KL clip the same sum.
        core = self.core
        if layer.index in self._preconditioned or layer.A_inv is None or not core.grads_finite:
            return
        if isinstance(core.grad_access, OwnerShardedAccess):  # FSDP2 hook: precondition_owned does it (sharded.py)
            return
        g = self._step_grad(layer)
        if g is None:
            return
        assert layer.G_inv is not None  # the inverses are set together (both arrive before this is called)
        # The last dim: n for an n x n inverse, an (n+1) x n eigen payload and a diagonal one alike.
        check_grad_shape(layer, "gradient matrix", tuple(g.shape[-2:]), (layer.G_inv.shape[-1], layer.A_inv.shape[-1]))
        gi = g.to(core.inv_dtype)
        p = self.direction(layer, gi)
        if self._write_through(g):
            # P goes to the gradient now and the step keeps p.g only: P of every layer at once, as many bytes as the
            # layers' weights, is not held until the end of the step (the summary's peak). The KL clip's scale, known
            # at the end, multiplies the gradient in place then: the same one rounding of P * scale as before.
            dot = torch.vdot(p.flatten(), gi.flatten()) if core.kl_clip is not None else p.new_zeros(())
            layer.helper.write_grad(p, None, core.grads)
            self._preconditioned[layer.index] = (layer, None, dot)
            return
        self._preconditioned[layer.index] = (layer, p, gi)
        if core.owners is not None:  # its broadcast starts now, while the next layer is worked on
            core.sharing().offer(layer.index, p)

    def direction(self, layer: KFACLayer, gi: torch.Tensor) -> torch.Tensor:
        """P of the layer's gradient matrix ``gi`` (in inv_dtype): G_inv gi A_inv, its eigen form, or the eigenbasis
        mode's (kfac/eigenbasis.py); the layer holds both inverses."""
        assert layer.A_inv is not None and layer.G_inv is not None
        if self.eigen_moments is not None:
            return self.eigen_moments.direction(layer, gi)
        if self.core.eigen:
            assert layer.inv_damping is not None  # set with the payloads
            return eigen_precondition(gi, layer.A_inv, layer.G_inv, layer.inv_damping)
        return factors.apply_inverses(layer.G_inv, gi, layer.A_inv)

    def _write_through(self, g: torch.Tensor) -> bool:
        """Whether a layer's P is written to its gradient as soon as it is computed: on one process (distributed
        preconditioning sends P), without grafting (which needs every P and gradient at the end), and where the
        gradient has the inversion dtype (P is then written exactly, and scaled in place later with the rounding
        it had before; another dtype would round P twice)."""
        return self.core.owners is None and self.core.options.grafting is None and g.dtype == self.core.inv_dtype

    def _step_grad(self, layer: KFACLayer) -> torch.Tensor | None:
        """The layer's gradient matrix if this step may precondition it, else None; decided on what every rank
        sees alike (the optimizer's groups, requires_grad, the reduced gradient)."""
        if self.stepping is not None and layer.index not in self.stepping:
            return None  # another optimizer (or none) steps this layer
        if not layer.trainable():  # frozen after its forward: its (stale or absent) gradient is left as is
            return None
        weight = layer.helper.params()[0]
        wg = self.core.grads.get(weight)
        if wg is not None:  # (a flat shard would read as an (n, 1) matrix: refused by name, never skipped)
            check_grad_shape(layer, "weight's gradient", tuple(wg.shape), tuple(weight.shape))
        return layer.helper.grad_matrix(self.core.grads)

    def begin_share(self) -> None:
        """Distributed preconditioning: name the layers whose P this step exchanges (those _step_grad admits, so
        every P an owner computes is in the round), keeping their gradients for _gather_preconditioned."""
        self._shared_grads = {}
        for layer in self.core.layers.values():
            g = self._step_grad(layer)
            if g is not None:
                self._shared_grads[layer.index] = (layer, g)
        self.core.sharing().begin_share(list(self._shared_grads))

    def _gather_preconditioned(self) -> None:
        """Distributed preconditioning: every exchanged layer's P from its owner (the owner's own tensor here)."""
        sharing = self.core.sharing()
        shared = sharing.finish_share()
        flags = sharing.share_flags()
        for index, p in shared.items():
            if p is not None and index not in self._preconditioned:
                layer, g = self._shared_grads[index]
                self._preconditioned[index] = (layer, p, g.to(self.core.inv_dtype))
                if index in flags:
                    self._unsure[index] = flags[index]
        self._shared_grads = {}

    def precondition(self, k: int) -> None:
        for layer in self.core.layers.values():
            self.precondition_layer(layer)
        if self.core.owners is not None:
            self._gather_preconditioned()
        done, self._preconditioned = self._preconditioned, {}
        unsure, self._unsure = self._unsure, {}
        if not done:
            return
        # Layer order, not arrival order: the KL sum must add up in the same order on every rank
        # (arrival order depends on which inverses a rank owns), or the replicas drift apart.
        todo, precs, grads = zip(*(done[i] for i in sorted(done)))
        if self.core.options.grafting is not None:  # (no P is written through with grafting: every one is here)
            states = ([self.graft_states.setdefault(ly.index, AdamGraftState()) for ly in todo]
                      if self.core.options.grafting == "adam" else None)
            beta2, eps = self._graft_hparams
            precs = tuple(graft(self.core.options.grafting, precs, grads, states, beta2, eps))
        flags = [unsure.get(ly.index) for ly in todo]
        if unsure:  # dpkfac: where a layer's owner sent nothing, its gradient stays as it is, out of the KL sum
            precs = tuple(p if f is None else torch.where(f, p, g) for p, g, f in zip(precs, grads, flags))
        scale = None
        if self.core.kl_clip is not None:
            # (a P written through left its p.g in place of its gradient matrix)
            dots = [g if p is None else torch.vdot(p.flatten(), g.flatten()) for p, g in zip(precs, grads)]
            scale = self.kl_scale(k, todo, dots, flags if unsure else None)
        for layer, p, f in zip(todo, precs, flags):
            if p is None:  # already in the gradient: scaled in place (its matrix is a view of it, or one copy)
                if scale is not None:
                    layer.helper.write_grad(layer.helper.grad_matrix(self.core.grads), scale, self.core.grads)
                continue
            layer.helper.write_grad(p, scale if f is None or scale is None else torch.where(f, scale, 1.0),
                                    self.core.grads)

    def kl_scale(self, k: int, layers: tuple[KFACLayer, ...], dots_of: list[torch.Tensor],
                  flags: list[torch.Tensor | None] | None = None) -> torch.Tensor:
        """nu = min(1, sqrt(kl_clip / sum_l lr_l^2 p_l.g_l)), each layer at its own learning rate; no host sync.

        In float64: an extreme learning rate (1e20) squared overflows float32 to inf, which would
        clip the update to zero instead of bounding it.
        """
        core = self.core
        assert core.kl_clip is not None  # (called only with the clip on)
        kl_clip = val.resolve("kl_clip", core.kl_clip, k, val.POSITIVE)
        dots = torch.stack(dots_of).double()  # p_l.g_l of each layer
        if flags is not None:  # layers whose owner sent nothing (dpkfac) are out of the sum (where, not a product:
            # an inf gradient's dot times 0 would be NaN)
            keep = torch.stack([torch.ones((), dtype=torch.bool, device=dots.device) if f is None
                                else f.to(dots.device) for f in flags])
            dots = torch.where(keep, dots, torch.zeros((), dtype=dots.dtype, device=dots.device))
        # Gradients still carrying a loss scale S give S^2 times the true p.g.
        unscale = 1.0 / core.grad_access.loss_scale() ** 2
        if core.lr is not None or self.stepping is None:
            assert core.lr is not None  # step() refused a step with neither
            lr = val.resolve("lr", core.lr, k, val.NONNEGATIVE)
            vg = dots.sum().abs() * (lr * lr * unscale)
        else:
            vg = (dots * _lr_weights(self.stepping, layers, unscale, dots)).sum().abs()
        # vg == 0 (lr 0, zero gradients) gives inf -> 1.
        return torch.sqrt(kl_clip / vg).clamp(max=1.0).to(core.inv_dtype)

    def select(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Which layers this step preconditions, at which learning rates (``_stepping``)."""
        if optimizer is None:
            if self.core.kl_clip is not None and self.core.lr is None:
                raise ValueError(
                    "KFACPreconditioner: the KL clip needs the learning rate of each step; call "
                    "step(optimizer) with the optimizer about to step (each layer then uses its param group's "
                    "lr), or pass lr= (a number or a callable of the step), or kl_clip=None")
            self.stepping = None
            self._graft_hparams = (DEFAULT_BETA2, DEFAULT_EPS)
            return
        if self.core.options.grafting == "adam":  # Adam's beta2 and eps, when the optimizer has them
            group0 = optimizer.param_groups[0] if getattr(optimizer, "param_groups", None) else {}
            betas, eps = group0.get("betas"), group0.get("eps")
            self._graft_hparams = ((float(betas[1]), float(eps)) if isinstance(betas, (tuple, list)) and eps is not None
                                   else (DEFAULT_BETA2, DEFAULT_EPS))
        groups = self.step_groups.get(id(optimizer))
        if groups is None or not groups.current(optimizer):
            layers = [(ly.index, ly.name, ly.helper.params()) for ly in self.core.layers.values()]
            groups = self.step_groups[id(optimizer)] = step_groups(optimizer, layers)
        self.stepping = groups.lrs()


def _lr_weights(lrs: dict[int, float], layers: tuple[KFACLayer, ...], unscale: float,
                like: torch.Tensor) -> torch.Tensor:
    """The KL clip's per-layer weights lr_l^2 / S^2 as a float64 tensor on ``like``'s device, filled there
    (:func:`~lightning_spdkfac.kfac.factors.fill_runs`: no host-to-device copy), the values built on the host."""
    weights = torch.empty(len(layers), dtype=torch.float64, device=like.device)
    return factors.fill_runs(weights, [lrs[ly.index] ** 2 * unscale for ly in layers])
