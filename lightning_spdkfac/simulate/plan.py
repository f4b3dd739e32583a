"""Which K-FAC schedule to run on a cluster, from the simulator: the programmatic side of ``spdkfac plan``.

* :func:`recommend` -- simulate a workload on a cluster under several schedules, fastest first;
* :func:`runtime_config` -- the ``SPDKFACStrategy`` arguments that run a simulator schedule, with what the
  runtime does differently;
* :func:`sim_schedule_from_options` -- the simulator's view of the runtime's ``SPDOptions``;
* :func:`plan` -- everything ``spdkfac plan`` prints, as a dict, from :class:`PlanInputs`.

The text report is :mod:`.report` (:func:`~.report.render`), the command line :mod:`.plan_cli`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import validation as val
from ..factor_shapes import is_diagonal, is_grouped, packed_numel, side
from ..schedule import REPLICATED, AlphaBeta
from ..schedule.placement import message_bytes
from ..vocabulary import SCHEDULE_PARTS
from .cluster import Cluster
from .memory import MEMORY_ASSUMPTIONS, memory_per_gpu
from .schedules.dpkfac import gradient_bytes
from .sim_schedule import SIM_SCHEDULES, SimSchedule, as_sim_schedule
from .timeline import simulate
from .timeline_core import CATEGORIES, Timeline
from .workload import Workload

__all__ = ["DEEPSPEED_CLASS", "DEFAULT_SCHEDULES", "STRATEGY_CLASS", "PlanInputs", "plan", "recommend",
           "runtime_config", "sim_schedule_from_options"]

# The schedules ``spdkfac plan`` compares unless told otherwise (names of SIM_SCHEDULES).
DEFAULT_SCHEDULES = ("dkfac", "mpd", "spd-paper", "spd", "spd-async", "spd-bf16", "spd-dear", "dpkfac")
STRATEGY_CLASS = "lightning_spdkfac.SPDKFACStrategy"
DEEPSPEED_CLASS = "lightning_spdkfac.SPDKFACDeepSpeedStrategy"


def recommend(workload: Workload, cluster: Cluster,
              schedules: Sequence[str | SimSchedule] = DEFAULT_SCHEDULES) -> list[tuple[str, Timeline]]:
    """Simulate ``workload`` on ``cluster`` under each schedule (a name of :data:`SIM_SCHEDULES` or a
    :class:`SimSchedule`); ``(name, timeline)`` pairs sorted by total time, fastest first (ties keep the
    given order). The first one is the recommendation."""
    given = val.check_sequence("schedules", schedules, f"SimSchedules or names of {', '.join(SIM_SCHEDULES)}")
    resolved = [as_sim_schedule(f"schedules[{i}]", s) for i, s in enumerate(given)]
    if not resolved:
        raise ValueError("schedules is empty: give at least one schedule to compare")
    names = [s.name for s in resolved]
    if len(set(names)) != len(names):
        raise ValueError(f"schedules must have distinct names, got {names}")
    out = [(s.name, simulate(workload, cluster, s)) for s in resolved]
    return sorted(out, key=lambda nt: nt[1].total)


def sim_schedule_from_options(options: Any, name: str = "config") -> SimSchedule:
    """The simulator's view of runtime :class:`~lightning_spdkfac.comm.scheduler.SPDOptions` (the
    runtime plans its placement with the measured inversion and broadcast models, so ``lbp_metric`` is
    ``"model"``)."""
    from ..comm.scheduler import SPDOptions

    val.check_instance("options", options, SPDOptions)
    val.check_instance("name", name, str)
    return SimSchedule(
        name, pipelining=options.pipelining, fusion=options.fusion, fuse_g=options.fuse_g,
        bucket_mb=float(options.bucket_mb), placement=options.placement, small_factor=options.small_factor,
        bytes_per_element=options.bytes_per_element,
        # None (the callback's setting) and "auto" (timed on the job) are simulated synchronous
        async_inverses=options.async_inverses is True and options.schedule != "dpkfac",
        dpkfac="reduce" if options.schedule == "dpkfac" else "off",
        description=f"the config's strategy: schedule {options.schedule}"
                    f"{' (timed on the job; simulated as spd)' if options.schedule == 'auto' else ''}, fusion "
                    f"{options.fusion}, placement {options.placement}, comm_dtype {options.comm_dtype}"
                    f"{', async inverses' if options.async_inverses is True else ''}",
    )


def _base_schedule(s: SimSchedule) -> str:
    """The runtime schedule (of :data:`~lightning_spdkfac.vocabulary.SCHEDULE_PARTS`) whose pipelining and
    placement ``s`` has; ``spd`` (the only pipelined one, whose parts can all be overridden) otherwise."""
    for name, parts in SCHEDULE_PARTS.items():
        if name not in ("spd", "dpkfac") and (parts["pipelining"], parts["placement"]) == (s.pipelining, s.placement):
            return name
    return "spd"


def _runtime_notes(s: SimSchedule) -> list[str]:
    """What the runtime does differently from ``s`` (empty when it runs ``s`` exactly)."""
    notes: list[str] = []
    if s.bytes_per_element not in (2, 4):
        notes.append(f"{s.bytes_per_element}-byte messages: the runtime sends float32 or bfloat16 only")
    if not s.fuse_g:
        notes.append("G factors reduced one by one (fuse_g=False): only SPDOptions(fuse_g=False) with "
                     "SPDDistributor does this; SPDKFACStrategy has no such argument, so with the strategy "
                     "G factors are fused like A factors")
    if s.lbp_metric == "linear":
        notes.append("placement planned with a load linear in n and no broadcast cost: the runtime's LBP "
                     "always plans with the measured n^3 inversion model and broadcast cost")
    if s.plan_full_sizes:
        notes.append("fusion planned with n*n elements per factor: the runtime plans with the n(n+1)/2 it sends")
    if s.sync_before_launch:
        notes.append("a device synchronize before every factor reduction: the runtime never does this")
    if s.reduce_to_owner:
        notes.append("owned factors reduced to their owner: the runtime all-reduces every factor")
    if s.broadcast_order == "owner_turns" and s.dpkfac == "off":
        notes.append("inverse broadcasts issued with owners taking turns: the runtime issues them by predicted "
                     "finish of the inversions (schedule.broadcast_order)")
    if s.async_inverses and s.async_compute == "idle_time":
        notes.append("asynchronous inversions simulated in the GPU's idle time only, as a lower-priority side "
                     "stream would run them: whether the runtime's side stream yields to forward/backward "
                     "depends on its priority; spd-async (async_compute='before_forward') assumes it does not")
    if s.early_inverse:
        notes.append("inversions start as soon as a factor is reduced: the runtime inverts in the "
                     "optimizer step")
    notes.extend(_issue19_notes(s))
    return notes


def _issue19_notes(s: SimSchedule) -> list[str]:
    """What the runtime does differently from ``s``'s issue-19 options (DeAR, DP-KFAC, async placement)."""
    notes: list[str] = []
    if s.factor_comm == "dear":
        notes.append("DeAR-style factor communication (reduce-scatter in backward, all-gather in the next forward, "
                     "factors one step old) is simulated only: the runtime all-reduces the factors")
    if s.dpkfac == "local":
        notes.append("local factors (each owner's data only, no factor reduction) are an approximation the runtime "
                     "does not run: schedule dpkfac reduces the factors to their owners")
    if s.dpkfac != "off" and s.broadcast_order == "owner_turns":
        notes.append("preconditioned gradients broadcast with owners taking turns: the runtime's dpkfac issues "
                     "them by predicted finish (schedule.preconditioned_order)")
    if s.async_placement == "period":
        notes.append("placement chosen by the simulated async period: the runtime plans lbp_channel for a "
                     "synchronous inversion phase")
    return notes


