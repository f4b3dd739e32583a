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
  accumulators of every layer: each rank collects its own statistics); the totals are this rank's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..factor_shapes import FactorShape, describe, inverse_shape, numel

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
        """Bytes this block takes on ``rank`` (every rank without dpkfac)."""
        if self.owner is None or rank is None or self.owner == rank:
            return self.factor_bytes + self.inverse_bytes + self.async_bytes
        return self.accumulator_bytes

    accumulator_bytes: int = 0  # (included in factor_bytes) the step's sums, held on every rank
    # False: the block produced no factors though its weight got a gradient (measured; its parameters are listed
    # among those left to the optimizer, with the reason, and not counted as preconditioned)
    factored: bool = True
    # True: its calls come (also) from functions given its weight (kfac/capture.py): F.linear, matmul, an expert stack
    captured: bool = False


@dataclass(frozen=True)
class LeftOut:
    """A trainable parameter K-FAC does not precondition."""

    name: str
    kind: str
    params: int
    reason: str


@dataclass(frozen=True)
class KFACSummary:
    rows: tuple[LayerRow, ...]
    left_out: tuple[LeftOut, ...]
    trainable: int  # trainable parameters of the model (each once)
    rank: int | None  # the rank the totals are for (dpkfac), None: every rank holds everything

    @property
    def preconditioned(self) -> int:
        return sum(r.params for r in self.rows if r.factored)

    @property
    def total_bytes(self) -> int:
        """K-FAC memory of this rank: every block it holds, as allocated."""
        return sum(r.held_bytes(self.rank) for r in self.rows)

    def __str__(self) -> str:
        return format_summary(self)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


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
                             ly.name in pre.capture.layers))
    left = _left_out(pre, counted, unfactored)
    trainable = sum(p.numel() for p in {id(p): p for p in pre.model.parameters() if p.requires_grad}.values())
    return KFACSummary(tuple(rows), tuple(left), trainable, None if owners is None else pre.distributor.rank)


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
            out.append(LeftOut(name, type(module).__name__, p.numel(), why))
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
    lines.append(f"K-FAC memory{who}: {format_bytes(s.total_bytes)}")
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
