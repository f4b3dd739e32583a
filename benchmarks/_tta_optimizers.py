"""The baselines of benchmarks/time_to_accuracy.py beyond SGD and AdamW: Muon, SOAP and Shampoo.

Each takes one peak ``lr`` (the one the benchmark sweeps) and ``weight_decay`` (decoupled, the workload's AdamW
value); the benchmark's schedule (a ``LambdaLR`` on every group) goes on top, as for SGD and AdamW.

* ``muon``: ``torch.optim.Muon`` on the hidden weight matrices, ``torch.optim.AdamW`` on the rest, as one
  optimizer (:class:`MuonWithAdamW`) that one schedule drives. Muon gets every parameter of 2 or more dimensions
  (Linear, packed attention, ``transformers``' ``Conv1D`` and convolution weights, the last seen as
  ``(out, in/groups * kh * kw)``) except embeddings (and a head tied to one), the output layer (the module's
  ``muon_output_layer()``, else the last ``nn.Linear``) and depthwise filters (flattened they would be a
  matrix of unrelated channels). ``adjust_lr_fn="match_rms_adamw"`` (Moonshot, "Muon is Scalable for LLM
  Training") gives Muon about AdamW's update RMS, so both share the one swept lr. Momentum 0.95, Nesterov.
* ``soap``: ``heavyball.SOAP`` (Vyas et al. 2024) at heavyball's defaults but lr and weight decay.
* ``shampoo``: ``heavyball.KLShampoo`` (Lin et al. 2025), heavyball 3.2.1's only Shampoo, likewise.

heavyball (a dev extra pinned in pyproject.toml) compiles its kernels with ``torch.compile`` unless told not to:
:func:`heavyball_module` turns that off (minutes of inductor work would land in the first timed steps on a CPU,
and the SGD and AdamW it is compared with are eager).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

BASELINE_OPTIMIZERS = ("sgd", "adamw", "muon", "soap", "shampoo")
KFAC_BASE_OPTIMIZERS = ("sgd", "adamw")  # what K-FAC is put on top of in the benchmark (issue 27's first target)


def heavyball_module() -> Any:
    """``heavyball``, imported with torch.compile off (see the module docstring)."""
    import heavyball

    heavyball.utils.compile_mode = None  # eager kernels: no torch.compile anywhere in heavyball
    # The benchmark's LambdaLR changes the lr every step; heavyball supports that with multi_tensor=True (its
    # default, kept here) and warns once that it is "experimental".
    warnings.filterwarnings("ignore", "Learning rate changed between steps", UserWarning)
    return heavyball


def default_output_layer(module: nn.Module) -> nn.Module | None:
    """The last ``nn.Linear`` in module order (the classifier / decoder / LM head of the benchmark's models)."""
    return next((m for m in reversed(list(module.modules())) if isinstance(m, nn.Linear)), None)


def _is_depthwise(m: nn.Module) -> bool:
    return isinstance(m, nn.Conv1d | nn.Conv2d | nn.Conv3d) and m.groups > 1 and m.groups == m.in_channels


def split_muon_params(module: nn.Module, params: Iterable[nn.Parameter] | None = None
                      ) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's parameters, AdamW's parameters) of ``module`` (of ``params`` only, when given), each parameter once.

    See the module docstring for the rule. The output layer is ``module.muon_output_layer()`` where the module
    defines it, else :func:`default_output_layer`.
    """
    head = module.muon_output_layer() if hasattr(module, "muon_output_layer") else default_output_layer(module)
    excluded: set[int] = set()
    if head is not None:
        excluded |= {id(p) for p in head.parameters()}
    for m in module.modules():
        if isinstance(m, nn.Embedding) or _is_depthwise(m):
            excluded |= {id(p) for p in m.parameters(recurse=False)}
    chosen = set() if params is None else {id(p) for p in params}
    muon, adamw, seen = [], [], set()
    for p in module.parameters():  # module order; a tied weight once
        if id(p) in seen or not p.requires_grad or (params is not None and id(p) not in chosen):
            continue
        seen.add(id(p))
        (muon if p.dim() >= 2 and id(p) not in excluded else adamw).append(p)
    return muon, adamw


class MuonWithAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` on some parameters and ``torch.optim.AdamW`` on the others, as one optimizer.

    ``param_groups`` are AdamW's group dicts themselves and, for Muon, one dict per Muon group holding the
    *parameters themselves* (what a caller looking a parameter up by identity, as K-FAC's KL clip does for its
    lr, must find) with the group's hyperparameters; :meth:`step` copies those hyperparameters (the lr an lr
    scheduler set, the weight decay) into Muon's own groups before stepping, so one schedule drives both.
    Parameters with more than 2 dimensions (convolution filters) are given to Muon as 2-D views ``(out, -1)``
    of their storage (``torch.optim.Muon`` takes matrices only); their gradients are viewed the same way
    before each step.

    Args:
        muon_groups: param groups (dicts with ``params`` and optionally ``weight_decay``) for Muon.
        adamw_groups: param groups for AdamW.
        lr: the peak lr of both (Muon with ``adjust_lr_fn="match_rms_adamw"``, so the same number suits both).
        weight_decay: the default decoupled weight decay of both.
        betas: AdamW's betas.
    """

    def __init__(self, muon_groups: list[dict], adamw_groups: list[dict], lr: float, weight_decay: float,
                 betas: tuple[float, float] = (0.9, 0.999), adjust_lr_fn: str = "match_rms_adamw") -> None:
        self._views: list[tuple[nn.Parameter, torch.Tensor]] = []
        muon_groups = [{**g, "params": list(g["params"])} for g in muon_groups]
        mgroups = []
        for g in muon_groups:
            ps = []
            for p in g["params"]:
                if p.dim() == 2:
                    ps.append(p)
                else:  # a 2-D leaf sharing p's storage: Muon's in-place update writes p
                    v = p.detach().view(p.shape[0], -1)
                    self._views.append((p, v))
                    ps.append(v)
            if ps:
                mgroups.append({**g, "params": ps})
        agroups = [g for g in adamw_groups if list(g["params"])]
        self.muon = torch.optim.Muon(mgroups, lr=lr, weight_decay=weight_decay, adjust_lr_fn=adjust_lr_fn) \
            if mgroups else None
        self.adamw = torch.optim.AdamW(agroups, lr=lr, weight_decay=weight_decay, betas=betas) if agroups else None
        if self.muon is None and self.adamw is None:
            raise ValueError("MuonWithAdamW got no parameters")
        # Muon's groups as the outer optimizer shows them: the original parameters (not the 2-D views)
        originals = [[p for p in g["params"] if p.dim() >= 2] for g in muon_groups]
        self._muon_outer = [{**inner, "params": ps} for inner, ps in
                            zip(self.muon.param_groups if self.muon else [], [o for o in originals if o], strict=True)]
        super().__init__([*self._muon_outer, *(self.adamw.param_groups if self.adamw else [])], {"lr": lr})
        # torch.optim.Optimizer.__init__ re-makes the dicts it is given: keep the ones it holds
        self._muon_outer = self.param_groups[:len(self._muon_outer)]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # noqa: D102
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for p, v in self._views:
            v.grad = None if p.grad is None else p.grad.view(v.shape)
        for outer, inner in zip(self._muon_outer, self.muon.param_groups if self.muon else [], strict=True):
            inner.update({k: v for k, v in outer.items() if k != "params"})  # the scheduler's lr, and the rest
        for o in (self.muon, self.adamw):
            if o is not None:
                o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: D102
        super().zero_grad(set_to_none)  # the parameters themselves, filters included
        for _, v in self._views:  # the views' gradients are views of the filters' (set again at every step)
            v.grad = None