def runtime_config(schedule: SimSchedule) -> tuple[dict[str, Any], list[str]]:
    """``SPDKFACStrategy`` init arguments that run ``schedule``, and notes on what the runtime does
    differently (empty when it is an exact equivalent). The arguments are validated by
    ``SPDOptions.from_schedule`` (``async_inverses`` is emitted as ``True`` for an async schedule only)."""
    from ..comm.scheduler import SPDOptions

    s = val.check_instance("schedule", schedule, SimSchedule)
    if s.dpkfac != "off":
        return _dpkfac_config(s), _runtime_notes(s)
    base = _base_schedule(s)
    args: dict[str, Any] = {"schedule": base, "pipelining": s.pipelining, "fusion": s.fusion}
    if s.fusion == "bucket":
        args["bucket_mb"] = float(s.bucket_mb)
    args["placement"] = s.placement
    if s.small_factor is not None:
        args["small_factor"] = int(s.small_factor)
    args["comm_dtype"] = "bfloat16" if s.bytes_per_element == 2 else "float32"
    if s.async_inverses:
        args["async_inverses"] = True
    SPDOptions.from_schedule(base, **{k: v for k, v in args.items() if k != "schedule"})  # validates
    return args, _runtime_notes(s)


def _dpkfac_config(s: SimSchedule) -> dict[str, Any]:
    """``schedule: dpkfac`` with the fusion of its factor reductions (no placement: dpkfac plans layer
    owners itself); validated by ``SPDOptions.from_schedule``."""
    from ..comm.scheduler import SPDOptions

    args: dict[str, Any] = {"schedule": "dpkfac", "pipelining": s.pipelining, "fusion": s.fusion}
    if s.fusion == "bucket":
        args["bucket_mb"] = float(s.bucket_mb)
    args["comm_dtype"] = "bfloat16" if s.bytes_per_element == 2 else "float32"
    SPDOptions.from_schedule("dpkfac", **{k: v for k, v in args.items() if k != "schedule"})  # validates
    return args


