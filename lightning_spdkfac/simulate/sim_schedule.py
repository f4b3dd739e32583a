"""What the simulator simulates: :class:`SimSchedule` (how one K-FAC iteration is scheduled) and the named ones,
:data:`SIM_SCHEDULES` (not the runtime's ``SCHEDULES`` of :mod:`lightning_spdkfac.vocabulary`).

A schedule is data: the timeline core (:mod:`.timeline_core`) and the schedule modules
(:mod:`.schedules`) read its attributes; :func:`~lightning_spdkfac.simulate.timeline.simulate` picks the module
that runs it.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, replace
from typing import Any, Literal

from .. import validation as val
from ..vocabulary import FUSIONS, PLACEMENTS, FusionName, PlacementName

__all__ = ["SIM_SCHEDULES", "AsyncCompute", "AsyncPlacement", "BroadcastOrder", "DPKFAC", "FactorComm", "LbpMetric",
           "SimSchedule", "as_sim_schedule", "with_schedule"]

# How a placement weighs a factor: the cluster's inversion and broadcast models, or ``n`` (the original code).
LbpMetric = Literal["model", "linear"]
# The order in which every rank issues the inverse broadcasts: "finish" the runtime's
# (:func:`~lightning_spdkfac.schedule.broadcast_order`); "owner_turns" the runtime's before issue 17.
BroadcastOrder = Literal["finish", "owner_turns"]
# How asynchronous inversions share the GPU with the next forward/backward (:mod:`.schedules.spd`).
AsyncCompute = Literal["before_forward", "idle_time"]
# How factors are communicated: all-reduced, or DeAR's reduce-scatter in backward + all-gather in the next
# forward (:mod:`.schedules.dear`).
FactorComm = Literal["allreduce", "dear"]
# DP-KFAC (:mod:`.schedules.dpkfac`): off, factors reduced to each layer's owner, or factors from the owner's data only.
DPKFAC = Literal["off", "reduce", "local"]
# How an async schedule's placement is chosen: by its planner (for a synchronous phase), or by the simulated
# async period over lbp_channel's candidates (:mod:`.schedules.async_plan`).
AsyncPlacement = Literal["sync", "period"]


@dataclass(frozen=True)
class SimSchedule:
    """How an iteration is scheduled. The named ones are in :data:`SIM_SCHEDULES`.

    Attributes:
        pipelining: factor reductions launched from the hooks as factors become ready.
        fusion: fusion policy of the factor reductions, one of the runtime's
            (:data:`~lightning_spdkfac.vocabulary.FUSIONS`).
        fuse_g: ``False`` reduces every G factor on its own whatever ``fusion`` says (the original
            SPD-KFAC code fused only A factors).
        bucket_mb: bucket size for ``fusion="bucket"`` (64 MiB: Horovod's default fusion buffer).
        placement: inversion placement, one of the runtime's (:data:`~lightning_spdkfac.vocabulary.PLACEMENTS`;
            ``lbp_channel`` is the ``spd`` default).
        lbp_metric: ``"model"`` plans with the cluster's inversion and broadcast models (this project);
            ``"linear"`` with a load linear in ``n`` and no broadcast term (the original code).
        small_factor: factors with ``n`` below it are replicated (the original code: 1024).
        plan_full_sizes: DTF plans with ``n*n`` elements per factor while ``n(n+1)/2`` are sent (the
            original code's inconsistency).
        bytes_per_element: of factor and inverse messages: 4 (fp32) or 2 (bf16) (any positive size can be
            simulated; the runtime sends only these two).
        reduce_to_owner: factors that have an owner are reduced to it (a pipelined-chain reduce, half the
            link traffic of an all-reduce) instead of all-reduced; replicated ones are still all-reduced.
        early_inverse: a rank starts inverting a factor as soon as its reduction is complete, while the
            gradient all-reduce and later factor groups are still on the wire.
        sync_before_launch: a device-wide synchronize precedes every factor reduction (the original
            code): it waits for the reduction still on the wire, so the compute stream stalls until the
            channel is free before each launch.
        broadcast_order: the order in which every rank issues the inverse broadcasts (they run in that
            order on the channel, and each owner inverts in it): ``"finish"`` by predicted finish of the
            inversion, :func:`~lightning_spdkfac.schedule.broadcast_order`, the function the runtime
            calls; ``"owner_turns"`` the runtime's order before it (owners take turns, each with its next
            factor in layer order, whatever its inversion costs), kept for comparison.
        async_inverses: the runtime's ``async_inverses``: the step preconditions with the inverses of the
            previous step while the new ones are computed and broadcast in the background, overlapping
            the next iteration (:mod:`.schedules.spd` has the model). Excludes ``early_inverse``.
        async_compute: with ``async_inverses``, how the inversions share the GPU with the next
            forward/backward: ``"before_forward"`` (they run first and forward waits for them, as kernels
            queued first on a stream of equal priority) or ``"idle_time"`` (they run only when the compute
            stream is idle, after backward, as a lower-priority stream).
        factor_comm: ``"allreduce"``, or ``"dear"``: each fusion group reduce-scattered in backward and
            all-gathered in the next forward, so inversions use factors one step old (:mod:`.schedules.dear`).
        dpkfac: ``"off"``; ``"reduce"`` the runtime's ``schedule="dpkfac"`` (layer owners, factors reduced
            to them, preconditioned gradients broadcast: :mod:`.schedules.dpkfac`; ``placement`` is not used);
            ``"local"`` the paper's local-factor variant (no factor communication; an approximation).
        async_placement: with ``async_inverses``: ``"sync"`` the placement planner's owners; ``"period"``
            the candidate of shortest simulated async period (:mod:`.schedules.async_plan`).
    """

    name: str
    pipelining: bool = True
    fusion: FusionName = "dtf"
    fuse_g: bool = True
    bucket_mb: float = 64.0
    placement: PlacementName = "lbp_channel"
    lbp_metric: LbpMetric = "model"
    small_factor: int | None = None
    plan_full_sizes: bool = False
    bytes_per_element: int = 4
    reduce_to_owner: bool = False
    early_inverse: bool = False
    sync_before_launch: bool = False
    broadcast_order: BroadcastOrder = "finish"
    async_inverses: bool = False
    async_compute: AsyncCompute = "before_forward"
    factor_comm: FactorComm = "allreduce"
    dpkfac: DPKFAC = "off"
    async_placement: AsyncPlacement = "sync"
    description: str = ""

    def __post_init__(self) -> None:
        val.check_instance("name", self.name, str)
        for flag in ("pipelining", "fuse_g", "plan_full_sizes", "reduce_to_owner", "early_inverse",
                     "sync_before_launch", "async_inverses"):
            val.check_bool(flag, getattr(self, flag))
        if self.async_inverses and self.early_inverse:
            raise ValueError("async_inverses and early_inverse exclude each other: async inversions start when "
                             "backward ends, early ones as each factor is reduced; give one of them")
        val.check_choice("fusion", self.fusion, FUSIONS)
        val.check_real("bucket_mb", self.bucket_mb, val.POSITIVE)
        val.check_choice("placement", self.placement, PLACEMENTS)
        val.check_choice("lbp_metric", self.lbp_metric, typing.get_args(LbpMetric))
        val.check_choice("broadcast_order", self.broadcast_order, typing.get_args(BroadcastOrder))
        val.check_choice("async_compute", self.async_compute, typing.get_args(AsyncCompute))
        val.check_int("small_factor", self.small_factor, low=0, optional=True)
        val.check_int("bytes_per_element", self.bytes_per_element, low=1)
        val.check_instance("description", self.description, str)
        self._check_issue19()

    def _check_issue19(self) -> None:
        """``factor_comm``, ``dpkfac`` and ``async_placement``, alone and with the rest."""
        val.check_choice("factor_comm", self.factor_comm, typing.get_args(FactorComm))
        val.check_choice("dpkfac", self.dpkfac, typing.get_args(DPKFAC))
        val.check_choice("async_placement", self.async_placement, typing.get_args(AsyncPlacement))
        if self.async_placement == "period" and not self.async_inverses:
            raise ValueError("async_placement='period' needs async_inverses=True (it plans for the async period)")
        given = [n for n in ("async_inverses", "early_inverse", "reduce_to_owner") if getattr(self, n)]
        if self.factor_comm == "dear" and given:
            raise ValueError(f"factor_comm='dear' excludes {given[0]} (its inversions use the factors gathered "
                             "in forward, one step old)")
        if self.dpkfac != "off" and (given or self.factor_comm != "allreduce"):
            raise ValueError(f"dpkfac={self.dpkfac!r} excludes {(given or ['factor_comm=' + repr(self.factor_comm)])[0]} "
                             "(factors go to each layer's owner, which inverts and preconditions; nothing else is sent)")


_PAPER_BASE: dict[str, Any] = dict(fusion="bucket", bucket_mb=64.0, pipelining=False)
_PAPER_SPD: dict[str, Any] = dict(fuse_g=False, placement="lbp", lbp_metric="linear", small_factor=1024, sync_before_launch=True)
# The simulator's named schedules (not the runtime's SCHEDULES of lightning_spdkfac.vocabulary): D-KFAC and
# MPD-KFAC as the paper ran them, the paper's SPD-KFAC as its code ran, this project's spd and its variants.
SIM_SCHEDULES: dict[str, SimSchedule] = {
    s.name: s
    for s in (
        SimSchedule("dkfac", placement="replicated", **_PAPER_BASE,
                    description="D-KFAC: factors all-reduced after backward (64 MiB fusion), every GPU inverts all"),
        SimSchedule("mpd", placement="round_robin", **_PAPER_BASE,
                    description="MPD-KFAC: as D-KFAC, inversions round-robin, inverses broadcast"),
        SimSchedule("spd-paper", plan_full_sizes=True, **_PAPER_SPD,
                    description="SPD-KFAC as the paper's code ran: DTF on A only, LBP with a load linear in n, "
                    "a device synchronize before each reduction"),
        SimSchedule("spd-paper-no-pipelining", **{**_PAPER_SPD, **_PAPER_BASE},
                    description="paper's SPD without pipelining (factors after backward)"),
        SimSchedule("spd-paper-layerwise", fusion="layerwise", **_PAPER_SPD,
                    description="paper's SPD, pipelined without fusion"),
        SimSchedule("spd", description="this project's SPD: DTF on A and G, channel-aware LBP on the n^3 model"),
        SimSchedule("spd-owner-turns", broadcast_order="owner_turns",
                    description="spd with the runtime's broadcast order before issue 17 (owners take turns)"),
        SimSchedule("spd-lbp", placement="lbp", description="spd with the paper's LBP rule (on the n^3 model)"),
        SimSchedule("spd-no-pipelining", **_PAPER_BASE, description="spd with factors reduced after backward"),
        SimSchedule("spd-no-dtf", fusion="layerwise", description="spd with one reduction per factor"),
        SimSchedule("spd-no-lbp", placement="round_robin", description="spd with round-robin inversions"),
        SimSchedule("spd-bf16", bytes_per_element=2,
                    description="spd, factors and inverses sent in bf16 (the best schedule in the model)"),
        SimSchedule("spd-early-inverse", early_inverse=True,
                    description="spd, inversions start as soon as a factor is reduced"),
        SimSchedule("spd-reduce", reduce_to_owner=True, description="spd, owned factors reduced to their owner"),
        SimSchedule("spd-bf16-early", bytes_per_element=2, early_inverse=True,
                    description="spd-bf16 with early inversions"),
        SimSchedule("spd-async", async_inverses=True, async_placement="period",
                    description="spd with asynchronous inverses: inversions and broadcasts of one step "
                    "overlap the next iteration (one step stale); placement by the async period"),
        SimSchedule("spd-async-idle", async_inverses=True, async_compute="idle_time",
                    description="spd-async with inversions only in the GPU's idle time after backward "
                    "(a low-priority side stream)"),
        SimSchedule("spd-dear", factor_comm="dear",
                    description="spd with DeAR-style factor communication: reduce-scatter in backward, "
                    "all-gather in the next forward (inversions use factors one step old)"),
        SimSchedule("spd-async-sync-placement", async_inverses=True,
                    description="spd-async with lbp_channel's placement, planned for a synchronous phase"),
        SimSchedule("dpkfac", dpkfac="reduce",
                    description="DP-KFAC: factors reduced to each layer's owner, which inverts and preconditions "
                    "it and broadcasts the preconditioned gradient (by predicted finish, as the runtime)"),
        SimSchedule("dpkfac-local", dpkfac="local",
                    description="DP-KFAC with local factors (the owner's data only: an approximation), "
                    "no factor communication"),
        SimSchedule("dpkfac-turns", dpkfac="reduce", broadcast_order="owner_turns",
                    description="dpkfac with the preconditioned gradients broadcast with owners taking turns "
                    "(the runtime's first order)"),
        SimSchedule("spd-bf16-async", bytes_per_element=2, async_inverses=True,
                    description="spd-async with factors and inverses sent in bf16"),
        SimSchedule("mpd-async", placement="round_robin", async_inverses=True, **_PAPER_BASE,
                    description="MPD-KFAC with asynchronous inverses"),
        SimSchedule("dkfac-async", placement="replicated", async_inverses=True, **_PAPER_BASE,
                    description="D-KFAC with asynchronous inverses (every GPU inverts all, in the background)"),
    )
}


def as_sim_schedule(name: str, value: object) -> SimSchedule:
    """The argument ``name``: a :class:`SimSchedule`, or a name of :data:`SIM_SCHEDULES` (TypeError for
    anything else, ValueError for an unknown name)."""
    if isinstance(value, SimSchedule):
        return value
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a SimSchedule or one of {', '.join(map(repr, SIM_SCHEDULES))}, "
                        f"got {val.show(value)}")
    val.check_choice(name, value, SIM_SCHEDULES)
    return SIM_SCHEDULES[value]


def with_schedule(base: str, **changes: Any) -> SimSchedule:
    """A named schedule with some attributes changed (e.g. ``with_schedule("spd", bytes_per_element=2)``)."""
    val.check_choice("base", base, SIM_SCHEDULES)
    return replace(SIM_SCHEDULES[base], **changes)
