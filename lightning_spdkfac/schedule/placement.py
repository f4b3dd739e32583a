"""Placement of factor inversions on ranks: who inverts (and then broadcasts) which factor.

Each factor (the A and the G factor of every layer are separate tasks) is either owned by one rank,
which inverts it and broadcasts the inverse to the others, or :data:`REPLICATED`: every rank inverts it
itself and nothing is sent. The planners are pure and deterministic: the same sizes and cost models give
the same placement on every rank.

A factor is given by its shape (:mod:`lightning_spdkfac.factor_shapes`): an int n is an ``n x n`` dense
factor, ``(n,)`` a diagonal one (inverted elementwise: :meth:`InverseCost.time_of` charges it ``c0 + c1 n``;
its inverse travels as n elements), ``(b, n, n)`` a grouped one (b blocks inverted in one batched call, b
triangles sent). Every ``ns`` below takes such shapes, ints included.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from .. import validation as val
from ..factor_shapes import FactorShape, ShapeLike, check_shape, check_shapes, inverse_numel, side
from ..vocabulary import INVERSE_METHODS, InverseMethodName
from .cost import AlphaBeta, InverseCost

__all__ = [
    "REPLICATED",
    "Placement",
    "PlacementPolicy",
    "PlacementTimeline",
    "broadcast_order",
    "inverted_by",
    "message_bytes",
    "message_elements",
    "owned_by",
    "owned_prefix_candidates",
    "plan_placement",
    "simulate_placement",
    "task_cost",
]

REPLICATED = -1
"""Owner value of a factor that every rank inverts itself (no broadcast)."""

PlacementPolicy = Literal["lbp", "lbp_channel", "round_robin", "replicated"]
_POLICIES: tuple[str, ...] = get_args(PlacementPolicy)


@dataclass(frozen=True)
class Placement:
    """Owner of every factor's inversion and the modelled load of every rank.

    Attributes:
        owners: ``owners[i]`` is the rank in ``[0, world_size)`` that inverts and broadcasts factor ``i``,
            or :data:`REPLICATED` (-1) when every rank inverts it and it is not broadcast.
        policy: the policy that produced the placement.
        load: modelled seconds per rank: inversions of its owned and of all replicated factors, plus the
            broadcasts of its owned inverses. ``len(load) == world_size``. This per-rank view is what
            LBP balances; it does not see that broadcasts from different owners share one channel, for
            which see :func:`simulate_placement`.
    """

    owners: tuple[int, ...]
    policy: str
    load: tuple[float, ...]

    def __post_init__(self) -> None:
        val.check_choice("policy", self.policy, _POLICIES)
        object.__setattr__(self, "owners", tuple(val.check_ints("owners", self.owners)))
        object.__setattr__(self, "load", tuple(val.check_reals("load", self.load)))
        if not self.load:
            raise ValueError("load must have one entry per rank (world_size >= 1)")
        world = len(self.load)
        for i, o in enumerate(self.owners):
            if not (o == REPLICATED or 0 <= o < world):
                raise ValueError(f"owners[{i}] must be a rank in [0, {world}) or REPLICATED (-1), got {o!r}")

    @property
    def world_size(self) -> int:
        return len(self.load)

    @property
    def max_load(self) -> float:
        """The modelled inversion-phase time: the most loaded rank's load."""
        return max(self.load)

    @property
    def replicated(self) -> tuple[int, ...]:
        """Indices of the factors that every rank inverts."""
        return tuple(i for i, o in enumerate(self.owners) if o == REPLICATED)


def owned_by(placement: Placement, rank: int) -> list[int]:
    """Indices of the factors that ``rank`` inverts and broadcasts (replicated factors excluded)."""
    r = val.check_int("rank", rank, low=0)
    if r >= placement.world_size:
        raise ValueError(f"rank must be < world_size={placement.world_size}, got {rank!r}")
    return [i for i, o in enumerate(placement.owners) if o == r]


def inverted_by(placement: Placement, rank: int) -> list[int]:
    """Indices of the factors that ``rank`` inverts, in the order it inverts them: its owned ones first
    (ascending index, the order they take in :func:`broadcast_order`), so that their broadcasts start
    early, then every replicated one."""
    r = val.check_int("rank", rank, low=0)
    if r >= placement.world_size:
        raise ValueError(f"rank must be < world_size={placement.world_size}, got {rank!r}")
    return owned_by(placement, r) + list(placement.replicated)