@dataclass
class PlanInputs:
    """What :func:`plan` works from: the workload, the cluster and the schedules to compare, and labels for
    the output (``spdkfac plan`` fills it from the command line; a caller may build it directly)."""

    workload: Workload
    cluster: Cluster
    schedules: list[SimSchedule]
    workload_source: str = ""
    cluster_source: str = ""
    notes: list[str] = field(default_factory=list)
    config_strategy: dict[str, Any] | None = None  # the config's own init_args, for the "config" schedule
    measured: dict[str, Any] | None = None
    input_shape: tuple[int, ...] | None = None
    input_dtype: str = "float32"
    strategy_class: str = STRATEGY_CLASS
    gpu_memory: float | None = None  # bytes per GPU: recommend the fastest schedule that fits
    max_factor_side: int | None = None  # the layouts' size policy the model was profiled with (None: not profiled)

    def __post_init__(self) -> None:
        val.check_instance("workload", self.workload, Workload)
        if self.gpu_memory is not None:
            val.check_real("gpu_memory", self.gpu_memory, val.POSITIVE)
        val.check_instance("cluster", self.cluster, Cluster)
        for i, s in enumerate(val.check_sequence("schedules", self.schedules, "SimSchedules")):
            val.check_instance(f"schedules[{i}]", s, SimSchedule)


def _label(workload: Workload, key: tuple[int, str]) -> str:
    return f"{workload.layers[key[0]].name}:{key[1]}"


def _fusion_groups(workload: Workload, tl: Timeline) -> list[dict[str, Any]]:
    sides = tl.extra["sides"]
    bpe = tl.extra["schedule"].bytes_per_element
    out = []
    for k, g in enumerate(tl.groups):
        nbytes = sum(packed_numel(sides[i]) for i in g) * bpe
        out.append({"index": k, "factors": [_label(workload, tl.order[i]) for i in g], "bytes": nbytes})
    return out


