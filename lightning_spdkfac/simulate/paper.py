"""The SPD-KFAC paper's setup and measured breakdowns, and the calibration of a simulation to them.

Numbers are from Shi, Zhang, Li, "Accelerating Distributed K-FAC with Smart Parallelism of Computing and
Communication Tasks" (ICDCS 2021, arXiv 2107.06533), as summarised in the project's shared notes. What the
calibration takes from the paper, and what it must not:

* taken: the cluster (64 GPUs, 16 nodes x 4), the fitted all-reduce model, the small-factor threshold
  (n < 1024, chosen where an inversion costs as much as broadcasting its inverse), and, per model, the
  single-phase totals that do not depend on the schedule: FF&BP, FactorComp, GradComm (the same for every
  algorithm) and the D-KFAC InvComp (every GPU inverts every factor: the sum of all inversion times);
* never taken: any FactorComm, InvComm, MPD or SPD InvComp, or total - those are what the simulation must
  reproduce.

:func:`compare_phases` sets every simulated phase and total beside the paper's (issue 19's bands: 25% per
phase, 10% per total); :func:`factor_allreduce_gap` and :func:`small_factor_share` compute, from the paper's
own figures and the layer shapes, the measured numbers behind the misses (docs/simulator-fidelity.md).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, replace
from typing import Any, Literal

from .. import validation as val
from ..comm.triangle import triu_size
from ..factor_shapes import packed_numel, side
from ..schedule import AlphaBeta, InverseCost
from ..schedule.cost import _nnls_small
from .cluster import AllreduceAlgorithm, Cluster
from .models import PAPER_MODELS
from .timeline_core import grad_comm_seconds
from .workload import LayerSpec, Workload, profile_layers

__all__ = ["PAPER_ALLREDUCE", "PAPER_BREAKDOWN", "PAPER_SPEEDUPS", "PAPER_WORLD", "SMALL_FACTOR",
           "PaperCase", "paper_case", "paper_cluster", "paper_inverse"]

PAPER_WORLD = 64
PAPER_GPUS_PER_NODE = 4
# alpha = 9.29e-4 s, beta = 1.4335e-9 s per fp32 element -> per byte
PAPER_ALLREDUCE = AlphaBeta(9.29e-4, 1.4335e-9 / 4)
SMALL_FACTOR = 1024

# (FF&BP, GradComm, FactorComp, FactorComm, InvComp, InvComm, total), seconds
PAPER_BREAKDOWN: dict[str, dict[str, tuple[float, ...]]] = {
    "resnet50": {
        "dkfac": (.132, .065, .212, .170, .274, 0.0, .8525),
        "mpd": (.132, .065, .212, .170, .051, .134, .7635),
        "spd": (.132, .065, .212, .098, .105, .064, .6755),
    },
    "resnet152": {
        "dkfac": (.114, .159, .193, .439, .676, 0.0, 1.5807),
        "mpd": (.114, .159, .193, .436, .054, .438, 1.3933),
        "spd": (.114, .159, .193, .276, .281, .146, 1.1689),
    },
    "densenet201": {
        "dkfac": (.178, .186, .319, .332, .482, 0.0, 1.4964),
        "mpd": (.178, .186, .316, .350, .035, .468, 1.5340),
        "spd": (.178, .186, .316, .244, .402, .035, 1.3615),
    },
    "inception_v4": {
        "dkfac": (.134, .133, .198, .290, .431, 0.0, 1.1857),
        "mpd": (.134, .133, .193, .295, .049, .344, 1.1473),
        "spd": (.134, .133, .193, .204, .254, .073, .9907),
    },
}
PAPER_COLUMNS = ("FF&BP", "GradComm", "FactorComp", "FactorComm", "InvComp", "InvComm", "total")
# SPD-KFAC speedup over D-KFAC and over MPD-KFAC, as the paper states them
PAPER_SPEEDUPS = {
    "resnet50": (1.26, 1.13), "resnet152": (1.35, 1.19), "densenet201": (1.10, 1.13), "inception_v4": (1.20, 1.16),
}


def calibrate_inverse(sides_per_model: dict[str, list[int]], threshold: int = SMALL_FACTOR,
                      broadcast: AlphaBeta = PAPER_ALLREDUCE) -> InverseCost:
    """One ``c0 + c2 n^2 + c3 n^3`` for the paper's GPU, fitted (non-negative least squares, relative
    errors) to: per model, the D-KFAC InvComp total, which is the sum of the inversion times of all its
    factors (every GPU inverts every factor); and the threshold, where an inversion takes as long as
    sending its inverse's upper triangle (how the paper chose n = 1024, with its planner's fp32 model).
    One model for the four networks, as they ran on the same GPUs."""
    rows, target = [], []
    for name, sides in sides_per_model.items():
        total = PAPER_BREAKDOWN[name]["dkfac"][4]
        rows.append([float(len(sides)), float(sum(n**2 for n in sides)), float(sum(n**3 for n in sides))])
        target.append(total)
    t_thr = broadcast.time(triu_size(threshold) * 4)
    rows.append([1.0, float(threshold**2), float(threshold**3)])
    target.append(t_thr)
    scale = [max(r[j] for r in rows) for j in range(3)]
    columns = [[r[j] / scale[j] / t for r, t in zip(rows, target)] for j in range(3)]
    coef = _nnls_small(columns, [1.0] * len(target))
    return InverseCost(c0=coef[0] / scale[0], c2=coef[1] / scale[1], c3=coef[2] / scale[2])


_INVERSE: list[InverseCost] = []


def paper_inverse() -> InverseCost:
    """:func:`calibrate_inverse` over the four models (cached)."""
    if not _INVERSE:
        _INVERSE.append(calibrate_inverse(
            {name: [n for s in model_specs(name) for n in (s.a_side, s.g_side)] for name in PAPER_BREAKDOWN}))
    return _INVERSE[0]


@dataclass(frozen=True)
class PaperCase:
    """One of the paper's four models, calibrated: its workload and its 64-GPU cluster."""

    name: str
    specs: tuple[LayerSpec, ...]
    workload: Workload
    cluster: Cluster
    network: tuple[tuple[str, Any], ...] = ()  # paper_cluster's keyword arguments

    def at_world(self, world_size: int, **network: Any) -> tuple[Workload, Cluster]:
        """The same GPUs and network at another scale (:func:`paper_cluster` with this case's network
        options, updated by ``network``: per-link numbers from the 64-GPU fit on the two-level topology),
        and the measured gradient all-reduce scaled by the model's ratio between the two sizes."""
        p = val.check_int("world_size", world_size, low=1)
        cluster = paper_cluster(p, self.cluster.inverse, **{**dict(self.network), **network})
        modelled = replace(self.workload, grad_comm=None)
        ratio = grad_comm_seconds(modelled, cluster) / grad_comm_seconds(modelled, self.cluster)
        measured = self.workload.grad_comm  # None: grad_comm="model", costed by the simulator at any size
        return replace(self.workload, grad_comm=None if measured is None else measured * ratio), cluster