def _finish_times(owners: Sequence[int], inv_times: Sequence[float]) -> dict[int, float]:
    """Predicted finish of every owned factor's inversion: each owner inverts its owned factors in
    ascending index, back to back from 0, so a factor finishes at its owner's cumulative inversion time."""
    clock: dict[int, float] = {}
    finish: dict[int, float] = {}
    for i, o in enumerate(owners):
        if o != REPLICATED:
            clock[o] = clock.get(o, 0.0) + inv_times[i]
            finish[i] = clock[o]
    return finish


def _by_finish(finish: dict[int, float]) -> tuple[int, ...]:
    return tuple(sorted(finish, key=lambda i: (finish[i], i)))


def broadcast_order(owners: Sequence[int], ns: Sequence[ShapeLike], inv: InverseCost) -> tuple[int, ...]:
    """The order in which every rank issues the inverse broadcasts: the owned (non-replicated) factors
    by predicted finish of their inversion, ties by lower index.

    Each owner inverts its owned factors in ascending index, one after the other from the start of the
    phase, so factor ``i`` is predicted to finish at the sum of ``inv.time_of(shape)`` over its owner's factors
    up to and including ``i``. Sorting by that finish lets a small inverse that is ready early go on
    the wire before the slow inversion of another rank, instead of queueing behind it. Within one owner
    the order stays ascending (finish times only grow), so an owner can invert in exactly this order.

    Collectives on a process group are matched by issue order, so every rank must derive the same
    order: it is a pure function of the placement, the sides and the inversion model, which the runtime
    holds identically on every rank (the model is rank 0's, broadcast). The runtime
    (:class:`~lightning_spdkfac.comm.scheduler.SPDDistributor`) issues its broadcasts in this order and
    the simulator (:func:`simulate_placement`) runs them on its channel in this order.

    Args:
        owners: owner rank of every factor, or :data:`REPLICATED` (never broadcast, not listed).
        ns: shape of every factor (an int n: n x n), aligned with ``owners``.
        inv: inversion time model.

    Returns:
        The indices of the owned factors, in issue order.
    """
    own = val.check_ints("owners", owners, low=REPLICATED)
    sizes = check_shapes("ns", ns, low=0)
    if len(own) != len(sizes):
        raise ValueError(f"owners and ns must have the same length, got {len(own)} and {len(sizes)}")
    val.check_instance("inv", inv, InverseCost)
    return _by_finish(_finish_times(own, [inv.time_of(n) for n in sizes]))


def message_elements(n: ShapeLike, inverse_method: InverseMethodName = "cholesky") -> int:
    """Elements of the broadcast inverse of a factor of shape ``n`` (an int n: n x n;
    :func:`~lightning_spdkfac.factor_shapes.inverse_numel`): a dense factor's upper triangle, n(n+1)/2
    (``"cholesky"``), or its (n+1) x n eigen payload, n(n+1) (``"eigen"``); b times that for a grouped
    ``(b, n, n)`` factor; n for a diagonal ``(n,)`` one either way."""
    return inverse_numel(check_shape("n", n, low=0), inverse_method)


def message_bytes(n: ShapeLike, bytes_per_element: int = 4, inverse_method: InverseMethodName = "cholesky") -> int:
    """Bytes of the broadcast inverse of a factor of shape ``n`` (:func:`message_elements`)."""
    return message_elements(n, inverse_method) * bytes_per_element


def _sizer(bytes_per_element: int, inverse_method: object) -> Callable[[FactorShape], int]:
    """Validated ``inverse_method``, as the message size in bytes of a factor shape."""
    method = val.check_choice("inverse_method", inverse_method, INVERSE_METHODS)
    return lambda n: inverse_numel(n, method) * bytes_per_element


def task_cost(n: ShapeLike, inv: InverseCost, bcast: AlphaBeta, bytes_per_element: int = 4, world_size: int = 2,
              inverse_method: InverseMethodName = "cholesky") -> float:
    """Modelled seconds an owner spends on a factor of shape ``n`` (an int n: n x n): its inversion
    (:meth:`InverseCost.time_of`) plus the broadcast of the inverse (:func:`message_bytes`). A broadcast costs
    nothing when ``world_size == 1`` (there is no peer)."""
    shape = check_shape("n", n, low=0)
    return _owner_seconds(shape, inv, bcast, _sizer(bytes_per_element, inverse_method), world_size)


def _owner_seconds(n: FactorShape, inv: InverseCost, bcast: AlphaBeta, msg: Callable[[FactorShape], int],
                   world: int) -> float:
    """:func:`task_cost` with the message size as a function of the shape (``msg``)."""
    return inv.time_of(n) + (bcast.time(msg(n)) if world > 1 else 0.0)


