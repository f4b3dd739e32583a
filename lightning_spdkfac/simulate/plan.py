"""``spdkfac plan``: which K-FAC schedule to run on a cluster, from the simulator.

Give a model (``--model pkg.module:Class --input-shape C,H,W``, a LightningCLI ``--config`` of this
project, or one of the paper's models with ``--paper``) and a cluster (P, an all-reduce alpha-beta fit or
per-link numbers, the inversion-time model; or ``--measure`` them on the current process group), and get:

1. the cluster and workload summary;
2. every compared schedule's simulated breakdown (:data:`~.timeline.CATEGORIES`), fastest first, with the
   recommendation;
3. the recommended schedule's fusion groups and inversion placement;
4. the ``SPDKFACStrategy`` arguments that run it, as a YAML snippet, with what the runtime cannot do.

Examples::

    spdkfac plan --paper resnet50
    spdkfac plan --model torchvision.models:resnet18 --input-shape 3,224,224 --world-size 16 --tflops 30
    spdkfac plan --config configs/digits_spdkfac.yaml --input-shape 1,8,8 --world-size 8
    torchrun --nproc_per_node=4 -m lightning_spdkfac.cli plan --paper resnet50 --measure

Programmatic use: :func:`recommend` (simulate and sort), :func:`runtime_config` (simulator schedule to
strategy arguments), :func:`plan` (everything ``main`` prints, as a dict).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..comm.triangle import triu_size
from ..schedule import REPLICATED, AlphaBeta, InverseCost, fit_alpha_beta, measure_inverse_cost
from .cluster import Cluster
from .timeline import CATEGORIES, SCHEDULES, SimSchedule, Timeline, simulate
from .workload import LayerSpec, Workload, profile_layers

__all__ = ["DEFAULT_SCHEDULES", "PlanError", "PlanInputs", "main", "plan", "recommend", "runtime_config",
           "sim_schedule_from_options"]

DEFAULT_SCHEDULES = ("dkfac", "mpd", "spd-paper", "spd", "spd-bf16")
STRATEGY_CLASS = "lightning_spdkfac.SPDKFACStrategy"
DEEPSPEED_CLASS = "lightning_spdkfac.SPDKFACDeepSpeedStrategy"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "int64": torch.int64, "int32": torch.int32}
_SHOW_RANKS = 8  # ranks listed one by one when P is larger than twice this
_SHOW_GROUPS = 24  # fusion groups listed one by one
_SHOW_FACTORS = 4  # factor names listed per group / rank


class PlanError(Exception):
    """A bad or missing argument: ``flag`` names it; :func:`main` prints it and exits with code 2."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag = flag
        self.message = message


# --------------------------------------------------------------------------------------------------
# programmatic API
# --------------------------------------------------------------------------------------------------
def _resolve_schedule(s: str | SimSchedule) -> SimSchedule:
    if isinstance(s, SimSchedule):
        return s
    if s not in SCHEDULES:
        raise ValueError(f"unknown schedule {s!r}; valid: {', '.join(SCHEDULES)}")
    return SCHEDULES[s]


def recommend(workload: Workload, cluster: Cluster,
              schedules: Sequence[str | SimSchedule] = DEFAULT_SCHEDULES) -> list[tuple[str, Timeline]]:
    """Simulate ``workload`` on ``cluster`` under each schedule (a name of :data:`SCHEDULES` or a
    :class:`SimSchedule`); ``(name, timeline)`` pairs sorted by total time, fastest first (ties keep the
    given order). The first one is the recommendation."""
    resolved = [_resolve_schedule(s) for s in schedules]
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
    return SimSchedule(
        name, pipelining=options.pipelining, fusion=options.fusion, fuse_g=options.fuse_g,
        bucket_mb=float(options.bucket_mb), placement=options.placement, small_factor=options.small_factor,
        bytes_per_element=options.bytes_per_element,
        description=f"the config's strategy: schedule {options.schedule}, fusion {options.fusion}, placement "
                    f"{options.placement}, comm_dtype {options.comm_dtype}",
    )


def runtime_config(schedule: SimSchedule) -> tuple[dict[str, Any], list[str]]:
    """``SPDKFACStrategy`` init arguments that run ``schedule``, and notes on what the runtime does
    differently (empty when it is an exact equivalent). The arguments are validated by
    ``SPDOptions.from_schedule``."""
    from ..comm.scheduler import SPDOptions

    s = schedule
    if not s.pipelining and s.placement == "replicated":
        base = "dkfac"
    elif not s.pipelining and s.placement == "round_robin":
        base = "mpd"
    else:
        base = "spd"
    args: dict[str, Any] = {"schedule": base, "pipelining": s.pipelining, "fusion": s.fusion}
    if s.fusion == "bucket":
        args["bucket_mb"] = float(s.bucket_mb)
    args["placement"] = s.placement
    if s.small_factor is not None:
        args["small_factor"] = int(s.small_factor)
    notes: list[str] = []
    if s.bytes_per_element == 2:
        args["comm_dtype"] = "bfloat16"
    else:
        args["comm_dtype"] = "float32"
        if s.bytes_per_element != 4:
            notes.append(f"{s.bytes_per_element}-byte messages: the runtime sends float32 or bfloat16 only")
    SPDOptions.from_schedule(base, **{k: v for k, v in args.items() if k != "schedule"})  # validates
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
    if s.early_inverse:
        notes.append("inversions start as soon as a factor is reduced: the runtime inverts in the "
                     "optimizer step")
    return args, notes


@dataclass
class PlanInputs:
    """What :func:`plan` works from: the workload, the cluster and the schedules to compare, and labels for
    the output (``main`` fills it from the command line; a caller may build it directly)."""

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


def _label(workload: Workload, key: tuple[int, str]) -> str:
    return f"{workload.layers[key[0]].name}:{key[1]}"