# The paper's nodes: 4 GPUs (RTX 2080 Ti, the shared notes' guess) on PCIe 3.0 x16. Textbook figures, not fitted:
# PCIe 3.0 x16 moves 15.75 GB/s per direction in theory, about 10 GB/s achieved by NCCL between GPUs of one
# node (1e-10 s per byte); a step of an intra-node collective costs about 5 microseconds (kernel launch and
# flag polling). The inter-node numbers are what the 64-GPU fit leaves when these are taken out of it.
PAPER_INTRA_ALPHA = 5e-6
PAPER_INTRA_BETA = 1e-10
# How the paper's cluster costs a broadcast (and a reduce):
# "allreduce": like the fitted all-reduce (the calibration before issue 19: the planner's n = 1024 threshold
#   was set with that model); "half": half of it, the authors' own estimate of a broadcast;
# "chain" / "tree": the textbook pipelined chain (NCCL's broadcast) / binomial tree on the two-level
#   topology whose per-link numbers come from the fit (:meth:`Cluster.from_fit`).
PaperBroadcast = Literal["allreduce", "half", "chain", "tree"]
PAPER_BROADCASTS: tuple[str, ...] = typing.get_args(PaperBroadcast)


def paper_cluster(world_size: int, inverse: InverseCost | None = None, name: str | None = None, *,
                  broadcast: PaperBroadcast = "allreduce", algorithm: AllreduceAlgorithm = "ring",
                  two_level: bool = False, overlap_slowdown: float = 0.0) -> Cluster:
    """The paper's network at ``world_size`` GPUs: at 64 (``algorithm="ring"``) its fitted all-reduce
    itself. Elsewhere, or with ``algorithm="tree"``: by default (``two_level=False``, the model before
    issue 19, which ``spdkfac plan`` uses) a flat ring or tree over all P GPUs with the per-link numbers
    of the fit; with ``two_level=True`` the two-level topology (nodes of 4 GPUs, one inter-node link per
    node shared by its 4 GPUs: :data:`PAPER_INTRA_ALPHA`, :data:`PAPER_INTRA_BETA` inside a node, the
    inter-node numbers inverted from the 64-GPU fit on 16 x 4; below two nodes, one node's links).
    ``broadcast``: :data:`PaperBroadcast` (default: like the all-reduce, the calibration of the paper
    table). ``inverse`` defaults to :func:`paper_inverse`."""
    p = val.check_int("world_size", world_size, low=1)
    val.check_choice("broadcast", broadcast, PAPER_BROADCASTS)
    inv = paper_inverse() if inverse is None else inverse
    g = min(PAPER_GPUS_PER_NODE, p)
    label = f"{p} GPUs" if name is None else name
    if p == 1:
        return Cluster(1, AlphaBeta(0.0, 0.0), AlphaBeta(0.0, 0.0), AlphaBeta(0.0, 0.0), inv, name=label,
                       overlap_slowdown=overlap_slowdown)
    kw: dict[str, Any] = dict(algorithm=algorithm, broadcast="tree" if broadcast == "tree" else "chain",
                              overlap_slowdown=overlap_slowdown)
    if not two_level:
        net = Cluster.from_fit(PAPER_ALLREDUCE, PAPER_WORLD, p, inv, gpus_per_node=g, **kw)
    elif p <= PAPER_GPUS_PER_NODE:  # one node: the intra-node links alone
        net = Cluster.ring(p, PAPER_INTRA_ALPHA, PAPER_INTRA_BETA, inv, gpus_per_node=g, **kw)
    else:
        net = Cluster.from_fit(PAPER_ALLREDUCE, PAPER_WORLD, p, inv, gpus_per_node=PAPER_GPUS_PER_NODE,
                               intra_alpha=PAPER_INTRA_ALPHA, intra_beta=PAPER_INTRA_BETA, shared_nic=True, **kw)
    ar = PAPER_ALLREDUCE if p == PAPER_WORLD and algorithm == "ring" else net.allreduce
    bc = {"allreduce": ar, "half": AlphaBeta(ar.alpha / 2, ar.beta / 2)}.get(broadcast, net.broadcast)
    return replace(net, allreduce=ar, broadcast=bc, reduce=bc, name=label,
                   reduce_scatter=net.reduce_scatter if ar is net.allreduce else AlphaBeta(ar.alpha / 2, ar.beta / 2),
                   allgather=net.allgather if ar is net.allreduce else AlphaBeta(ar.alpha / 2, ar.beta / 2))