def _loads(owners: list[int], ns: list[FactorShape], world: int, inv: InverseCost, bcast: AlphaBeta,
           msg: Callable[[FactorShape], int]) -> list[float]:
    replicated = sum(inv.time_of(n) for n, o in zip(ns, owners) if o == REPLICATED)
    load = [replicated] * world
    for n, o in zip(ns, owners):
        if o != REPLICATED:
            load[o] += _owner_seconds(n, inv, bcast, msg, world)
    return load


def plan_placement(
    ns: Sequence[ShapeLike],
    world_size: int,
    inv: InverseCost,
    bcast: AlphaBeta,
    policy: PlacementPolicy = "lbp",
    bytes_per_element: int = 4,
    small_threshold: int | None = None,
    inverse_method: InverseMethodName = "cholesky",
) -> Placement:
    """Decide which rank inverts each factor.

    Args:
        ns: shape of every factor (A and G factors listed separately), in a fixed order: an int n (n x n),
            or ``(n,)`` diagonal, ``(n, n)`` dense, ``(b, n, n)`` grouped.
        world_size: number of ranks.
        inv: inversion time model.
        bcast: alpha-beta model of one broadcast, per byte.
        policy: ``"lbp"`` the paper's load-balanced placement; ``"lbp_channel"`` LBP that also weighs
            the shared broadcast channel (below); ``"round_robin"`` factor ``i`` on rank ``i % world_size``
            in the given order (MPD-KFAC); ``"replicated"`` every rank inverts every factor (D-KFAC).
        bytes_per_element: bytes of one element of a broadcast inverse (4 for fp32).
        small_threshold: factors whose side n (of each block for a grouped factor, the length of a
            diagonal one) is ``< small_threshold`` are replicated regardless of the cost models (the paper's
            code used 1024).
        inverse_method: what a broadcast carries (:func:`message_bytes`): ``"cholesky"`` the upper
            triangle of the inverse, ``"eigen"`` the eigen payload (twice the bytes). ``inv`` should be
            the model of that method's inversion (``measure_inverse_cost(..., method=...)``).

    ``"lbp"``: a factor is replicated when inverting it is no slower than broadcasting its inverse,
    ``inv.time(n) <= bcast.time(message_bytes(n, bytes_per_element, inverse_method))`` (or ``n < small_threshold``). The others
    are sorted by owner cost ``inv.time(n) + bcast.time(...)``, largest first (ties: lower index first),
    and each goes to the least-loaded rank so far (ties: lowest rank) -- the LPT rule, whose maximum load
    is at most the average plus the largest task. With ``world_size == 1`` every factor is replicated.

    ``"lbp_channel"``: LBP decides each factor's replication alone and balances per-rank loads, but every
    broadcast runs on one channel that all ranks share, so with many owned factors the channel, not the
    ranks, sets the end of the phase. This policy sorts the factors that may be owned (``n >=
    small_threshold``) by owner cost, largest first, assigns them by LPT as LBP does, and then chooses how
    many of them to own, ``k``: the ``k`` largest are owned and the rest replicated, with ``k`` (and LBP's
    own placement, also a candidate) picked to minimise the end of the phase as
    :func:`simulate_placement` models it. So it is never worse than ``"lbp"`` in that model. Cost:
    ``O(F^2 log F)`` for ``F`` factors, once per plan.
    """
    sizes = check_shapes("ns", ns, low=1)
    world = val.check_int("world_size", world_size, low=1)
    val.check_instance("inv", inv, InverseCost)
    val.check_instance("bcast", bcast, AlphaBeta)
    val.check_choice("policy", policy, _POLICIES)
    bpe = val.check_int("bytes_per_element", bytes_per_element, low=1)
    threshold = None if small_threshold is None else val.check_int("small_threshold", small_threshold, low=0)
    msg = _sizer(bpe, inverse_method)

    if policy == "lbp_channel" and world > 1:
        owners = _lbp_channel(sizes, world, inv, bcast, msg, threshold)
    elif policy == "replicated":
        owners = [REPLICATED] * len(sizes)
    elif policy == "round_robin":
        owners = [i % world for i in range(len(sizes))]
    elif world == 1:
        owners = [REPLICATED] * len(sizes)
    else:
        owners = _lbp(sizes, world, inv, bcast, msg, threshold)
    return Placement(
        owners=tuple(owners), policy=policy, load=tuple(_loads(owners, sizes, world, inv, bcast, msg))
    )


