"""A cluster as the simulator sees it: P GPUs, the cost of each collective, and the inversion time.

Collectives are alpha-beta models per byte (:class:`~lightning_spdkfac.schedule.AlphaBeta`), the same
type the runtime planner fits from its own measurements. :meth:`Cluster.ring` derives them for any P
from per-link numbers with the textbook ring algorithms (NCCL's large-message algorithms):

* all-reduce: ``2(P-1)`` steps of latency and ``2(P-1)/P`` of the message over each link;
* broadcast and reduce: a pipelined chain, ``(P-1)`` latencies and the message once over each link.

With ``gpus_per_node > 1`` and separate intra-node numbers, the all-reduce is hierarchical (intra-node
reduce-scatter, inter-node ring all-reduce of ``1/g`` of the message, intra-node all-gather) and
broadcasts cross the nodes then the GPUs of a node. :meth:`Cluster.from_fit` goes the other way: from an
all-reduce fitted at one world size (the paper's) to the per-link numbers, then to any other size.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import validation as val
from ..schedule import AlphaBeta, InverseCost

__all__ = ["Cluster", "ring_allreduce", "chain_collective"]


def ring_allreduce(world: int, alpha: float, beta: float) -> AlphaBeta:
    """Ring all-reduce over ``world`` members with per-step latency ``alpha`` and per-byte link time ``beta``."""
    if val.check_int("world", world, low=0) <= 1:
        return AlphaBeta(0.0, 0.0)
    return AlphaBeta(2 * (world - 1) * alpha, 2 * (world - 1) / world * beta)


def chain_collective(world: int, alpha: float, beta: float) -> AlphaBeta:
    """Pipelined-chain broadcast (or reduce): ``world - 1`` latencies, the message once per link."""
    if val.check_int("world", world, low=0) <= 1:
        return AlphaBeta(0.0, 0.0)
    return AlphaBeta((world - 1) * alpha, beta)


@dataclass(frozen=True)
class Cluster:
    """P GPUs and their collectives (per byte) and inversion time.

    Attributes:
        world_size: P.
        allreduce, broadcast, reduce: one collective over all P GPUs, ``alpha + beta * bytes``.
        inverse: seconds to invert one ``n x n`` damped factor on one GPU.
        gpus_per_node: GPUs per node (for tables and topology-aware variants).
        name: label for tables.
    """

    world_size: int
    allreduce: AlphaBeta
    broadcast: AlphaBeta
    reduce: AlphaBeta
    inverse: InverseCost
    gpus_per_node: int = 1
    name: str = ""

    def __post_init__(self) -> None:
        val.check_int("world_size", self.world_size, low=1)
        val.check_int("gpus_per_node", self.gpus_per_node, low=1)
        for n in ("allreduce", "broadcast", "reduce"):
            val.check_instance(n, getattr(self, n), AlphaBeta, "an AlphaBeta")
        val.check_instance("inverse", self.inverse, InverseCost, "an InverseCost")
        val.check_instance("name", self.name, str)

    @classmethod
    def ring(cls, world_size: int, link_alpha: float, link_beta: float, inverse: InverseCost, *,
             gpus_per_node: int = 1, intra_alpha: float | None = None, intra_beta: float | None = None,
             name: str = "") -> Cluster:
        """Collectives from per-link numbers (``link_beta`` in seconds per byte). Give ``intra_alpha`` and
        ``intra_beta`` (with ``gpus_per_node > 1`` dividing ``world_size``) for a hierarchical cluster."""
        p = val.check_int("world_size", world_size, low=1)
        a = val.check_real("link_alpha", link_alpha, val.Bound(low=0.0))
        b = val.check_real("link_beta", link_beta, val.Bound(low=0.0))
        g = val.check_int("gpus_per_node", gpus_per_node, low=1)
        if (intra_alpha is None) != (intra_beta is None):
            raise ValueError("give both intra_alpha and intra_beta, or neither")
        if intra_alpha is None or g == 1:
            return cls(world_size=p, allreduce=ring_allreduce(p, a, b), broadcast=chain_collective(p, a, b),
                       reduce=chain_collective(p, a, b), inverse=inverse, gpus_per_node=g, name=name)
        ia = val.check_real("intra_alpha", intra_alpha, val.Bound(low=0.0))
        ib = val.check_real("intra_beta", intra_beta, val.Bound(low=0.0))
        if p % g:
            raise ValueError(f"world_size={p} must be a multiple of gpus_per_node={g} for a hierarchical cluster")
        nodes = p // g
        intra_rs = AlphaBeta((g - 1) * ia, (g - 1) / g * ib)  # reduce-scatter (and all-gather) in a node
        inter = ring_allreduce(nodes, a, b / g)  # every node all-reduces 1/g of the message per GPU pair
        allreduce = AlphaBeta(2 * intra_rs.alpha + inter.alpha, 2 * intra_rs.beta + inter.beta)
        chain = AlphaBeta(chain_collective(nodes, a, b).alpha + chain_collective(g, ia, ib).alpha,
                          max(b if nodes > 1 else 0.0, ib))
        return cls(world_size=p, allreduce=allreduce, broadcast=chain, reduce=chain, inverse=inverse,
                   gpus_per_node=g, name=name)

    @classmethod
    def from_fit(cls, fit: AlphaBeta, fit_world_size: int, world_size: int, inverse: InverseCost, *,
                 gpus_per_node: int = 1, name: str = "") -> Cluster:
        """Per-link numbers from an all-reduce fitted at ``fit_world_size`` GPUs (inverting
        :func:`ring_allreduce`), then every collective at ``world_size``."""
        val.check_instance("fit", fit, AlphaBeta, "an AlphaBeta")
        p0 = val.check_int("fit_world_size", fit_world_size, low=2)
        link_alpha = fit.alpha / (2 * (p0 - 1))
        link_beta = fit.beta * p0 / (2 * (p0 - 1))
        return cls.ring(world_size, link_alpha, link_beta, inverse, gpus_per_node=gpus_per_node, name=name)

    def with_inverse(self, inverse: InverseCost) -> Cluster:
        return Cluster(self.world_size, self.allreduce, self.broadcast, self.reduce, inverse,
                       self.gpus_per_node, self.name)