_SPECS: dict[str, tuple[LayerSpec, ...]] = {}


def model_specs(name: str) -> tuple[LayerSpec, ...]:
    """K-FAC layer specs of one of the paper's models (built on the meta device; cached). Every factor is dense,
    as the paper ran them (``max_factor_side=None``; the runtime's default, 4608, keeps them dense too, but a
    smaller one would make ResNet-50's 4608-wide A factors diagonal)."""
    val.check_choice("name", name, PAPER_MODELS)
    if name not in _SPECS:
        import torch

        ctor, shape, _ = PAPER_MODELS[name]
        with torch.device("meta"):
            model = ctor()
        _SPECS[name] = tuple(profile_layers(model, shape, max_factor_side=None))
    return _SPECS[name]


def paper_case(name: str, grad_comm: str = "paper", **network: Any) -> PaperCase:
    """The calibrated 64-GPU case of one model. ``grad_comm="paper"`` takes the measured gradient
    all-reduce time (identical for every algorithm); ``"model"`` derives it from the all-reduce model.
    ``network``: :func:`paper_cluster`'s keyword arguments (``broadcast``, ``algorithm``, ``two_level``,
    ``overlap_slowdown``)."""
    val.check_choice("grad_comm", grad_comm, ("paper", "model"))
    specs = model_specs(name)
    _, _, batch = PAPER_MODELS[name]
    ffbp, gcomm, fcomp, _, _, _, _ = PAPER_BREAKDOWN[name]["dkfac"]
    workload = Workload.calibrated(name, specs, batch, ff_bp=ffbp, factor_comp=fcomp,
                                   grad_comm=gcomm if grad_comm == "paper" else None)
    cluster = paper_cluster(PAPER_WORLD, name="paper: 64 GPUs, 16 x 4", **network)
    return PaperCase(name=name, specs=specs, workload=workload, cluster=cluster,
                     network=tuple(sorted(network.items())))