def _lpt(tasks: list[tuple[float, int]], world: int, n: int) -> list[int]:
    """Owners after assigning ``tasks`` (cost, factor), in order, each to the least-loaded rank
    (ties: lowest rank); factors not in ``tasks`` stay replicated."""
    owners = [REPLICATED] * n
    heap = [(0.0, r) for r in range(world)]
    for cost, i in tasks:
        load, rank = heapq.heappop(heap)
        owners[i] = rank
        heapq.heappush(heap, (load + cost, rank))
    return owners


def _lbp(sizes: list[FactorShape], world: int, inv: InverseCost, bcast: AlphaBeta,
         msg: Callable[[FactorShape], int], threshold: int | None) -> list[int]:
    tasks = []
    for i, n in enumerate(sizes):
        send = bcast.time(msg(n))
        if inv.time_of(n) <= send or (threshold is not None and side(n) < threshold):
            continue
        tasks.append((inv.time_of(n) + send, i))
    tasks.sort(key=lambda t: (-t[0], t[1]))
    return _lpt(tasks, world, len(sizes))


def _phase_end(owners: list[int], sizes: list[FactorShape], inv_times: list[float], send_times: list[float]) -> float:
    """:func:`simulate_placement`'s ``end`` for ``owners``, in ``O(F log F)`` (no per-rank lists)."""
    replicated = sum(t for t, o in zip(inv_times, owners) if o == REPLICATED)
    finish = _finish_times(owners, inv_times)
    clock: dict[int, float] = {}
    for i, t in finish.items():
        clock[owners[i]] = max(clock.get(owners[i], 0.0), t)
    compute = max(clock.values(), default=0.0) + replicated
    free = 0.0
    for i in _by_finish(finish):  # broadcast_order
        free = max(free, finish[i]) + send_times[i]
    return max(compute, free)


def _lbp_channel(sizes: list[FactorShape], world: int, inv: InverseCost, bcast: AlphaBeta,
                 msg: Callable[[FactorShape], int], threshold: int | None) -> list[int]:
    inv_times = [inv.time_of(n) for n in sizes]
    send_times = [bcast.time(msg(n)) for n in sizes]
    tasks = sorted(((inv_times[i] + send_times[i], i) for i, n in enumerate(sizes)
                    if threshold is None or side(n) >= threshold), key=lambda t: (-t[0], t[1]))
    best = _lbp(sizes, world, inv, bcast, msg, threshold)
    best_end = _phase_end(best, sizes, inv_times, send_times)
    # LPT is greedy in a fixed order, so owning the k largest is a prefix of owning all of them.
    full = _lpt(tasks, world, len(sizes))
    for k in range(len(tasks) + 1):
        owners = [REPLICATED] * len(sizes)
        for _, i in tasks[:k]:
            owners[i] = full[i]
        end = _phase_end(owners, sizes, inv_times, send_times)
        if end < best_end * (1 - 1e-12):
            best, best_end = owners, end
    return best


@dataclass(frozen=True)
class PlacementTimeline:
    """Modelled inversion phase: per-rank compute, then the inverse broadcasts on one shared channel.

    Attributes:
        compute_end: per rank, when its last inversion (owned, then replicated) finishes.
        broadcast_order: the owned factors in the order their broadcasts run on the channel.
        broadcast_start, broadcast_end: seconds, aligned with ``broadcast_order``.
    """

    compute_end: tuple[float, ...]
    broadcast_order: tuple[int, ...]
    broadcast_start: tuple[float, ...]
    broadcast_end: tuple[float, ...]

    @property
    def end(self) -> float:
        """When every rank holds every inverse: the later of the last inversion and the last broadcast."""
        return max(max(self.compute_end, default=0.0), max(self.broadcast_end, default=0.0))

    @property
    def broadcast_busy(self) -> float:
        """Total seconds the channel spends broadcasting inverses."""
        return sum(e - s for s, e in zip(self.broadcast_start, self.broadcast_end))


