"""The K-FAC summary: what K-FAC preconditions, the layout and memory of every block, and every trainable parameter
it leaves to the optimizer, with the reason and its share of the model.

Built from the registered layers before anything is allocated (the factors are allocated on the first step), so
that a model whose K-FAC state cannot fit stops at setup (``memory_limit``) instead of being killed for memory.
The bytes are those the preconditioner allocates (tests/test_summary.py checks them against the tensors it holds):

* factors: the running A and G, and the step's accumulators (the Gram sums and, with a bias, the input sum), in
  ``factor_dtype``;
* inverses: A and G inverted (or their eigen payloads), in ``inv_dtype``;
* async: with ``async_inverses``, the inverses being computed while the held ones are used (one more set);
* under ``schedule="dpkfac"`` a rank holds the running factors and inverses of the layers it owns only (the
  accumulators of every layer: each rank collects its own statistics); the totals are this rank's. On FSDP2's
  owner-based path (kfac/sharded.py) the other ranks' layers' accumulators are dropped once their factors were
  reduced: they count in the workspace of the factor update and of the inversions (held from the first forward
  of a factor step until it preconditions), not between steps.

Those are the steady state (:attr:`KFACSummary.steady_bytes`): what is held between steps. A step allocates more
for a while (:attr:`KFACSummary.peak_bytes`, the most an inverse step holds at once), from the same layouts:

* the inversion's workspace (:func:`~lightning_spdkfac.kfac.inverse_memory.inversion_workspace`): the stacks of one group
  of equal-shaped factors at a time, LAPACK's eigendecomposition work arrays and one inverse-sized temporary. The
  new inverses are written into the held ones (no second set), except with ``async_inverses``, whose second set is
  the ``Async`` column already;
* the preconditioning's: each layer's gradient matrix (a copy when it has a bias or another dtype) and the
  matrix products' temporaries, one layer at a time where P is written to the gradient at once (one process, no
  grafting, gradients in ``inv_dtype``), else every layer's P and gradient matrix until the step's KL clip;
* the factor update's: one factor-sized temporary (the subnormal flush).

On one process with inverses on the caller's thread these come one after the other (the peak is the largest); with
``async_inverses`` or a distributed schedule the inversions overlap the preconditioning (the peak is their sum).
Not counted: the fallback levels (factor by factor, where Cholesky fails), the communication buffers of the
distributed schedules (one fusion group of factors or inverses), and everything outside K-FAC (model, optimizer,
activations).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..factor_shapes import FactorShape, describe, inverse_shape, numel, preconditioned_shape
from .inverse_memory import inversion_workspace
from .sharded import frees_accumulators, summary_line

# Why the trainable rest of a partly frozen layer is left to the optimizer (summary and setup warning).
FROZEN_PART = ("some of its parameters are frozen: K-FAC preconditions a layer's weight and bias together, so the "
               "trainable rest (e.g. a bias beside a frozen weight) is left to the optimizer (unfreeze the whole layer "
               "to have it preconditioned)")

if TYPE_CHECKING:  # (the preconditioner imports this module)
    from .layer_state import KFACLayer
    from .preconditioner import KFACPreconditioner

__all__ = ["KFACSummary", "LayerRow", "LeftOut", "format_bytes", "summarize"]

# Modules whose parameters stay with the optimizer by design (docs/math.md, "What K-FAC leaves to the optimizer"):
# matched by class name so that every library's norms count (RMSNorm of transformers, Llama, T5, apex ...).
_NORM_WORDS = ("norm",)


@dataclass(frozen=True)
class LayerRow:
    """One K-FAC block."""

    name: str
    kind: str  # the module type
    a_shape: FactorShape
    g_shape: FactorShape
    params: int
    factor_bytes: int
    inverse_bytes: int
    async_bytes: int
    owner: int | None  # schedule="dpkfac": the rank that holds its factors and inverses

    def held_bytes(self, rank: int | None) -> int:
        """Bytes this block takes on ``rank`` between steps (every rank without dpkfac)."""
        if self.owner is None or rank is None or self.owner == rank:
            return self.factor_bytes + self.inverse_bytes + self.async_bytes
        return 0 if self.accumulators_dropped else self.accumulator_bytes

    accumulator_bytes: int = 0  # (included in factor_bytes) the step's sums, held on every rank
    # False: the block produced no factors though its weight got a gradient (measured; its parameters are listed
    # among those left to the optimizer, with the reason, and not counted as preconditioned)
    factored: bool = True
    # True: its calls come (also) from functions given its weight (kfac/capture.py): F.linear, matmul, an expert stack
    captured: bool = False
    # FSDP2's owner-based path: on a rank that does not own the block, its accumulators are dropped after the reduce
    accumulators_dropped: bool = False


@dataclass(frozen=True)
class LeftOut:
    """A trainable parameter K-FAC does not precondition."""

    name: str
    kind: str
    params: int
    reason: str


@dataclass(frozen=True)
class Workspace:
    """Bytes a step allocates on top of the steady state, per phase (see the module docstring)."""

    factors: int = 0  # the factor update
    inverses: int = 0  # an inverse step's inversions
    precondition: int = 0  # the preconditioning (every step)
    overlapped: bool = False  # the inversions run while layers are preconditioned (async, distributed)

    @property
    def peak(self) -> int:
        if self.overlapped:
            return max(self.factors, self.inverses + self.precondition)
        return max(self.factors, self.inverses, self.precondition)


@dataclass(frozen=True)
class KFACSummary:
    rows: tuple[LayerRow, ...]
    left_out: tuple[LeftOut, ...]
    trainable: int  # trainable parameters of the model (each once)
    rank: int | None  # the rank the totals are for (dpkfac), None: every rank holds everything
    workspace: Workspace = Workspace()
    graft_bytes: int = 0  # grafting="adam" / update="eigen_adam": the moments held between steps
    sharding: str | None = None  # FSDP2 (kfac/sharded.py): how the sharded gradients are preconditioned

    @property
    def preconditioned(self) -> int:
        return sum(r.params for r in self.rows if r.factored)

    @property
    def total_bytes(self) -> int:
        """K-FAC memory of this rank: every block it holds, as allocated (the steady state)."""
        return sum(r.held_bytes(self.rank) for r in self.rows) + self.graft_bytes

    @property
    def steady_bytes(self) -> int:
        """What this rank holds between steps: factors, accumulators, inverses and the async set."""
        return self.total_bytes

    @property
    def peak_bytes(self) -> int:
        """The most this rank holds at once during an inverse step: the steady state and the step's workspace
        (what ``memory_limit`` bounds)."""
        return self.total_bytes + self.workspace.peak

    def __str__(self) -> str:
        return format_summary(self)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def _full_numel(p: nn.Parameter) -> int:
    """The parameter's entries; DeepSpeed ZeRO-3 leaves a partitioned one empty outside forward (``ds_numel``: all)."""
    return int(getattr(p, "ds_numel", p.numel()))