def _placement(workload: Workload, cluster: Cluster, tl: Timeline) -> dict[str, Any]:
    sides = tl.extra["sides"]
    bpe = tl.extra["schedule"].bytes_per_element
    inv = cluster.inverse
    if tl.extra["schedule"].dpkfac != "off":
        return _layer_placement(workload, cluster, tl)
    repl = [i for i, o in enumerate(tl.owners) if o == REPLICATED]
    repl_s = sum(inv.time_of(sides[i]) for i in repl)
    ranks = []
    for r in range(cluster.world_size):
        own = [i for i, o in enumerate(tl.owners) if o == r]
        ranks.append({
            "rank": r,
            "factors": [_label(workload, tl.order[i]) for i in own],
            "inverse_s": repl_s + sum(inv.time_of(sides[i]) for i in own),
            "broadcast_s": sum(cluster.broadcast.time(message_bytes(sides[i], bpe)) for i in own),
        })
    sched = tl.extra["schedule"]
    policy = sched.placement + (" (candidate of shortest async period)" if sched.async_placement == "period" else "")
    return {"policy": policy if cluster.world_size > 1 else "replicated",
            "replicated": [_label(workload, tl.order[i]) for i in repl], "replicated_inverse_s": repl_s,
            "ranks": ranks}


def _layer_placement(workload: Workload, cluster: Cluster, tl: Timeline) -> dict[str, Any]:
    """dpkfac's owners: per rank its layers' factors, inversions and preconditioned-gradient broadcasts."""
    lp = tl.extra["layer_placement"]
    inv, ranks = cluster.inverse, []
    for r in range(cluster.world_size):
        own = lp.owned_by(r)
        ranks.append({
            "rank": r,
            "factors": [f"{workload.layers[i].name}:{w}" for i in own for w in ("A", "G")],
            "inverse_s": sum(inv.time_of(workload.layers[i].a_shape) + inv.time_of(workload.layers[i].g_shape)
                             for i in own),
            "broadcast_s": sum(cluster.broadcast.time(gradient_bytes(workload.layers[i]))
                               for i in own) if cluster.world_size > 1 else 0.0,
            "kfac_bytes": lp.memory[r],
        })
    return {"policy": "layers (plan_layer_placement)", "replicated": [], "replicated_inverse_s": 0.0,
            "ranks": ranks}


def ab_dict(ab: AlphaBeta) -> dict[str, float]:
    """An alpha-beta model as the plan's JSON holds it."""
    return {"alpha": ab.alpha, "beta": ab.beta}


def _cluster_summary(inputs: PlanInputs) -> dict[str, Any]:
    cl = inputs.cluster
    return {
        "name": cl.name, "source": inputs.cluster_source, "world_size": cl.world_size,
        "gpus_per_node": cl.gpus_per_node, "allreduce": ab_dict(cl.allreduce), "broadcast": ab_dict(cl.broadcast),
        "reduce": ab_dict(cl.reduce),
        "inverse": {"c0": cl.inverse.c0, "c1": cl.inverse.c1, "c2": cl.inverse.c2, "c3": cl.inverse.c3},
    }


def _workload_summary(inputs: PlanInputs) -> dict[str, Any]:
    """The model's summary; ``largest_factor`` is the largest side of a matrix that is inverted (a dense factor,
    a block of a grouped one), diagonal factors counted apart."""
    wl = inputs.workload
    layers = wl.layers
    shapes = [x for s in layers for x in (s.a_shape, s.g_shape)]
    diagonal = [side(x) for x in shapes if is_diagonal(x)]
    return {
        "name": wl.name, "source": inputs.workload_source,
        "input_shape": list(inputs.input_shape) if inputs.input_shape else None,
        "input_dtype": inputs.input_dtype,
        "batch_size": wl.batch_size, "layers": len(layers), "factors": 2 * len(layers),
        "params": wl.params, "kfac_params": sum(s.params for s in layers), "other_params": wl.other_params,
        "largest_factor": max((side(x) for x in shapes if not is_diagonal(x)), default=0),
        "diagonal_factors": len(diagonal), "largest_diagonal": max(diagonal, default=0),
        "grouped_factors": sum(1 for x in shapes if is_grouped(x)), "max_factor_side": inputs.max_factor_side,
        "ff_bp_s": wl.ff_bp, "factor_comp_s": wl.factor_comp,
        "grad_comm_s": wl.grad_comm,
    }