def simulate_placement(
    placement: Placement, ns: Sequence[ShapeLike], inv: InverseCost, bcast: AlphaBeta, bytes_per_element: int = 4,
    inverse_method: InverseMethodName = "cholesky", order: Sequence[int] | None = None,
) -> PlacementTimeline:
    """Timeline of ``placement`` when every broadcast uses one channel shared by all ranks (every rank
    takes part in every broadcast, as sender or receiver) and the broadcasts are issued in ``order``.

    ``order`` (default: :func:`broadcast_order`, what the runtime issues) lists every owned factor once.
    Collectives run in issue order, so a broadcast starts when its owner has computed the inverse and
    the one before it in ``order`` has ended. Each rank inverts its owned factors in the order they take
    in ``order`` (the runtime inverts as its turn comes), then every replicated one; with the default
    order that is :func:`inverted_by`. This is what per-rank ``Placement.load`` cannot see: broadcasts
    from different owners do not run in parallel, which is why replicating cheap factors (no broadcast
    at all) pays off even though it adds compute to every rank. Pure.
    """
    val.check_instance("placement", placement, Placement)
    sizes = check_shapes("ns", ns, low=1)
    if len(sizes) != len(placement.owners):
        raise ValueError(f"ns has {len(sizes)} factors but the placement has {len(placement.owners)}")
    val.check_instance("inv", inv, InverseCost)
    val.check_instance("bcast", bcast, AlphaBeta)
    bpe = val.check_int("bytes_per_element", bytes_per_element, low=1)
    msg = _sizer(bpe, inverse_method)
    owners = placement.owners
    owned = [i for i, o in enumerate(owners) if o != REPLICATED]
    if order is None:
        issue = broadcast_order(owners, sizes, inv)
    else:
        issue = tuple(val.check_ints("order", order))
        if sorted(issue) != owned:
            raise ValueError(f"order must list every owned factor exactly once ({owned}), got {list(issue)}")
    world = placement.world_size
    ready: dict[int, float] = {}
    clock = [0.0] * world
    for i in issue:
        clock[owners[i]] += inv.time_of(sizes[i])
        ready[i] = clock[owners[i]]
    compute_end = []
    for t in clock:  # then every replicated factor, one after the other
        for i in placement.replicated:
            t += inv.time_of(sizes[i])
        compute_end.append(t)
    sent = issue if world > 1 else ()
    starts, ends = [], []
    free = 0.0
    for i in sent:
        start = max(free, ready[i])
        free = start + bcast.time(msg(sizes[i]))
        starts.append(start)
        ends.append(free)
    return PlacementTimeline(
        compute_end=tuple(compute_end),
        broadcast_order=tuple(sent),
        broadcast_start=tuple(starts),
        broadcast_end=tuple(ends),
    )


def owned_prefix_candidates(ns: Sequence[ShapeLike], world_size: int, inv: InverseCost, bcast: AlphaBeta,
                            bytes_per_element: int = 4, small_threshold: int | None = None,
                            inverse_method: InverseMethodName = "cholesky") -> list[Placement]:
    """The candidates ``"lbp_channel"`` chooses among, all of them, for a caller that judges them by its own
    model (the simulator's asynchronous period, where the inversion phase overlaps the next iteration and
    :func:`simulate_placement`'s end is the wrong yardstick): candidate ``k`` (``k = 0 .. F'``, ``F'`` the
    factors with ``n >= small_threshold``) owns the ``k`` largest by owner cost (inversion + broadcast,
    ties: lower index), each on the rank LPT gives it when all ``F'`` are assigned, and replicates the rest.
    Candidate 0 is ``"replicated"``. With ``world_size == 1`` the one candidate replicates every factor."""
    sizes = check_shapes("ns", ns, low=1)
    world = val.check_int("world_size", world_size, low=1)
    val.check_instance("inv", inv, InverseCost)
    val.check_instance("bcast", bcast, AlphaBeta)
    bpe = val.check_int("bytes_per_element", bytes_per_element, low=1)
    threshold = None if small_threshold is None else val.check_int("small_threshold", small_threshold, low=0)
    msg = _sizer(bpe, inverse_method)
    if world == 1:
        owners = [REPLICATED] * len(sizes)
        return [Placement(tuple(owners), "lbp_channel", tuple(_loads(owners, sizes, world, inv, bcast, msg)))]
    tasks = sorted(((inv.time_of(n) + bcast.time(msg(n)), i) for i, n in enumerate(sizes)
                    if threshold is None or side(n) >= threshold), key=lambda t: (-t[0], t[1]))
    full = _lpt(tasks, world, len(sizes))
    out = []
    for k in range(len(tasks) + 1):
        owners = [REPLICATED] * len(sizes)
        for _, i in tasks[:k]:
            owners[i] = full[i]
        out.append(Placement(tuple(owners), "lbp_channel", tuple(_loads(owners, sizes, world, inv, bcast, msg))))
    return out