def _layer_bytes(ly: KFACLayer, factor_size: int, inv_size: int, method: str, async_inverses: bool
                 ) -> tuple[int, int, int, int]:
    a, g = ly.a_shape, ly.g_shape
    acc = numel(ly.xx_shape()) + numel(g)
    if ly.keeps_x_sum:  # the input sum, per group for a grouped A (a diagonal A keeps no off-diagonal bias column)
        acc += numel(a[:-2]) * ly.helper.in_features
    factors = (numel(a) + numel(g)) * factor_size + acc * factor_size
    inverses = (numel(inverse_shape(a, method)) + numel(inverse_shape(g, method))) * inv_size
    return factors, inverses, inverses if async_inverses else 0, acc * factor_size


def summarize(pre: KFACPreconditioner) -> KFACSummary:
    """The summary of ``pre`` (see the module docstring)."""
    f_size = torch.empty(0, dtype=pre.factor_dtype).element_size()
    i_size = torch.empty(0, dtype=pre.inv_dtype).element_size()
    owners = pre.distributor.layer_owners
    async_inverses = pre.distributor.use_async_inverses()
    dropped = frees_accumulators(pre.grad_access)
    rows = []
    counted: set[int] = set()
    unfactored: dict[int, str] = {}  # parameter id -> why its block produced no factors (kfac/coverage.py)
    for ly in pre.layers.values():
        if not ly.trainable():  # frozen (distributed: registered at setup all the same): no factors, not counted
            continue
        why = pre.unfactored.get(ly.name)
        if why is None:
            counted.update(id(p) for p in ly.helper.params())
        else:
            unfactored.update((id(p), why) for p in ly.helper.params())
        # The block's own entries (a packed attention weight's q, k and v rows are three blocks of it).
        params = ly.helper.out_features * ly.helper.a_dim * ly.helper.groups
        fb, ib, ab, acc = _layer_bytes(ly, f_size, i_size, pre.inverse_method, async_inverses)
        rows.append(LayerRow(ly.name, type(ly.helper.owner()).__name__, ly.a_shape, ly.g_shape, params, fb, ib, ab,
                             None if owners is None else owners[ly.index], acc, why is None,
                             ly.name in pre.capture.layers, dropped))
    left = _left_out(pre, counted, unfactored)
    trainable = sum(_full_numel(p) for p in {id(p): p for p in pre.model.parameters() if p.requires_grad}.values())
    rank = None if owners is None else pre.distributor.rank
    return KFACSummary(tuple(rows), tuple(left), trainable, rank, _workspace(pre, rows, rank, async_inverses),
                       _graft_bytes(pre), summary_line(pre.grad_access, format_bytes))  # (FSDP2 hook: kfac/sharded.py)