def optimizer_class(name: str) -> type:
    """The class :func:`build_optimizer` builds for ``name`` (heavyball imported for SOAP and Shampoo)."""
    if name in ("soap", "shampoo"):
        hb = heavyball_module()
        return hb.SOAP if name == "soap" else hb.KLShampoo
    classes = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW, "muon": MuonWithAdamW}
    if name not in classes:
        raise ValueError(f"unknown optimizer {name!r}; known: {BASELINE_OPTIMIZERS}")
    return classes[name]


def build_optimizer(module: nn.Module, name: str, lr: float, weight_decay: float,
                    groups: list[dict] | None = None, betas: tuple[float, float] | None = None,
                    momentum: float = 0.9) -> torch.optim.Optimizer:
    """The benchmark optimizer ``name`` at peak ``lr`` over ``groups`` (default: one group of every trainable
    parameter at ``weight_decay``; a group's own ``weight_decay`` wins). ``betas``: Adam's (default torch's for
    AdamW and Muon's AdamW, heavyball's for SOAP and Shampoo); ``momentum``: SGD's."""
    if groups is None:
        groups = [{"params": [p for p in module.parameters() if p.requires_grad]}]
    groups = [{**g, "params": list(g["params"])} for g in groups]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, **({"betas": betas} if betas else {}))
    if name == "muon":
        mg, ag = [], []
        for g in groups:
            m, a = split_muon_params(module, g["params"])
            mg.append({**g, "params": m})
            ag.append({**g, "params": a})
        return MuonWithAdamW(mg, ag, lr=lr, weight_decay=weight_decay, **({"betas": betas} if betas else {}))
    if name in ("soap", "shampoo"):
        return optimizer_class(name)([g for g in groups if g["params"]], lr=lr, weight_decay=weight_decay,
                                     compile_step=False, **({"betas": betas} if betas else {}))
    raise ValueError(f"unknown optimizer {name!r}; known: {BASELINE_OPTIMIZERS}")