def _recommended(rows: list[dict[str, Any]], limit: float | None, notes: list[str]) -> str:
    """The fastest row that fits in ``limit`` bytes per GPU (any row without a limit); with none fitting,
    the one with the least memory, and a note saying so."""
    fits = [r for r in rows if r["fits"] is not False]
    if fits:
        return str(fits[0]["name"])
    assert limit is not None
    small = min(rows, key=lambda r: r["memory_bytes"]["total"])
    notes.append(f"no compared schedule fits in --gpu-memory {limit / 2**30:.2f} GiB per GPU; the smallest is "
                 f"{small['name']} ({small['memory_bytes']['total'] / 2**30:.2f} GiB), recommended anyway")
    return str(small["name"])


def plan(inputs: PlanInputs) -> dict[str, Any]:
    """Everything ``spdkfac plan`` prints, machine-readable (seconds, bytes)."""
    val.check_instance("inputs", inputs, PlanInputs)
    wl, cl = inputs.workload, inputs.cluster
    ranked = recommend(wl, cl, inputs.schedules)
    by_name = dict(ranked)
    baseline = by_name["dkfac"] if "dkfac" in by_name else simulate(wl, cl, "dkfac")
    notes = list(inputs.notes)
    if "dkfac" not in by_name:
        notes.append("dkfac is not compared but is simulated as the speedup baseline")
    rows = []
    for name, tl in ranked:
        s = tl.extra["schedule"]
        memory = memory_per_gpu(wl, tl)
        rows.append({"name": name, "description": s.description, "bytes_per_element": s.bytes_per_element,
                     "async_inverses": s.async_inverses,
                     "stale_or_local_factors": s.dpkfac == "local" or s.factor_comm == "dear",
                     "breakdown_s": {c: tl.breakdown[c] for c in CATEGORIES}, "total_s": tl.total,
                     "lower_bound_s": tl.lower_bound,
                     "speedup_vs_dkfac": baseline.total / tl.total if tl.total > 0 else None,
                     "memory_bytes": memory,
                     "fits": None if inputs.gpu_memory is None else memory["total"] <= inputs.gpu_memory})
    best_name = _recommended(rows, inputs.gpu_memory, notes)
    best = by_name[best_name]
    fitting = [r["name"] for r in rows if r["fits"] is not False]
    fp32 = next((n for n, t in ranked if t.extra["schedule"].bytes_per_element == 4 and n in fitting), None)
    rt_notes: list[str] = []
    if best_name == "config" and inputs.config_strategy is not None:
        args = dict(inputs.config_strategy)
    else:
        args, rt_notes = runtime_config(best.extra["schedule"])
    fp32_args = None
    if fp32 is not None and fp32 != best_name:
        fp32_args = (dict(inputs.config_strategy) if fp32 == "config" and inputs.config_strategy is not None
                     else runtime_config(by_name[fp32].extra["schedule"])[0])
    return {
        "cluster": _cluster_summary(inputs),
        "measured": inputs.measured,
        "workload": _workload_summary(inputs),
        "schedules": rows,
        "recommended": best_name,
        "fastest_fp32": fp32,
        "fusion_groups": _fusion_groups(wl, best),
        "placement": _placement(wl, cl, best),
        "runtime": {"strategy": {"class_path": inputs.strategy_class, "init_args": args}, "notes": rt_notes,
                    "fastest_fp32_init_args": fp32_args},
        "notes": notes,
        "memory": {"limit_bytes": inputs.gpu_memory, "assumptions": MEMORY_ASSUMPTIONS},
    }