# The preconditioning's temporaries of one layer, in P's size: G^-1 g and P (kfac/factors.py apply_inverses; one
# where A is diagonal: P is G^-1 g scaled in place); with eigen payloads the damped eigenvalue products, the rotated
# gradient and its next rotation, one more per dense side (kfac/inverse.py eigen_precondition, measured in
# tests/test_memory_peak.py).
_APPLY_TEMPS = 2
# grafting="adam": float64 temporaries of one layer's size at once while its moment is updated and its direction's
# norm taken (kfac/grafting.py AdamGraftState.direction_norm, measured in tests/test_memory_peak.py).
_ADAM_GRAFT_TEMPS = 5


def _workspace(pre: KFACPreconditioner, rows: list[LayerRow], rank: int | None, async_inverses: bool) -> Workspace:
    """What a step allocates beyond the steady state, from the layouts (see the module docstring)."""
    layers = [ly for ly in pre.layers.values() if ly.trainable()]
    if not layers:
        return Workspace()
    f_size = torch.empty(0, dtype=pre.factor_dtype).element_size()
    i_size = torch.empty(0, dtype=pre.inv_dtype).element_size()
    mine = [ly for ly, r in zip(layers, rows) if r.owner is None or rank is None or r.owner == rank]
    # The factor update: |F| and its mask (the subnormal flush), one factor at a time. Where the other ranks' layers'
    # accumulators are dropped between steps (FSDP2's owner path), they are held from a factor step's first forward
    # until the step preconditions, after the inversions: counted in both.
    foreign = sum(r.accumulator_bytes for r in rows if r.accumulators_dropped and r.owner != rank)
    factors = max((numel(s) * (f_size + 1) for ly in mine for s in (ly.a_shape, ly.g_shape)), default=0) + foreign
    cpu = all(ly.helper.params()[0].device.type == "cpu" for ly in mine)
    inverses = inversion_workspace([s for ly in mine for s in (ly.a_shape, ly.g_shape)], pre.inverse_method,
                                   pre.inv_dtype, cpu=cpu) + foreign
    held = most = 0
    for ly in layers:  # every layer: under dpkfac each rank receives every P
        weight = ly.helper.params()[0]
        p_numel = numel(preconditioned_shape(ly.a_shape, ly.g_shape))
        g_size = weight.element_size()
        # The gradient matrix: a copy where the bias is appended, another where it is converted to inv_dtype.
        gi = (p_numel * g_size if ly.helper.has_bias else 0) + (p_numel * i_size if weight.dtype != pre.inv_dtype
                                                                else 0)
        if pre.inverse_method == "eigen":
            temps = _APPLY_TEMPS + sum(len(s) != 1 for s in (ly.a_shape, ly.g_shape))
        else:
            temps = _APPLY_TEMPS - (len(ly.a_shape) == 1)
        most = max(most, held + gi + temps * p_numel * i_size)
        # Where P is not written to the gradient at once (kfac/preconditioning.py _write_through), it and the
        # gradient matrix are kept until the KL clip.
        if not (pre.distributor.layer_owners is None and pre.options.grafting is None
                and weight.dtype == pre.inv_dtype):
            held += gi + p_numel * i_size
    precondition = max(most, held)
    if pre.options.grafting is not None:  # kfac/grafting.py: the grafted P of every layer, beside the P kept
        grafted = sum(numel(preconditioned_shape(ly.a_shape, ly.g_shape)) for ly in layers)
        biggest = max(numel(preconditioned_shape(ly.a_shape, ly.g_shape)) for ly in layers)
        # float64 copies of one layer's P or gradient at a time (sgd: a norm of each; adam: the moment's update)
        temps = biggest * 8 * (1 if pre.options.grafting == "sgd" else _ADAM_GRAFT_TEMPS)
        precondition = max(precondition, held + grafted * i_size + temps)
    overlapped = async_inverses or not pre.distributor.is_local
    return Workspace(factors, inverses, precondition, overlapped)


