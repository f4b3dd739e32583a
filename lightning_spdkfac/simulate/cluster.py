"""A cluster as the simulator sees it: P GPUs, the cost of each collective, and the inversion time.

Collectives are alpha-beta models per byte (:class:`~lightning_spdkfac.schedule.AlphaBeta`), the same
type the runtime planner fits from its own measurements. :meth:`Cluster.ring` derives them for any P
from per-link numbers (``alpha`` per step, ``beta`` per byte over one link) with textbook algorithms:

* all-reduce, ``algorithm="ring"`` (NCCL's large-message algorithm): ``2(P-1)`` steps of latency and
  ``2(P-1)/P`` of the message over each link; ``algorithm="tree"`` (NCCL's double binary tree, its
  choice for small messages at scale): a pipelined reduce up the tree then a broadcast down it,
  ``2 ceil(log2 P)`` latencies and the message twice over the busiest link (Sanders, Speck, Traeff 2009);
* reduce-scatter and all-gather (ring): ``(P-1)`` latencies and ``(P-1)/P`` of the message each, half of
  a ring all-reduce;
* broadcast and reduce, a model of their own (not the all-reduce's): ``broadcast="chain"`` (default) a
  pipelined chain, NCCL's broadcast (a ring cut open): ``(P-1)`` latencies and the message once over each
  link, about half a ring all-reduce's bytes per link, which is the authors' own estimate of a broadcast
  ("about 2x cheaper"); ``broadcast="tree"`` a binomial tree without pipelining: ``ceil(log2 P)`` rounds,
  each a latency and the whole message (better for small messages, worse for large ones).

Two-level topology: with ``gpus_per_node = g > 1`` and separate intra-node numbers, the all-reduce is
hierarchical (intra-node reduce-scatter, inter-node all-reduce, ring or tree, of ``1/g`` of the message
by each of the g GPUs, intra-node all-gather), reduce-scatter and all-gather are intra-node then
inter-node, and broadcasts cross the nodes then the GPUs of a node. :meth:`Cluster.from_fit` goes the
other way: from an all-reduce fitted at one world size (the paper's) to the per-link numbers, by
inverting the same formula (given the intra-node numbers, the inter-node ones are what is left of the
fit), then to any other size.

``overlap_slowdown``: compute that runs while the communication channel is busy runs ``1 + s`` times
slower (NCCL kernels take SMs and memory bandwidth from the compute kernels beside them); 0 (default)
is the old model, in which overlapping communication is free.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, replace
from typing import Literal

from .. import validation as val
from ..schedule import AlphaBeta, InverseCost

__all__ = ["Cluster", "ring_allreduce", "tree_allreduce", "chain_collective", "binomial_broadcast",
           "ring_reduce_scatter", "half_allreduce", "AllreduceAlgorithm", "BroadcastAlgorithm"]

AllreduceAlgorithm = Literal["ring", "tree"]
BroadcastAlgorithm = Literal["chain", "tree"]


def _log2(world: int) -> int:
    return math.ceil(math.log2(world))


def ring_allreduce(world: int, alpha: float, beta: float) -> AlphaBeta:
    """Ring all-reduce over ``world`` members with per-step latency ``alpha`` and per-byte link time ``beta``."""
    if val.check_int("world", world, low=0) <= 1:
        return AlphaBeta(0.0, 0.0)
    return AlphaBeta(2 * (world - 1) * alpha, 2 * (world - 1) / world * beta)


def tree_allreduce(world: int, alpha: float, beta: float) -> AlphaBeta:
    """Double-binary-tree all-reduce: a pipelined reduce then broadcast, ``2 ceil(log2 world)`` latencies,
    the message twice over the busiest link."""
    if val.check_int("world", world, low=0) <= 1:
        return AlphaBeta(0.0, 0.0)
    return AlphaBeta(2 * _log2(world) * alpha, 2 * beta)


def ring_reduce_scatter(world: int, alpha: float, beta: float) -> AlphaBeta:
    """Ring reduce-scatter (or all-gather): ``world - 1`` latencies and ``(world-1)/world`` of the message."""
    if val.check_int("world", world, low=0) <= 1:
        return AlphaBeta(0.0, 0.0)
    return AlphaBeta((world - 1) * alpha, (world - 1) / world * beta)


def chain_collective(world: int, alpha: float, beta: float) -> AlphaBeta:
    """Pipelined-chain broadcast (or reduce): ``world - 1`` latencies, the message once per link."""
    if val.check_int("world", world, low=0) <= 1:
        return AlphaBeta(0.0, 0.0)
    return AlphaBeta((world - 1) * alpha, beta)


def binomial_broadcast(world: int, alpha: float, beta: float) -> AlphaBeta:
    """Binomial-tree broadcast (or reduce), not pipelined: ``ceil(log2 world)`` rounds of the whole message."""
    if val.check_int("world", world, low=0) <= 1:
        return AlphaBeta(0.0, 0.0)
    return AlphaBeta(_log2(world) * alpha, _log2(world) * beta)


_ALLREDUCE = {"ring": ring_allreduce, "tree": tree_allreduce}
_BROADCAST = {"chain": chain_collective, "tree": binomial_broadcast}


def _half(ab: AlphaBeta) -> AlphaBeta:
    return AlphaBeta(ab.alpha / 2, ab.beta / 2)


def _plus(*abs_: AlphaBeta) -> AlphaBeta:
    return AlphaBeta(sum(a.alpha for a in abs_), sum(a.beta for a in abs_))


@dataclass(frozen=True)
class Cluster:
    """P GPUs and their collectives (per byte) and inversion time.

    Attributes:
        world_size: P.
        allreduce, broadcast, reduce: one collective over all P GPUs, ``alpha + beta * bytes``.
        inverse: seconds to invert one ``n x n`` damped factor on one GPU.
        gpus_per_node: GPUs per node (for tables and topology-aware variants).
        name: label for tables.
        reduce_scatter, allgather: of a message of that many bytes in all (each GPU ends with, or starts
            from, ``1/P`` of it); default (None) half the all-reduce each (a ring all-reduce is one of each).
        overlap_slowdown: ``s >= 0``: compute running while the channel is busy takes ``1 + s`` times as
            long (module docstring); 0 by default.
    """

    world_size: int
    allreduce: AlphaBeta
    broadcast: AlphaBeta
    reduce: AlphaBeta
    inverse: InverseCost
    gpus_per_node: int = 1
    name: str = ""
    reduce_scatter: AlphaBeta | None = None
    allgather: AlphaBeta | None = None
    overlap_slowdown: float = 0.0

    def __post_init__(self) -> None:
        val.check_int("world_size", self.world_size, low=1)
        val.check_int("gpus_per_node", self.gpus_per_node, low=1)
        for n in ("allreduce", "broadcast", "reduce"):
            val.check_instance(n, getattr(self, n), AlphaBeta, "an AlphaBeta")
        val.check_instance("inverse", self.inverse, InverseCost, "an InverseCost")
        val.check_instance("name", self.name, str)
        for n in ("reduce_scatter", "allgather"):
            if getattr(self, n) is None:
                object.__setattr__(self, n, _half(self.allreduce))
            val.check_instance(n, getattr(self, n), AlphaBeta, "an AlphaBeta")
        object.__setattr__(self, "overlap_slowdown",
                           float(val.check_real("overlap_slowdown", self.overlap_slowdown, val.Bound(low=0.0))))

    @classmethod
    def ring(cls, world_size: int, link_alpha: float, link_beta: float, inverse: InverseCost, *,
             gpus_per_node: int = 1, intra_alpha: float | None = None, intra_beta: float | None = None,
             name: str = "", algorithm: AllreduceAlgorithm = "ring", broadcast: BroadcastAlgorithm = "chain",
             overlap_slowdown: float = 0.0, shared_nic: bool = False) -> Cluster:
        """Collectives from per-link numbers (``link_beta`` in seconds per byte). Give ``intra_alpha`` and
        ``intra_beta`` (with ``gpus_per_node > 1`` dividing ``world_size``) for a two-level cluster; then
        ``link_*`` are the inter-node numbers. ``algorithm``: the all-reduce's (across nodes when two-level);
        ``broadcast``: the broadcast's and reduce's. ``shared_nic``: the g GPUs of a node share one
        inter-node link (``link_beta`` is that link's time per byte: the g inter-node all-reduces of ``1/g``
        of the message each cross it together); otherwise (default) each GPU has its own inter-node path
        (``link_beta`` per byte of one GPU's path)."""
        p = val.check_int("world_size", world_size, low=1)
        a = val.check_real("link_alpha", link_alpha, val.Bound(low=0.0))
        b = val.check_real("link_beta", link_beta, val.Bound(low=0.0))
        g = val.check_int("gpus_per_node", gpus_per_node, low=1)
        val.check_choice("algorithm", algorithm, typing.get_args(AllreduceAlgorithm))
        val.check_choice("broadcast", broadcast, typing.get_args(BroadcastAlgorithm))
        ar, bc = _ALLREDUCE[algorithm], _BROADCAST[broadcast]
        if (intra_alpha is None) != (intra_beta is None):
            raise ValueError("give both intra_alpha and intra_beta, or neither")
        if intra_alpha is None or g == 1:
            rs = ring_reduce_scatter(p, a, b)
            return cls(world_size=p, allreduce=ar(p, a, b), broadcast=bc(p, a, b), reduce=bc(p, a, b),
                       inverse=inverse, gpus_per_node=g, name=name, reduce_scatter=rs, allgather=rs,
                       overlap_slowdown=overlap_slowdown)
        ia = val.check_real("intra_alpha", intra_alpha, val.Bound(low=0.0))
        ib = val.check_real("intra_beta", intra_beta, val.Bound(low=0.0))
        if p % g:
            raise ValueError(f"world_size={p} must be a multiple of gpus_per_node={g} for a hierarchical cluster")
        nodes = p // g
        intra_rs = ring_reduce_scatter(g, ia, ib)  # reduce-scatter (and all-gather) in a node
        share = b if val.check_bool("shared_nic", shared_nic) else b / g  # per byte of the whole message
        inter = ar(nodes, a, share)  # each of the g GPUs all-reduces 1/g of the message with its peers
        allreduce = _plus(intra_rs, inter, intra_rs)
        # reduce-scatter: in the node (every GPU ends with 1/g), then across nodes on that 1/g
        rs = _plus(intra_rs, ring_reduce_scatter(nodes, a, share))
        across, within = bc(nodes, a, b), bc(g, ia, ib)
        chain = AlphaBeta(across.alpha + within.alpha,
                          max(across.beta, within.beta) if broadcast == "chain" else across.beta + within.beta)
        return cls(world_size=p, allreduce=allreduce, broadcast=chain, reduce=chain, inverse=inverse,
                   gpus_per_node=g, name=name, reduce_scatter=rs, allgather=rs, overlap_slowdown=overlap_slowdown)

    @classmethod
    def from_fit(cls, fit: AlphaBeta, fit_world_size: int, world_size: int, inverse: InverseCost, *,
                 gpus_per_node: int = 1, name: str = "", intra_alpha: float | None = None,
                 intra_beta: float | None = None, algorithm: AllreduceAlgorithm = "ring",
                 broadcast: BroadcastAlgorithm = "chain", overlap_slowdown: float = 0.0,
                 shared_nic: bool = False) -> Cluster:
        """Per-link numbers from an all-reduce fitted at ``fit_world_size`` GPUs (inverting the all-reduce
        formula of :meth:`ring`, flat or, with intra-node numbers, two-level with ``gpus_per_node`` GPUs
        per node at both sizes), then every collective at ``world_size``."""
        val.check_instance("fit", fit, AlphaBeta, "an AlphaBeta")
        p0 = val.check_int("fit_world_size", fit_world_size, low=2)
        val.check_choice("algorithm", algorithm, typing.get_args(AllreduceAlgorithm))
        g = val.check_int("gpus_per_node", gpus_per_node, low=1)
        two_level = intra_alpha is not None and g > 1 and p0 % g == 0 and world_size % g == 0
        if not two_level:
            unit = _ALLREDUCE[algorithm](p0, 1.0, 1.0)
            return cls.ring(world_size, fit.alpha / unit.alpha, fit.beta / unit.beta, inverse, gpus_per_node=g,
                            name=name, algorithm=algorithm, broadcast=broadcast, overlap_slowdown=overlap_slowdown)
        assert intra_alpha is not None and intra_beta is not None
        intra = ring_reduce_scatter(g, intra_alpha, intra_beta)
        nodes0 = p0 // g
        if nodes0 < 2:
            raise ValueError(f"fit_world_size={p0} must span at least two nodes of {g} GPUs for a two-level fit")
        unit = _ALLREDUCE[algorithm](nodes0, 1.0, 1.0 if shared_nic else 1.0 / g)
        link_alpha = (fit.alpha - 2 * intra.alpha) / unit.alpha
        link_beta = (fit.beta - 2 * intra.beta) / unit.beta
        if link_alpha < 0 or link_beta < 0:
            raise ValueError("the intra-node numbers alone exceed the fitted all-reduce: intra_alpha/intra_beta "
                             "too large for this fit")
        return cls.ring(world_size, link_alpha, link_beta, inverse, intra_alpha=intra_alpha, intra_beta=intra_beta,
                        shared_nic=shared_nic, gpus_per_node=gpus_per_node, name=name, algorithm=algorithm,
                        broadcast=broadcast, overlap_slowdown=overlap_slowdown)

    def with_inverse(self, inverse: InverseCost) -> Cluster:
        return replace(self, inverse=inverse)


def half_allreduce(cluster: Cluster, name: str) -> AlphaBeta:
    """``cluster.<name>`` (``reduce_scatter``, ``allgather``) when the cluster models it, else half the
    all-reduce (a ring all-reduce is a reduce-scatter then an all-gather)."""
    model = getattr(cluster, name, None)
    if isinstance(model, AlphaBeta):
        return model
    ar = cluster.allreduce
    return AlphaBeta(ar.alpha / 2, ar.beta / 2)