def _fusion_groups(workload: Workload, tl: Timeline) -> list[dict[str, Any]]:
    sides = tl.extra["sides"]
    bpe = tl.extra["schedule"].bytes_per_element
    out = []
    for k, g in enumerate(tl.groups):
        nbytes = sum(triu_size(sides[i]) for i in g) * bpe
        out.append({"index": k, "factors": [_label(workload, tl.order[i]) for i in g], "bytes": nbytes})
    return out


def _placement(workload: Workload, cluster: Cluster, tl: Timeline) -> dict[str, Any]:
    sides = tl.extra["sides"]
    bpe = tl.extra["schedule"].bytes_per_element
    inv = cluster.inverse
    repl = [i for i, o in enumerate(tl.owners) if o == REPLICATED]
    repl_s = sum(inv.time(sides[i]) for i in repl)
    ranks = []
    for r in range(cluster.world_size):
        own = [i for i, o in enumerate(tl.owners) if o == r]
        ranks.append({
            "rank": r,
            "factors": [_label(workload, tl.order[i]) for i in own],
            "inverse_s": repl_s + sum(inv.time(sides[i]) for i in own),
            "broadcast_s": sum(cluster.broadcast.time(triu_size(sides[i]) * bpe) for i in own),
        })
    return {"policy": tl.extra["schedule"].placement if cluster.world_size > 1 else "replicated",
            "replicated": [_label(workload, tl.order[i]) for i in repl], "replicated_inverse_s": repl_s,
            "ranks": ranks}


def _ab(ab: AlphaBeta) -> dict[str, float]:
    return {"alpha": ab.alpha, "beta": ab.beta}


def plan(inputs: PlanInputs) -> dict[str, Any]:
    """Everything ``spdkfac plan`` prints, machine-readable (seconds, bytes)."""
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
        rows.append({"name": name, "description": s.description, "bytes_per_element": s.bytes_per_element,
                     "breakdown_s": {c: tl.breakdown[c] for c in CATEGORIES}, "total_s": tl.total,
                     "speedup_vs_dkfac": baseline.total / tl.total if tl.total > 0 else None})
    best_name, best = ranked[0]
    fp32 = next((n for n, t in ranked if t.extra["schedule"].bytes_per_element == 4), None)
    if best_name == "config" and inputs.config_strategy is not None:
        args, rt_notes = dict(inputs.config_strategy), []
    else:
        args, rt_notes = runtime_config(best.extra["schedule"])
    fp32_args = None
    if fp32 is not None and fp32 != best_name:
        fp32_args = (dict(inputs.config_strategy) if fp32 == "config" and inputs.config_strategy is not None
                     else runtime_config(by_name[fp32].extra["schedule"])[0])
    layers = wl.layers
    return {
        "cluster": {
            "name": cl.name, "source": inputs.cluster_source, "world_size": cl.world_size,
            "gpus_per_node": cl.gpus_per_node, "allreduce": _ab(cl.allreduce), "broadcast": _ab(cl.broadcast),
            "reduce": _ab(cl.reduce),
            "inverse": {"c0": cl.inverse.c0, "c1": cl.inverse.c1, "c2": cl.inverse.c2, "c3": cl.inverse.c3},
        },
        "measured": inputs.measured,
        "workload": {
            "name": wl.name, "source": inputs.workload_source,
            "input_shape": list(inputs.input_shape) if inputs.input_shape else None,
            "input_dtype": inputs.input_dtype,
            "batch_size": wl.batch_size, "layers": len(layers), "factors": 2 * len(layers),
            "params": wl.params, "kfac_params": sum(s.params for s in layers), "other_params": wl.other_params,
            "largest_factor": max((max(s.a_side, s.g_side) for s in layers), default=0),
            "ff_bp_s": wl.ff_bp, "factor_comp_s": wl.factor_comp,
            "grad_comm_s": wl.grad_comm,
        },
        "schedules": rows,
        "recommended": best_name,
        "fastest_fp32": fp32,
        "fusion_groups": _fusion_groups(wl, best),
        "placement": _placement(wl, cl, best),
        "runtime": {"strategy": {"class_path": inputs.strategy_class, "init_args": args}, "notes": rt_notes,
                    "fastest_fp32_init_args": fp32_args},
        "notes": notes,
    }


