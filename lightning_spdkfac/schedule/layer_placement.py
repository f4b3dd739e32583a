"""Layer-wise placement for distributed preconditioning (DP-KFAC): which rank owns each layer.

Under ``schedule="dpkfac"`` a layer is the unit of work: its owner receives the reduced A and G factors,
keeps their running averages, inverts them and preconditions the layer's gradient; the other ranks hold
none of that layer's K-FAC state and receive its preconditioned gradient. So the placement decides both
the inversion time and the K-FAC memory of every rank.

The planner is longest-processing-time first over layers: largest modelled cost first, each to the rank
whose load is least so far (ties: the least memory, then the lowest rank). The cost of a layer is its two
inversions under the inversion-time model (and the preconditioning product, ``2 a g (a + g)`` flops at
the model's cubic rate); ``balance="memory"``, or a model that is zero everywhere (one process, or no
measurement), weighs layers by the bytes they hold instead. It is pure and deterministic: the same sides
and model give the same owners on every rank.

A layer's factors are given by their shapes (:mod:`lightning_spdkfac.factor_shapes`; an int n is ``n x n``):
a diagonal factor holds n elements and is inverted elementwise, a grouped ``(b, n, n)`` one holds b blocks,
inverted in one batched call (:meth:`InverseCost.time_of`), and the preconditioning product is counted per
block (:func:`precondition_flops`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from .. import validation as val
from ..factor_shapes import (
    FactorShape,
    ShapeLike,
    blocks,
    check_shape,
    inverse_shape,
    is_diagonal,
    numel,
    side,
)
from ..vocabulary import INVERSE_METHODS, InverseMethodName
from .cost import InverseCost

__all__ = ["LayerBalance", "LayerPlacement", "layer_state_bytes", "plan_layer_placement", "precondition_flops",
           "preconditioned_order"]

LayerBalance = Literal["time", "memory"]
_BALANCES = ("time", "memory")


def layer_state_bytes(a_side: ShapeLike, g_side: ShapeLike, bytes_per_element: int = 4,
                      inverse_method: InverseMethodName = "cholesky") -> int:
    """Bytes of one layer's K-FAC state on the rank that holds it: the running A and G factors (of their
    shapes: ``n x n`` for an int n) and their inverses (the factor's shape, or the eigen payload's,
    :func:`~lightning_spdkfac.factor_shapes.inverse_shape`)."""
    a = check_shape("a_side", a_side, low=0)
    g = check_shape("g_side", g_side, low=0)
    method = val.check_choice("inverse_method", inverse_method, INVERSE_METHODS)
    held = sum(numel(s) + numel(inverse_shape(s, method)) for s in (a, g))
    return held * val.check_int("bytes_per_element", bytes_per_element, low=1)


@dataclass(frozen=True)
class LayerPlacement:
    """The owner of every layer and the modelled load of every rank.

    Attributes:
        owners: ``owners[i]`` is the rank in ``[0, world_size)`` that owns layer ``i``.
        load: modelled seconds per rank (inversions and preconditioning of its layers).
        memory: bytes of K-FAC state per rank (:func:`layer_state_bytes` of its layers).
    """

    owners: tuple[int, ...]
    load: tuple[float, ...]
    memory: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.load or len(self.load) != len(self.memory):
            raise ValueError("load and memory must have one entry per rank (world_size >= 1)")
        for i, o in enumerate(self.owners):
            if not 0 <= o < len(self.load):
                raise ValueError(f"owners[{i}] must be a rank in [0, {len(self.load)}), got {o!r}")

    @property
    def world_size(self) -> int:
        return len(self.load)

    def owned_by(self, rank: int) -> list[int]:
        """The layers ``rank`` owns, in layer order."""
        return [i for i, o in enumerate(self.owners) if o == rank]


def precondition_flops(a_shape: ShapeLike, g_shape: ShapeLike) -> float:
    """Flops of ``G^-1 dW A^-1`` for factors of these shapes: ``2ag(a + g)`` for dense ones; a diagonal factor
    scales instead of multiplying (``ag`` for its side); with a grouped factor, that per block, b times."""
    a, g = check_shape("a_shape", a_shape, low=0), check_shape("g_shape", g_shape, low=0)
    na, ng = float(side(a)), float(side(g))
    b = max([blocks(s) for s in (a, g) if len(s) == 3], default=1)
    left = ng * na if is_diagonal(g) else 2.0 * ng * ng * na
    right = ng * na if is_diagonal(a) else 2.0 * ng * na * na
    return b * (left + right)


def _precondition_seconds(a: FactorShape, g: FactorShape, inverse: InverseCost) -> float:
    """:func:`precondition_flops` at the rate the cubic term implies for an inversion (about ``n^3`` flops for
    Cholesky and the triangular inverse)."""
    if len(a) == 2 and len(g) == 2:  # (the dense formula as it always was: bit-identical plans)
        return inverse.c3 * 2.0 * a[0] * g[0] * (a[0] + g[0])
    return inverse.c3 * precondition_flops(a, g)


def _layer_seconds(a: FactorShape, g: FactorShape, inverse: InverseCost) -> float:
    return inverse.time_of(a) + inverse.time_of(g) + _precondition_seconds(a, g, inverse)


def _layer_pairs(sides: Sequence[tuple[ShapeLike, ShapeLike]]) -> list[tuple[FactorShape, FactorShape]]:
    return [(check_shape(f"sides[{i}][0]", a, low=0), check_shape(f"sides[{i}][1]", g, low=0))
            for i, (a, g) in enumerate(sides)]


def plan_layer_placement(
    sides: Sequence[tuple[ShapeLike, ShapeLike]],
    world_size: int,
    inverse: InverseCost,
    *,
    balance: LayerBalance = "time",
    bytes_per_element: int = 4,
    inverse_method: InverseMethodName = "cholesky",
) -> LayerPlacement:
    """Owners of the layers with ``sides[i] = (A shape, G shape)`` (ints: n x n) on ``world_size`` ranks
    (module doc)."""
    world = val.check_int("world_size", world_size, low=1)
    val.check_instance("inverse", inverse, InverseCost, "an InverseCost")
    val.check_choice("balance", balance, _BALANCES)
    pairs = _layer_pairs(sides)
    nbytes = [layer_state_bytes(a, g, bytes_per_element, inverse_method) for a, g in pairs]
    seconds = [_layer_seconds(a, g, inverse) for a, g in pairs]
    by_time = balance == "time" and any(s > 0 for s in seconds)
    cost = seconds if by_time else [float(b) for b in nbytes]
    load = [0.0] * world
    memory = [0] * world
    owners = [0] * len(pairs)
    for i in sorted(range(len(pairs)), key=lambda i: (-cost[i], -nbytes[i], i)):
        rank = min(range(world), key=lambda r: (load[r], memory[r], r))
        owners[i] = rank
        load[rank] += cost[i]
        memory[rank] += nbytes[i]
    seconds_load = [0.0] * world
    for i, o in enumerate(owners):
        seconds_load[o] += seconds[i]
    return LayerPlacement(owners=tuple(owners), load=tuple(seconds_load), memory=tuple(memory))


def preconditioned_order(sides: Sequence[tuple[ShapeLike, ShapeLike]], owners: Sequence[int], inverse: InverseCost) -> tuple[int, ...]:
    """The order in which every rank issues the broadcasts of the preconditioned gradients (``dpkfac``): by the
    predicted end of each layer's preconditioning on its owner (ties: layer order). An owner works through its
    layers in layer order, inverting A and G (on an inverse step) and preconditioning; so a layer's end is the sum
    of those times over its owner's layers up to it. Owners taking turns instead makes every rank's first
    broadcast wait for the first owner's first layer, however large (the simulator's ``dpkfac-turns``)."""
    val.check_instance("inverse", inverse, InverseCost, "an InverseCost")
    if len(sides) != len(owners):
        raise ValueError(f"sides and owners must have the same length, got {len(sides)} and {len(owners)}")
    busy: dict[int, float] = {}
    done = []
    for (a, g), o in zip(_layer_pairs(sides), owners):
        busy[o] = busy.get(o, 0.0) + _layer_seconds(a, g, inverse)
        done.append(busy[o])
    return tuple(sorted(range(len(done)), key=lambda i: (done[i], i)))
