"""Every name the package accepts from a user, spelled once.

The runtime (``SPDOptions``, ``KFACOptions``, the strategies and their registry names), the CLI, the
planner's report and the simulator all read their choices from here, so a new schedule, fusion policy,
placement, communication dtype, factor approximation or inverse method is added in one place. Each tuple is derived
from its ``Literal`` type, which is what signatures (and so LightningCLI and mypy) see.
"""

from __future__ import annotations

import typing
from types import MappingProxyType
from typing import Any, Literal

# K-FAC communication schedules of the runtime (the simulator's own named variants, such as
# "spd-paper" or "spd-no-dtf", are in lightning_spdkfac.simulate.SIM_SCHEDULES). "dpkfac": distributed
# preconditioning, each layer's K-FAC state and work on one owner (comm/dpkfac.py).
ScheduleName = Literal["spd", "mpd", "dkfac", "dpkfac"]
# What a strategy's ``schedule`` accepts: a schedule, or "auto" (time the candidates, keep the fastest: comm/auto.py).
ScheduleChoice = Literal["spd", "mpd", "dkfac", "dpkfac", "auto"]
# A strategy's ``async_inverses``: on, off, None (the KFAC callback's setting) or "auto" (timed, like schedule="auto").
AsyncInversesChoice = bool | Literal["auto"] | None
# How factor all-reduces are grouped.
FusionName = Literal["dtf", "layerwise", "all", "bucket"]
# Who inverts which factor.
PlacementName = Literal["lbp", "lbp_channel", "round_robin", "replicated"]
# The dtype factor and inverse messages are sent in, as users spell it.
CommDtypeName = Literal["float32", "bfloat16"]
# How K-FAC treats weight sharing (Conv2d locations, Linear positions beyond the batch dim): one factor row per
# position ("expand") or one per example, aggregated over its positions ("reduce"); "auto": reduce for Conv2d,
# expand for Linear (each layer type's measured winner). See docs/math.md.
FactorApproxName = Literal["auto", "expand", "reduce"]
# How K-FAC inverts a layer's damped Kronecker block: each factor by Cholesky with the pi-balanced split of the
# damping ("cholesky"), or by eigendecompositions of both factors with the exact damping of the block ("eigen").
# See docs/math.md.
InverseMethodName = Literal["cholesky", "eigen"]
# Whose step size each layer's K-FAC direction takes (kfac/grafting.py): SGD's (the gradient's norm) or Adam's.
GraftingName = Literal["sgd", "adam"]
# How K-FAC sets its step size beyond the KL clip (kfac/step_size.py): the exact quadratic model's alpha along the
# optimizer's update, or its (alpha, mu) on the plane of the update and the previous one.
StepSizeName = Literal["quadratic", "quadratic_momentum"]
# What K-FAC's direction is (kfac/eigenbasis.py): the damped Kronecker inverse applied to the gradient ("kfac"), or
# Adam's per-entry second moment in the Kronecker eigenbasis of the factors ("eigen_adam", EKFAC/SOAP-style).
UpdateName = Literal["kfac", "eigen_adam"]

SCHEDULES: tuple[ScheduleName, ...] = typing.get_args(ScheduleName)
SCHEDULE_CHOICES: tuple[ScheduleChoice, ...] = typing.get_args(ScheduleChoice)
FUSIONS: tuple[FusionName, ...] = typing.get_args(FusionName)
PLACEMENTS: tuple[PlacementName, ...] = typing.get_args(PlacementName)
COMM_DTYPE_NAMES: tuple[CommDtypeName, ...] = typing.get_args(CommDtypeName)
FACTOR_APPROXES: tuple[FactorApproxName, ...] = typing.get_args(FactorApproxName)
INVERSE_METHODS: tuple[InverseMethodName, ...] = typing.get_args(InverseMethodName)
GRAFTINGS: tuple[GraftingName, ...] = typing.get_args(GraftingName)
STEP_SIZES: tuple[StepSizeName, ...] = typing.get_args(StepSizeName)
UPDATES: tuple[UpdateName, ...] = typing.get_args(UpdateName)
# The placements that balance load by cost and so can replicate small factors (``small_factor``).
LOAD_BALANCED_PLACEMENTS: tuple[PlacementName, ...] = ("lbp", "lbp_channel")

# What each schedule name means: the defaults of its three parts (each can be overridden: the ablations).
SCHEDULE_PARTS: typing.Mapping[ScheduleName, typing.Mapping[str, Any]] = MappingProxyType({
    "spd": MappingProxyType(dict(pipelining=True, fusion="dtf", placement="lbp_channel")),
    "mpd": MappingProxyType(dict(pipelining=False, fusion="layerwise", placement="round_robin")),
    "dkfac": MappingProxyType(dict(pipelining=False, fusion="layerwise", placement="replicated")),
    # (placement: unused, a layer's owner does all of its K-FAC work; plan_layer_placement places layers)
    "dpkfac": MappingProxyType(dict(pipelining=True, fusion="dtf", placement="lbp")),
})

# Names registered in Lightning's StrategyRegistry -> the fixed arguments each name stands for.
DDP_STRATEGY_NAMES: typing.Mapping[str, typing.Mapping[str, Any]] = MappingProxyType({
    "spdkfac": MappingProxyType({"start_method": "popen"}),
    "spdkfac_spawn": MappingProxyType({"start_method": "spawn"}),
    "spdkfac_fork": MappingProxyType({"start_method": "fork"}),
    **{f"spdkfac_{s}": MappingProxyType({"schedule": s}) for s in SCHEDULE_CHOICES if s != "spd"},
})
DEEPSPEED_STRATEGY_NAMES: typing.Mapping[str, typing.Mapping[str, Any]] = MappingProxyType({
    "spdkfac_deepspeed": MappingProxyType({"stage": 2}),
    **{f"spdkfac_deepspeed_stage_{stage}": MappingProxyType({"stage": stage}) for stage in (0, 1, 2, 3)},
})