# --------------------------------------------------------------------------------------------------
# text output
# --------------------------------------------------------------------------------------------------
def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool]) -> str:
    widths = [max(len(h), *(len(r[j]) for r in rows)) if rows else len(h) for j, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if rj else c.ljust(w) for c, w, rj in zip(cells, widths, right)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _x(speedup: float | None) -> str:
    return "-" if speedup is None else f"{speedup:.2f}x"


def _count(n: int) -> str:
    return f"{n / 1e6:.2f} M" if n >= 100_000 else f"{n:,}"


def _yaml_flow(d: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(d, sort_keys=False, default_flow_style=True, width=1000).strip()


def _few(names: Sequence[str], width: int = 64) -> str:
    """Comma-separated names, cut to about ``width`` characters with a count of the rest."""
    text = ", ".join(names)
    if len(text) <= width:
        return text
    shown: list[str] = []
    for n in names:
        if len(", ".join([*shown, n])) > width - 24 and shown:
            break
        shown.append(n)
    return ", ".join(shown) + f", +{len(names) - len(shown)} more ({len(names)} factors)"


def _fmt_ab(ab: dict[str, float]) -> str:
    bw = f"{1e-9 / ab['beta']:.2f} GB/s" if ab["beta"] > 0 else "inf GB/s"
    return f"alpha {ab['alpha'] * 1e6:.1f} us, beta {ab['beta']:.4g} s/B ({bw})"


def _yaml(strategy: dict[str, Any]) -> str:
    import yaml

    body = yaml.safe_dump({"trainer": {"strategy": strategy}},
                          sort_keys=False, default_flow_style=False)
    return body.rstrip()


def render(result: dict[str, Any]) -> str:
    """The text tables of one :func:`plan` result."""
    c, w = result["cluster"], result["workload"]
    digits = 1 if min(r["total_s"] for r in result["schedules"]) >= 0.01 else 3

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.{digits}f}"

    out: list[str] = []
    out.append("== Cluster and workload ==")
    per_node = f" ({c['gpus_per_node']} per node)" if c["gpus_per_node"] > 1 else ""
    out.append(f"cluster     {c['world_size']} GPU{'s' if c['world_size'] != 1 else ''}{per_node}, {c['source']}")
    out.append(f"all-reduce  {_fmt_ab(c['allreduce'])}")
    out.append(f"broadcast   {_fmt_ab(c['broadcast'])}")
    inv = c["inverse"]
    out.append(f"inverse     {inv['c0']:.3g} + {inv['c2']:.3g} n^2 + {inv['c3']:.3g} n^3 s"
               + (f" + {inv['c1']:.3g} n" if inv["c1"] else ""))
    shape = "x".join(str(d) for d in w["input_shape"]) if w["input_shape"] else "-"
    if w["input_dtype"] != "float32":
        shape += f" ({w['input_dtype']})"
    out.append(f"model       {w['name']} ({w['source']}), input {shape}")
    out.append(f"            {w['layers']} K-FAC layers, {w['factors']} factors (largest {w['largest_factor']}), "
               f"{_count(w['params'])} params ({_count(w['other_params'])} outside K-FAC layers)")
    out.append(f"            per-GPU batch {w['batch_size']}: FF&BP {ms(w['ff_bp_s'])} ms, "
               f"FactorComp {ms(w['factor_comp_s'])} ms")
    m = result.get("measured")
    if m:
        out.append(f"measured    on {m['group_world_size']} ranks ({m['backend']}, {m['device']}): "
                   f"{len(m['sizes_bytes'])} sizes {m['sizes_bytes'][0]}..{m['sizes_bytes'][-1]} B; "
                   f"inversions n = {', '.join(str(n) for n in m['inverse_ns'])}")
    out.append("")

    out.append("== Simulated iteration, ms (fastest first) ==")
    headers = ["", "schedule", *CATEGORIES, "total", "speedup"]
    rows = []
    for r in result["schedules"]:
        mark = "*" if r["name"] == result["recommended"] else ""
        rows.append([mark, r["name"], *(ms(r["breakdown_s"][k]) for k in CATEGORIES), ms(r["total_s"]),
                     _x(r["speedup_vs_dkfac"])])
    out.append(_table(headers, rows, [False, False] + [True] * (len(CATEGORIES) + 2)))
    best = result["schedules"][0]
    out.extend(f"{r['name']}: {r['description']}" for r in result["schedules"] if r["name"] == "config")
    out.append(f"speedup: over dkfac. * recommended: {best['name']} ({ms(best['total_s'])} ms per iteration, "
               f"{_x(best['speedup_vs_dkfac'])}) - {best['description']}")
    if best["bytes_per_element"] != 4 and result["fastest_fp32"]:
        f = next(r for r in result["schedules"] if r["name"] == result["fastest_fp32"])
        out.append(f"note: {best['name']} sends factors and inverses in bf16, which changes the numerics; the "
                   f"fastest fp32 schedule is {f['name']} ({ms(f['total_s'])} ms, {_x(f['speedup_vs_dkfac'])})")
    out.append("")

    groups = result["fusion_groups"]
    out.append(f"== Fusion groups of {best['name']}: {len(groups)} factor reduction{'s' if len(groups) != 1 else ''}, "
               f"{sum(g['bytes'] for g in groups) / 1e6:.1f} MB ==")
    if groups:
        shown = groups if len(groups) <= _SHOW_GROUPS else groups[: _SHOW_GROUPS - 4] + groups[-4:]
        rows = []
        for k, g in enumerate(shown):
            if len(groups) > _SHOW_GROUPS and k == _SHOW_GROUPS - 4:
                rest = groups[_SHOW_GROUPS - 4: -4]
                rows.append(["...", f"{len(rest)} more groups", f"{sum(x['bytes'] for x in rest) / 1e6:.2f}"])
            rows.append([str(g["index"]), _few(g["factors"]), f"{g['bytes'] / 1e6:.2f}"])
        out.append(_table(["group", "factors", "MB"], rows, [True, False, True]))
    else:
        out.append("(one GPU: nothing is reduced)")
    out.append("")

    p = result["placement"]
    ranks = p["ranks"]
    out.append(f"== Inversion placement of {best['name']} ({p['policy']}) ==")
    if p["replicated"]:
        out.append(f"replicated (every rank inverts them, nothing sent): {len(p['replicated'])} factors, "
                   f"{ms(p['replicated_inverse_s'])} ms: {_few(p['replicated'], 90)}")
    if any(r["factors"] for r in ranks):
        many = len(ranks) > 2 * _SHOW_RANKS
        shown = ranks[:_SHOW_RANKS] if many else ranks
        rows = [[str(r["rank"]), str(len(r["factors"])), ms(r["inverse_s"]), ms(r["broadcast_s"]),
                 _few(r["factors"])] for r in shown]
        out.append(_table(["rank", "owned", "invert ms", "bcast ms", "owned factors"], rows,
                          [True, True, True, True, False]))
        if many:
            rest = ranks[_SHOW_RANKS:]
            load = [r["inverse_s"] + r["broadcast_s"] for r in rest]
            top = max(range(len(rest)), key=load.__getitem__)
            out.append(f"... ranks {_SHOW_RANKS}-{len(ranks) - 1}: {sum(len(r['factors']) for r in rest)} owned "
                       f"factors ({min(len(r['factors']) for r in rest)}-{max(len(r['factors']) for r in rest)} "
                       f"per rank), invert+bcast {ms(min(load))}-{ms(max(load))} ms "
                       f"(most: rank {rest[top]['rank']}); see --json for all ranks")
        out.append("invert ms: the rank's owned and the replicated inversions; bcast ms: its owned inverses' "
                   "broadcasts (all ranks share one channel)")
    out.append("")

    rt = result["runtime"]
    out.append(f"== Runtime configuration for {best['name']} (LightningCLI config) ==")
    out.append(_yaml(rt["strategy"]))
    if rt["notes"]:
        out.append(f"not an exact equivalent: the simulated {best['name']} differs from what the runtime runs:")
        out.extend(f"  - {n}" for n in rt["notes"])
    if rt.get("fastest_fp32_init_args") and best["bytes_per_element"] != 4:
        args = _yaml_flow(rt["fastest_fp32_init_args"])
        out.append(f"fp32 alternative ({result['fastest_fp32']}): init_args: {args}")
    out.append("The runtime measures its own alpha-beta models and factor ready times at start-up and plans "
               "from them; the groups and placement above are the simulator's.")
    if result["notes"]:
        out.append("")
        out.extend(f"note: {n}" for n in result["notes"])
    return "\n".join(out)


# --------------------------------------------------------------------------------------------------
# argument handling
# --------------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spdkfac plan",
        description="Recommend a K-FAC schedule (D-KFAC, MPD-KFAC, SPD-KFAC variants) for a model on a cluster, "
                    "from the cluster simulator: breakdown per schedule, fusion groups, placement and the "
                    "SPDKFACStrategy arguments.",
        epilog="examples:\n  spdkfac plan --paper resnet50\n"
               "  spdkfac plan --model lightning_spdkfac.demo.digits:DigitsCNN --input-shape 1,8,8 --world-size 8\n"
               "  spdkfac plan --config configs/digits_spdkfac.yaml --input-shape 1,8,8\n"
               "  torchrun --nproc_per_node=4 -m lightning_spdkfac.cli plan --paper resnet50 --measure",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    m = p.add_argument_group("model (one of --model, --config, --paper)")
    m.add_argument("--model", metavar="PATH", help="pkg.module:Class (or factory function), or pkg.module.Class")
    m.add_argument("--config", metavar="YAML", action="append", help="a LightningCLI config: model.class_path/"
                   "init_args (and trainer.strategy, compared as schedule 'config'); repeat to layer configs "
                   "as LightningCLI does (e.g. configs/digits_spdkfac.yaml configs/schedules/mpd.yaml)")
    m.add_argument("--paper", metavar="NAME", help="one of the paper's models with its calibrated 64-GPU case: "
                   "resnet50, resnet152, densenet201, inception_v4")
    m.add_argument("--input-shape", metavar="C,H,W", help="shape of one sample, without the batch dimension")
    m.add_argument("--init-args", metavar="JSON", help="keyword arguments of the model class, a JSON object")
    m.add_argument("--input-dtype", default="float32", choices=sorted(_DTYPES),
                   help="dtype of the sample (default float32; int64 for token ids)")
    w = p.add_argument_group("compute")
    w.add_argument("--batch-size", type=int, metavar="B", help="per-GPU batch (default 32; --paper: the paper's; "
                   "--config: data.init_args.batch_size)")
    w.add_argument("--tflops", type=float, metavar="T", help="effective forward/backward TFLOP/s per GPU "
                   "(default 20; --paper: the calibrated times unless given)")
    w.add_argument("--factor-tflops", type=float, metavar="T", help="TFLOP/s of factor computation (default --tflops)")
    c = p.add_argument_group("cluster (default: the paper's network scaled to P)")
    c.add_argument("--world-size", type=int, metavar="P", help="number of GPUs (default 64; --measure: the group's)")
    c.add_argument("--gpus-per-node", type=int, metavar="G", help="GPUs per node (hierarchical with --intra-*)")
    c.add_argument("--alpha", type=float, help="all-reduce latency, seconds (fit at --fit-world-size)")
    c.add_argument("--beta", type=float, help="all-reduce seconds per byte (fit at --fit-world-size)")
    c.add_argument("--fit-world-size", type=int, metavar="P0", help="world size of --alpha/--beta (default P)")
    c.add_argument("--link-alpha", type=float, help="per-link latency, seconds (ring collectives)")
    c.add_argument("--link-beta", type=float, help="per-link seconds per byte")
    c.add_argument("--intra-alpha", type=float, help="intra-node link latency, seconds (with --link-*)")
    c.add_argument("--intra-beta", type=float, help="intra-node link seconds per byte (with --link-*)")
    c.add_argument("--inverse", metavar="C0,C2,C3", help="inversion time c0 + c2 n^2 + c3 n^3 seconds "
                   "(default: calibrated to the paper's GPUs; --measure: measured here)")
    c.add_argument("--measure", action="store_true", help="measure all-reduce, broadcast (and inversion) on the "
                   "current torch.distributed group (env://, as torchrun sets it); rank 0 prints")
    c.add_argument("--measure-max-mb", type=float, default=64.0, metavar="MB",
                   help="largest probe message of --measure (default 64; capped by the largest factor)")
    c.add_argument("--measure-repeats", type=int, default=5, metavar="N", help="timed runs per size (default 5)")
    o = p.add_argument_group("output")
    o.add_argument("--schedules", metavar="A,B,...", help=f"schedules to compare (default {','.join(DEFAULT_SCHEDULES)}"
                   f"); valid: {', '.join(SCHEDULES)}")
    o.add_argument("--json", metavar="PATH", help="also write everything machine-readable to PATH")
    return p


def _ints(flag: str, text: str) -> tuple[int, ...]:
    parts = [t.strip() for t in re.split(r"[,xX]", text.strip())]
    try:
        vals = tuple(int(t) for t in parts)
    except ValueError:
        raise PlanError(flag, f"expected positive integers separated by commas (e.g. 3,224,224), got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise PlanError(flag, f"expected positive integers separated by commas (e.g. 3,224,224), got {text!r}")
    return vals


def _positive(flag: str, value: float | None, allow_zero: bool = True) -> float | None:
    if value is None:
        return None
    if not math.isfinite(value) or value < 0 or (not allow_zero and value == 0):
        raise PlanError(flag, f"must be a {'non-negative' if allow_zero else 'positive'} number, got {value!r}")
    return value


def _resolve(flag: str, path: str) -> Callable[..., Any]:
    if ":" in path:
        mod, _, attr = path.partition(":")
    else:
        mod, _, attr = path.rpartition(".")
    if not mod or not attr:
        raise PlanError(flag, f"expected pkg.module:Class or pkg.module.Class, got {path!r}")
    try:
        obj: Any = importlib.import_module(mod)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's path
        raise PlanError(flag, f"cannot import module {mod!r} of {path!r}: {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PlanError(flag, f"module {mod!r} has no attribute {attr!r} (from {path!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise PlanError(flag, f"{path!r} is a {type(obj).__name__}, not a class or function that builds a model")
    return obj


class _NotAModule(PlanError):
    pass


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def _profile(flag: str, factory: Callable[..., Any], init_args: dict[str, Any], shape: tuple[int, ...],
             notes: list[str], dtype: torch.dtype) -> tuple[torch.nn.Module, list[LayerSpec]]:
    """Build the model (meta device first, then the CPU) and read its K-FAC layers."""
    args_flag = "--init-args" if flag == "--model" else "--config (model.init_args)"

    def build(device: str | None) -> torch.nn.Module:
        try:
            if device is None:
                model = factory(**init_args)
            else:
                with torch.device(device):
                    model = factory(**init_args)
        except TypeError as e:
            raise PlanError(args_flag if init_args else flag, f"building the model failed: {e}") from e
        except Exception as e:  # noqa: BLE001 - the user's code
            raise PlanError(flag, f"building the model failed: {type(e).__name__}: {_first_line(e)}") from e
        if not isinstance(model, torch.nn.Module):
            raise _NotAModule(flag, f"the model builder returned a {type(model).__name__}, not a torch.nn.Module")
        return model

    try:
        model = build("meta")
        return model, profile_layers(model, shape, dtype=dtype)
    except _NotAModule:
        raise
    except Exception as e:  # noqa: BLE001 - anything the model does on the meta device: retry on the CPU
        cause = e.message if isinstance(e, PlanError) else f"{type(e).__name__}: {_first_line(e)}"
    model = build(None)
    notes.append(f"the model could not be built or run on the meta device ({cause[:160]}); it was built on the "
                 "CPU and run on one sample instead")
    try:
        return model, profile_layers(model, shape, dtype=dtype)
    except Exception as e:  # noqa: BLE001
        hint = " (token ids? add --input-dtype int64)" if dtype.is_floating_point else ""
        raise PlanError("--input-shape", f"the forward pass of one {dtype} sample of shape {shape} failed: "
                        f"{type(e).__name__}: {_first_line(e)}{hint}") from None


def _kfac_layers(flag: str, factory: Callable[..., Any], init_args: dict[str, Any], shape: tuple[int, ...],
                 notes: list[str], dtype: torch.dtype) -> tuple[list[LayerSpec], int]:
    """The model's K-FAC layers and its parameters outside them."""
    model, specs = _profile(flag, factory, init_args, shape, notes, dtype)
    if not specs:
        raise PlanError(flag, "the model has no layer K-FAC handles (nn.Conv2d / nn.Linear) on the forward path")
    total = sum(p.numel() for p in model.parameters())
    return specs, max(0, total - sum(s.params for s in specs))


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``, mappings merged key by key; a mapping naming another ``class_path`` replaces."""
    out = dict(base)
    for k, v in top.items():
        old = out.get(k)
        if isinstance(old, dict) and isinstance(v, dict) and v.get("class_path", old.get("class_path")) == old.get(
                "class_path"):
            out[k] = _merge(old, v)
        else:
            out[k] = v
    return out


def _config(paths: Sequence[str], notes: list[str]
            ) -> tuple[str, dict[str, Any], Any, dict[str, Any] | None, int | None, str]:
    """(model class path, init args, SPDOptions of the strategy or None, its init args, data batch size,
    the strategy class to recommend)."""
    import yaml

    cfg: dict[str, Any] = {}
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                layer = yaml.safe_load(f)
        except OSError as e:
            raise PlanError("--config", f"cannot read {path!r}: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            raise PlanError("--config", f"{path!r} is not valid YAML: {e}") from None
        if layer is None:
            continue
        if not isinstance(layer, dict):
            raise PlanError("--config", f"{path!r} is not a mapping of LightningCLI sections")
        cfg = _merge(cfg, layer)
    path = " + ".join(paths)
    if not isinstance(cfg.get("model"), dict) or "class_path" not in cfg["model"]:
        raise PlanError("--config", f"{path!r} has no model.class_path (a LightningCLI config of this project)")
    model = cfg["model"]
    init_args = model.get("init_args") or {}
    if not isinstance(init_args, dict):
        raise PlanError("--config", f"model.init_args of {path!r} must be a mapping")
    batch = None
    data = cfg.get("data")
    if isinstance(data, dict) and isinstance(data.get("init_args"), dict):
        b = data["init_args"].get("batch_size")
        if isinstance(b, int) and not isinstance(b, bool) and b > 0:
            batch = b
    trainer = cfg.get("trainer") if isinstance(cfg.get("trainer"), dict) else {}
    strategy = trainer.get("strategy")
    options, strategy_args, strategy_class = None, None, STRATEGY_CLASS
    if strategy is not None:
        from ..comm.scheduler import SPDOptions
        from ..lightning.strategy import SPD_ARGUMENTS

        given: dict[str, Any] | None = None
        if isinstance(strategy, str) and strategy.startswith("spdkfac"):  # a registered name
            if strategy.startswith("spdkfac_deepspeed"):
                given, strategy_class = {}, DEEPSPEED_CLASS
            elif strategy in ("spdkfac", "spdkfac_spawn", "spdkfac_fork"):
                given = {}
            elif strategy in ("spdkfac_mpd", "spdkfac_dkfac"):
                given = {"schedule": strategy.split("_", 1)[1]}
        elif isinstance(strategy, dict) and str(strategy.get("class_path", "")).rsplit(".", 1)[-1] in (
                "SPDKFACStrategy", "SPDKFACDeepSpeedStrategy"):
            given = dict(strategy.get("init_args") or {})
            if strategy["class_path"].endswith("DeepSpeedStrategy"):
                strategy_class = DEEPSPEED_CLASS
        if given is None:
            shown = strategy if isinstance(strategy, str) else strategy.get("class_path") if isinstance(
                strategy, dict) else strategy
            notes.append(f"the config's trainer.strategy ({shown}) is not an SPD-KFAC strategy: not compared")
        else:
            kw = {k: given[k] for k in SPD_ARGUMENTS if k in given}
            if "profile_steps" in kw:
                kw["profile_steps"] = tuple(kw["profile_steps"])
            try:
                options = SPDOptions.from_schedule(given.get("schedule", "spd"), **kw)
            except (TypeError, ValueError) as e:
                raise PlanError("--config", f"trainer.strategy.init_args: {e}") from None
            strategy_args = {"schedule": options.schedule, "pipelining": options.pipelining,
                             "fusion": options.fusion, "placement": options.placement}
            if options.fusion == "bucket":
                strategy_args["bucket_mb"] = options.bucket_mb
            if options.small_factor is not None:
                strategy_args["small_factor"] = options.small_factor
            strategy_args["comm_dtype"] = options.comm_dtype
            if strategy_class == DEEPSPEED_CLASS:
                notes.append("the strategy snippet holds the K-FAC schedule arguments only: keep the config's "
                             "DeepSpeed arguments (stage, config, ...) beside them")
    return model["class_path"], init_args, options, strategy_args, batch, strategy_class


def _inverse(text: str) -> InverseCost:
    parts = [t.strip() for t in text.split(",")]
    try:
        vals = [float(t) for t in parts]
    except ValueError:
        vals = []
    if len(vals) != 3 or any(not math.isfinite(v) or v < 0 for v in vals):
        raise PlanError("--inverse", f"expected three non-negative seconds c0,c2,c3 (e.g. 3e-4,1e-9,1.4e-13), "
                        f"got {text!r}")
    return InverseCost(c0=vals[0], c2=vals[1], c3=vals[2])


def _measure(args: argparse.Namespace, sides: list[int], inverse: InverseCost | None
             ) -> tuple[int, int, AlphaBeta, AlphaBeta, InverseCost | None, dict[str, Any], bool]:
    """Measure on the process group: (rank, group size, all-reduce fit, broadcast fit, inverse model
    (rank 0 only, unless given), details, whether we initialised torch.distributed)."""
    import torch.distributed as dist

    from ..comm.profile import measure_allreduce, measure_broadcast, probe_sizes

    created = False
    if not dist.is_available():
        raise PlanError("--measure", "this torch build has no torch.distributed")
    if not dist.is_initialized():
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise PlanError("--measure", f"needs a process group: launch with torchrun (e.g. torchrun "
                            f"--nproc_per_node=4 -m lightning_spdkfac.cli plan ... --measure); {', '.join(missing)} "
                            "not set")
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo", init_method="env://")
        created = True
    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2:
        raise PlanError("--measure", "the process group has 1 rank: nothing to measure (launch 2 or more)")
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    sizes = probe_sizes(max(triu_size(n) for n in sides) * 4, cap=args.measure_max_mb * 2**20)
    ar = measure_allreduce(sizes, repeats=args.measure_repeats)
    bc = measure_broadcast(sizes, repeats=args.measure_repeats)
    fit_ar, fit_bc = fit_alpha_beta(sizes, ar), fit_alpha_beta(sizes, bc)
    ns = sorted(set(sides))
    probe = sorted({ns[0], ns[len(ns) // 2], ns[-1], max(8, ns[-1] // 2), max(16, 2 * ns[0])})
    if inverse is None and rank == 0:
        inverse = measure_inverse_cost(probe, device=device)
    details = {"group_world_size": world, "backend": backend, "device": str(device), "sizes_bytes": sizes,
               "allreduce_s": ar, "broadcast_s": bc, "allreduce_fit": _ab(fit_ar), "broadcast_fit": _ab(fit_bc),
               "inverse_ns": probe if args.inverse is None else []}
    return rank, world, fit_ar, fit_bc, inverse, details, created


def _inputs(args: argparse.Namespace) -> tuple[PlanInputs | None, Callable[[], None]]:
    """Everything the plan needs from the arguments; ``None`` on ranks > 0 of ``--measure``. The second
    value tears down what was set up (the process group ``--measure`` created)."""
    notes: list[str] = []
    chosen = [f for f, v in (("--model", args.model), ("--config", args.config), ("--paper", args.paper)) if v]
    if len(chosen) != 1:
        raise PlanError("--model/--config/--paper", "give exactly one of them" + (
            f" (got {', '.join(chosen)})" if chosen else " (e.g. --paper resnet50)"))
    for flag, v in (("--batch-size", args.batch_size), ("--world-size", args.world_size),
                    ("--gpus-per-node", args.gpus_per_node), ("--measure-repeats", args.measure_repeats)):
        if v is not None and v < 1:
            raise PlanError(flag, f"must be a positive integer, got {v}")
    if args.fit_world_size is not None and args.fit_world_size < 2:
        raise PlanError("--fit-world-size", f"must be >= 2 (an all-reduce needs 2 GPUs), got {args.fit_world_size}")
    for flag, v in (("--tflops", args.tflops), ("--factor-tflops", args.factor_tflops),
                    ("--measure-max-mb", args.measure_max_mb)):
        _positive(flag, v, allow_zero=False)
    for flag in ("--alpha", "--beta", "--link-alpha", "--link-beta", "--intra-alpha", "--intra-beta"):
        _positive(flag, getattr(args, flag[2:].replace("-", "_")))
    if args.init_args is not None and not args.model:
        raise PlanError("--init-args", "only goes with --model (a config gives model.init_args itself)")
    if args.input_shape is not None and args.paper:
        raise PlanError("--input-shape", "--paper models have their own input shape")

    # ---- schedules
    names = list(DEFAULT_SCHEDULES)
    if args.schedules is not None:
        names = [s.strip() for s in args.schedules.split(",") if s.strip()]
        bad = [s for s in names if s not in SCHEDULES]
        if bad or not names:
            raise PlanError("--schedules", f"unknown schedule(s) {', '.join(map(repr, bad)) or '(none given)'}; "
                            f"valid: {', '.join(SCHEDULES)}")
        names = list(dict.fromkeys(names))
    schedules = [SCHEDULES[n] for n in names]

    # ---- the model's layers
    from .models import PAPER_MODELS
    from .paper import PAPER_WORLD, model_specs, paper_case, paper_inverse

    shape: tuple[int, ...] | None = None
    config_args = None
    strategy_class = STRATEGY_CLASS
    other = 0
    batch = args.batch_size
    if args.paper:
        if args.paper not in PAPER_MODELS:
            raise PlanError("--paper", f"unknown model {args.paper!r}; valid: {', '.join(PAPER_MODELS)}")
        specs = list(model_specs(args.paper))
        shape = tuple(PAPER_MODELS[args.paper][1])
        name, source = args.paper, "the paper's model"
    else:
        if args.input_shape is None:
            raise PlanError("--input-shape", f"required with {chosen[0]}: the shape of one sample without the "
                            "batch dimension, e.g. --input-shape 3,224,224")
        shape = _ints("--input-shape", args.input_shape)
        dtype = _DTYPES[args.input_dtype]
        if args.model:
            init_args: dict[str, Any] = {}
            if args.init_args is not None:
                try:
                    init_args = json.loads(args.init_args)
                except json.JSONDecodeError as e:
                    raise PlanError("--init-args", f"not valid JSON ({e.msg}): {args.init_args!r}") from None
                if not isinstance(init_args, dict):
                    raise PlanError("--init-args", f"must be a JSON object, got {args.init_args!r}")
            factory = _resolve("--model", args.model)
            name, source = args.model, "--model"
            specs, other = _kfac_layers("--model", factory, init_args, shape, notes, dtype)
        else:
            class_path, init_args, options, config_args, data_batch, strategy_class = _config(args.config, notes)
            factory = _resolve("--config", class_path)
            name, source = class_path.rsplit(".", 1)[-1], f"config {' + '.join(args.config)}"
            specs, other = _kfac_layers("--config", factory, init_args, shape, notes, dtype)
            if batch is None and data_batch is not None:
                batch = data_batch
                notes.append(f"per-GPU batch {data_batch} from the config's data.init_args.batch_size")
            if options is not None:
                schedules.append(sim_schedule_from_options(options))

    # ---- the cluster
    link = args.link_alpha is not None or args.link_beta is not None
    fit = args.alpha is not None or args.beta is not None
    intra = args.intra_alpha is not None or args.intra_beta is not None
    for flags, given in ((("--alpha", "--beta"), (args.alpha, args.beta)),
                         (("--link-alpha", "--link-beta"), (args.link_alpha, args.link_beta)),
                         (("--intra-alpha", "--intra-beta"), (args.intra_alpha, args.intra_beta))):
        if (given[0] is None) != (given[1] is None):
            missing = flags[0] if given[0] is None else flags[1]
            raise PlanError(missing, f"give both {flags[0]} and {flags[1]}, or neither")
    if link and fit:
        raise PlanError("--alpha/--link-alpha", "give an all-reduce fit (--alpha/--beta) or per-link numbers "
                        "(--link-alpha/--link-beta), not both")
    if intra and not link:
        raise PlanError("--intra-alpha", "intra-node numbers go with per-link numbers (--link-alpha/--link-beta)")
    if args.fit_world_size is not None and not fit:
        raise PlanError("--fit-world-size", "only goes with --alpha/--beta")
    if args.measure and (link or fit):
        raise PlanError("--measure", "measures the network itself: drop --alpha/--beta/--link-*")
    inverse = _inverse(args.inverse) if args.inverse is not None else None
    g = args.gpus_per_node

    teardown: Callable[[], None] = lambda: None  # noqa: E731
    measured = None
    paper_net = False
    if args.measure:
        rank, group, fit_ar, fit_bc, inverse, measured, created = _measure(args, [n for s in specs for n in (
            s.a_side, s.g_side)], inverse)
        if created:
            import torch.distributed as dist

            def teardown() -> None:
                dist.barrier()
                dist.destroy_process_group()

        if rank != 0:
            return None, teardown
        p = args.world_size or group
        g = g or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if p == group:
            cluster = Cluster(p, fit_ar, fit_bc, fit_bc, inverse, gpus_per_node=g, name="measured")
            csource = f"measured on this process group ({measured['backend']})"
        else:
            cluster = Cluster.from_fit(fit_ar, group, p, inverse, gpus_per_node=g, name="measured, scaled")
            csource = (f"all-reduce measured on {group} ranks ({measured['backend']}), scaled to {p} "
                       "with ring collectives")
        if args.inverse is None:
            csource += f", inversions measured on {measured['device']}"
    else:
        p = args.world_size or PAPER_WORLD
        paper_net = bool(args.paper) and not (link or fit or intra)
        if paper_net:
            case = paper_case(args.paper)
            if p == PAPER_WORLD:
                paper_workload, cluster = case.workload, case.cluster
                csource = "the paper's calibrated cluster (16 nodes x 4 GPUs, fitted all-reduce)"
            else:
                paper_workload, cluster = case.at_world(p)
                csource = f"the paper's network (all-reduce fitted at {PAPER_WORLD}) scaled to {p} (ring)"
                notes.append(f"the paper's measured gradient all-reduce time is scaled by the all-reduce model "
                             f"from {PAPER_WORLD} to {p} GPUs")
            if g is not None and g != cluster.gpus_per_node:
                raise PlanError("--gpus-per-node", f"the paper's cluster has {cluster.gpus_per_node} GPUs per "
                                "node (give --link-alpha/--link-beta with --intra-* for another topology)")
            if inverse is not None:
                cluster = cluster.with_inverse(inverse)
        else:
            inv = inverse if inverse is not None else paper_inverse()
            try:
                if link:
                    cluster = Cluster.ring(p, args.link_alpha, args.link_beta, inv, gpus_per_node=g or 1,
                                           intra_alpha=args.intra_alpha, intra_beta=args.intra_beta)
                    csource = "ring collectives from per-link numbers" + (" (hierarchical)" if intra else "")
                elif fit:
                    p0 = args.fit_world_size or p
                    if p0 < 2:
                        raise PlanError("--fit-world-size", "an all-reduce fit needs a world size >= 2: give "
                                        "--fit-world-size (the P it was measured at)")
                    cluster = Cluster.from_fit(AlphaBeta(args.alpha, args.beta), p0, p, inv, gpus_per_node=g or 1)
                    csource = (f"all-reduce fit at {p0} GPUs" + (f" scaled to {p}" if p0 != p else "")
                               + " (per-link numbers of a ring; broadcasts as a pipelined chain)")
                else:
                    from .paper import paper_cluster

                    base = paper_cluster(p, inv)
                    cluster = Cluster(p, base.allreduce, base.broadcast, base.reduce, inv,
                                      gpus_per_node=g or base.gpus_per_node)
                    csource = (f"the paper's network (all-reduce fitted at {PAPER_WORLD}) scaled to {p} (ring; "
                               "broadcasts costed like the all-reduce, as in the paper's calibration)")
            except ValueError as e:
                raise PlanError("--gpus-per-node" if "gpus_per_node" in str(e) else "--world-size", str(e)) from None
        if inverse is None:
            csource += "; inversions: the paper's GPU (calibrated)"

    # ---- the workload
    if args.paper:
        _, _, paper_batch = PAPER_MODELS[args.paper]
        if args.tflops is None:
            source = "the paper's model, times calibrated to its measurements"
            if not args.measure and paper_net:
                workload = paper_workload
            else:
                workload = paper_case(args.paper, grad_comm="model").workload
                notes.append("the paper's measured gradient all-reduce time is for its own network: GradComm "
                             "is modelled from the parameter count and this cluster's all-reduce instead")
            if batch is not None and batch != paper_batch:
                workload = workload.with_batch(batch)
                notes.append(f"paper's calibrated times scaled linearly from batch {paper_batch} to {batch}")
        else:
            with torch.device("meta"):
                total = sum(t.numel() for t in PAPER_MODELS[args.paper][0]().parameters())
            workload = Workload.from_rates(name, specs, batch or paper_batch, flops_per_s=args.tflops * 1e12,
                                           factor_flops_per_s=(args.factor_tflops or args.tflops) * 1e12,
                                           other_params=max(0, total - sum(s.params for s in specs)))
            source = f"the paper's model at {args.tflops:g} TFLOP/s"
    else:
        tflops = args.tflops if args.tflops is not None else 20.0
        ftflops = args.factor_tflops if args.factor_tflops is not None else tflops
        workload = Workload.from_rates(name, specs, batch or 32, flops_per_s=tflops * 1e12,
                                       factor_flops_per_s=ftflops * 1e12, other_params=other)
        source = f"{source}, {tflops:g} TFLOP/s" + (f" ({ftflops:g} for factors)" if ftflops != tflops else "")
    inputs = PlanInputs(workload=workload, cluster=cluster, schedules=schedules, workload_source=source,
                     cluster_source=csource, notes=notes, config_strategy=config_args, measured=measured,
                     input_shape=shape, input_dtype=args.input_dtype, strategy_class=strategy_class)
    return inputs, teardown


def main(argv: list[str] | None = None) -> int:
    """``spdkfac plan [options]``: print the plan; 0 on success, 2 on a bad argument (message on stderr)."""
    parser = _parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as e:  # --help (0) or an argparse error (2, already printed)
        return int(e.code or 0)
    teardown: Callable[[], None] = lambda: None  # noqa: E731
    try:
        inputs, teardown = _inputs(args)
        if inputs is None:  # a rank > 0 of --measure: rank 0 prints
            return 0
        result = plan(inputs)
        text = render(result)
        if args.json:
            try:
                with open(args.json, "w", encoding="utf-8") as f:
                    json.dump(result, f, indent=2)
                    f.write("\n")
            except OSError as e:
                raise PlanError("--json", f"cannot write {args.json!r}: {e.strerror or e}") from None
        print(text)
        if args.json:
            print(f"\nwritten: {args.json}")
        return 0
    except PlanError as e:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    finally:
        teardown()
