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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from .. import validation as val
from ..vocabulary import INVERSE_METHODS, InverseMethodName
from .cost import InverseCost

__all__ = ["LayerBalance", "LayerPlacement", "layer_state_bytes", "plan_layer_placement", "preconditioned_order"]

LayerBalance = Literal["time", "memory"]
_BALANCES = ("time", "memory")


def layer_state_bytes(a_side: int, g_side: int, bytes_per_element: int = 4,
                      inverse_method: InverseMethodName = "cholesky") -> int:
    """Bytes of one layer's K-FAC state on the rank that holds it: the running A and G factors (``n x n``
    each) and their inverses (``n x n``, or the ``(n + 1) x n`` eigen payloads)."""
    a = val.check_int("a_side", a_side, low=0)
    g = val.check_int("g_side", g_side, low=0)
    method = val.check_choice("inverse_method", inverse_method, INVERSE_METHODS)
    extra = 1 if method == "eigen" else 0
    return (2 * a * a + 2 * g * g + extra * (a + g)) * val.check_int("bytes_per_element", bytes_per_element, low=1)


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


def _precondition_seconds(a: int, g: int, inverse: InverseCost) -> float:
    """``G^-1 dW A^-1``: ``2ag(a + g)`` flops at the rate the cubic term implies for an inversion (about
    ``n^3`` flops for Cholesky and the triangular inverse)."""
    return inverse.c3 * 2.0 * a * g * (a + g)


def plan_layer_placement(
    sides: Sequence[tuple[int, int]],
    world_size: int,
    inverse: InverseCost,
    *,
    balance: LayerBalance = "time",
    bytes_per_element: int = 4,
    inverse_method: InverseMethodName = "cholesky",
) -> LayerPlacement:
    """Owners of the layers with sides ``sides[i] = (A side, G side)`` on ``world_size`` ranks (module doc)."""
    world = val.check_int("world_size", world_size, low=1)
    val.check_instance("inverse", inverse, InverseCost, "an InverseCost")
    val.check_choice("balance", balance, _BALANCES)
    pairs = [(val.check_int("sides", int(a), low=0), val.check_int("sides", int(g), low=0)) for a, g in sides]
    nbytes = [layer_state_bytes(a, g, bytes_per_element, inverse_method) for a, g in pairs]
    seconds = [inverse.time(a) + inverse.time(g) + _precondition_seconds(a, g, inverse) for a, g in pairs]
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


def preconditioned_order(sides: Sequence[tuple[int, int]], owners: Sequence[int], inverse: InverseCost) -> tuple[int, ...]:
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
    for (a, g), o in zip(sides, owners):
        busy[o] = busy.get(o, 0.0) + inverse.time(a) + inverse.time(g) + _precondition_seconds(a, g, inverse)
        done.append(busy[o])
    return tuple(sorted(range(len(done)), key=lambda i: (done[i], i)))