def _graft_bytes(pre: KFACPreconditioner) -> int:
    """The moments held between steps: grafting="adam"'s second moment of each layer's gradient matrix (float64, every
    layer), and update="eigen_adam"'s second moment in the eigenbasis (inv_dtype) with a copy of the basis it is in
    (the dense sides' eigenvectors; kfac/eigenbasis.py), on the rank that preconditions the layer."""
    total = 0
    if pre.options.grafting == "adam":
        total += sum(numel(preconditioned_shape(ly.a_shape, ly.g_shape)) * 8 for ly in pre.layers.values()
                     if ly.trainable())
    if pre.options.update == "eigen_adam":
        i_size = torch.empty(0, dtype=pre.inv_dtype).element_size()
        owners, rank = pre.distributor.layer_owners, pre.distributor.rank
        for ly in pre.layers.values():
            if ly.trainable() and (owners is None or owners[ly.index] == rank):
                bases = sum(numel(s) for s in (ly.a_shape, ly.g_shape) if len(s) != 1)
                total += (numel(preconditioned_shape(ly.a_shape, ly.g_shape)) + bases) * i_size
    return total


def _left_out(pre: KFACPreconditioner, preconditioned: set[int], unfactored: dict[int, str]) -> list[LeftOut]:
    out = []
    seen = set(preconditioned)
    for mname, module in pre.model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            name = f"{mname}.{pname}" if mname else pname
            why = unfactored.get(id(p)) or _reason(pre, mname, module)
            out.append(LeftOut(name, type(module).__name__, _full_numel(p), why))
    return out


def _reason(pre: KFACPreconditioner, name: str, module: nn.Module) -> str:
    if name in pre.skipped:
        return pre.skipped[name]
    if name in pre.frozen_layers or name in pre.layers:  # the trainable part of a partly frozen layer
        return FROZEN_PART
    cls = type(module).__name__
    if any(w in cls.lower() for w in _NORM_WORDS):
        return "a normalization layer's scale/shift: left to the optimizer (docs/math.md)"
    if any(True for _ in module.children()):
        return f"a parameter {cls} holds itself (layer scale, position or class token, ...): left to the optimizer"
    return f"{cls} is not a layer type K-FAC handles (register_layer_type adds one): left to the optimizer"


def format_summary(s: KFACSummary) -> str:
    """The summary as a table, like Lightning's model summary."""
    head: tuple[str, ...] = ("", "Name", "Type", "A", "G", "Params", "Factors", "Inverses")
    show_async = any(r.async_bytes for r in s.rows)
    show_owner = s.rank is not None
    if show_async:
        head += ("Async",)
    if show_owner:
        head += ("Owner",)
    table = [head]
    for i, r in enumerate(s.rows):
        line: tuple[str, ...] = (str(i), (r.name or "<root>") + ("" if r.factored else " (no factors)") + (" (functions)" if r.captured else ""), r.kind, describe(r.a_shape), describe(r.g_shape), f"{r.params:,}",
                format_bytes(r.factor_bytes), format_bytes(r.inverse_bytes))
        if show_async:
            line += (format_bytes(r.async_bytes),)
        if show_owner:
            line += (str(r.owner),)
        table.append(line)
    widths = [max(len(row[c]) for row in table) for c in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in table]
    lines.insert(1, "-" * len(lines[0]))
    total = max(s.trainable, 1)
    lines.append("-" * len(lines[0]))
    lines.append(f"K-FAC blocks: {len(s.rows)}, preconditioning {s.preconditioned:,} parameters "
                 f"({100 * s.preconditioned / total:.1f}% of {s.trainable:,} trainable)")
    who = f" on rank {s.rank} (dpkfac: its own layers)" if s.rank is not None else ""
    w = s.workspace
    lines.append(f"K-FAC memory{who}: {format_bytes(s.total_bytes)} held between steps, "
                 f"{format_bytes(s.peak_bytes)} at the peak of an inverse step "
                 f"({100 * s.peak_bytes / max(s.total_bytes, 1):.0f}%; workspace: inversions "
                 f"{format_bytes(w.inverses)}, preconditioning {format_bytes(w.precondition)}, factor update "
                 f"{format_bytes(w.factors)}{', the first two at once' if w.overlapped else ''})")
    if s.sharding is not None:
        lines.append(s.sharding)
    if s.left_out:
        left = sum(x.params for x in s.left_out)
        lines.append(f"Left to the optimizer: {left:,} parameters ({100 * left / total:.1f}%)")
        by_reason: dict[tuple[str, str], list[LeftOut]] = {}
        for x in s.left_out:
            by_reason.setdefault((x.kind, x.reason), []).append(x)
        for (kind, reason), xs in by_reason.items():
            names = ", ".join(x.name for x in xs[:3]) + (f", ... ({len(xs)} in all)" if len(xs) > 3 else "")
            lines.append(f"  {kind}: {names} [{sum(x.params for x in xs):,}]: {reason}")
    return "\n".join(lines)