# -- the per-phase comparison (issue 19): every phase and the total, simulated / paper's
PHASE_BAND = 0.25  # every per-phase figure within 25% of the paper's ...
TOTAL_BAND = 0.10  # ... and every total within 10%
PAPER_ALGORITHMS = {"dkfac": "dkfac", "mpd": "mpd", "spd-paper": "spd"}  # simulated schedule -> paper row


def compare_phases(name: str, sim_name: str, breakdown: dict[str, float]) -> dict[str, dict[str, Any]]:
    """Each of the paper's columns (phases and ``total``) of one model and algorithm: the simulated and
    the paper's seconds, their ratio (None where the paper's figure is 0: then ``miss`` says whether the
    simulation is not 0 either, beyond 1 ms) and ``miss``: outside :data:`PHASE_BAND` (phases) or
    :data:`TOTAL_BAND` (total)."""
    val.check_choice("sim_name", sim_name, PAPER_ALGORITHMS)
    paper = dict(zip(PAPER_COLUMNS, PAPER_BREAKDOWN[name][PAPER_ALGORITHMS[sim_name]]))
    sim = {c: breakdown[c] for c in PAPER_COLUMNS[:-1]}
    sim["total"] = sum(breakdown.values())  # Precondition (0 in the calibration) included
    out: dict[str, dict[str, Any]] = {}
    for c in PAPER_COLUMNS:
        band = TOTAL_BAND if c == "total" else PHASE_BAND
        ratio = sim[c] / paper[c] if paper[c] else None
        miss = abs(ratio - 1) > band + 1e-12 if ratio is not None else sim[c] > 1e-3
        out[c] = {"sim": sim[c], "paper": paper[c], "ratio": ratio, "miss": miss}
    return out


def factor_allreduce_gap(name: str, bucket_mb: float = 64.0) -> dict[str, float]:
    """The D-KFAC factor all-reduce, a phase with no scheduling in it (every factor's upper triangle in
    64 MiB fused all-reduces after backward, nothing to overlap): its element count, message count, the
    fit's prediction, the paper's measured FactorComm, and the per-element time that measurement implies
    (taking the fit's latency per message), against the fit's 1.4335 ns."""
    elems = sum(packed_numel(x) for s in model_specs(name) for x in (s.a_shape, s.g_shape))
    msgs = -(-elems * 4 // int(bucket_mb * 2**20))
    predicted = msgs * PAPER_ALLREDUCE.alpha + elems * 4 * PAPER_ALLREDUCE.beta
    measured = PAPER_BREAKDOWN[name]["dkfac"][3]
    implied = (measured - msgs * PAPER_ALLREDUCE.alpha) / elems
    return {"elements": float(elems), "messages": float(msgs), "fit_s": predicted, "paper_s": measured,
            "implied_ns_per_element": implied * 1e9, "fit_ns_per_element": PAPER_ALLREDUCE.beta * 4e9,
            "ratio": predicted / measured}


def small_factor_share(name: str, inverse: InverseCost | None = None) -> dict[str, float]:
    """Why the paper's SPD InvComp is out of reach: its SPD-KFAC replicates every factor with n < 1024,
    so its SPD InvComp is at least their inversion time, and under any per-factor cost that grows with n
    those are at most their share of the factors' count of the D-KFAC InvComp (the sum over all
    factors). Returns the count share, the share the paper's figures imply (SPD InvComp / D-KFAC
    InvComp, an upper bound on the replicated part's share, which the owners' work also fills) and the
    share under the calibrated inversion model."""
    inv = paper_inverse() if inverse is None else inverse
    ns = [x for s in model_specs(name) for x in (s.a_shape, s.g_shape)]
    small = [x for x in ns if side(x) < SMALL_FACTOR]
    return {"count_share": len(small) / len(ns),
            "paper_spd_over_dkfac": PAPER_BREAKDOWN[name]["spd"][4] / PAPER_BREAKDOWN[name]["dkfac"][4],
            "model_time_share": sum(inv.time_of(x) for x in small) / sum(inv.time_of(x) for x in ns)}
