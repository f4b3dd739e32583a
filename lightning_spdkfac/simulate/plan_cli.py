"""``spdkfac plan``: which K-FAC schedule to run on a cluster, from the simulator (the command line).

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

This module turns the arguments into :class:`~.plan.PlanInputs` (the model's layers from
:mod:`.plan_sources`, the cluster, the workload) and prints :func:`~.report.render` of
:func:`~.plan.plan`. Programmatic use: :mod:`.plan`.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..factor_shapes import FactorShape, is_diagonal, packed_numel, side
from ..schedule import AlphaBeta, InverseCost
from .cluster import Cluster
from .plan import DEFAULT_SCHEDULES, PlanInputs, ab_dict, plan, sim_schedule_from_options
from .plan_sources import DTYPES, ModelSource, PlanError, model_source
from .report import render, write_json
from .sim_schedule import SIM_SCHEDULES, SimSchedule
from .workload import Workload

__all__ = ["PlanError", "main"]

_Teardown = Callable[[], None]


def _nothing() -> None:
    pass


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
    m.add_argument("--input-dtype", default="float32", choices=sorted(DTYPES),
                   help="dtype of the sample (default float32; int64 for token ids)")
    m.add_argument("--max-factor-side", type=int, metavar="N", help="the largest factor side kept dense, as the "
                   "runtime's max_factor_side: a larger side (an LM head's vocabulary) is planned as a diagonal "
                   "factor (default: a config's kfac.max_factor_side, else 4608; not with --paper, whose models "
                   "are dense)")
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
                   f"); valid: {', '.join(SIM_SCHEDULES)}")
    o.add_argument("--json", metavar="PATH", help="also write everything machine-readable to PATH")
    o.add_argument("--gpu-memory", metavar="SIZE", help="memory per GPU, e.g. 16GB, 15.5GiB, 12000MB (a bare "
                   "number is GB): recommend the fastest schedule whose modelled memory per GPU fits")
    return p


# -------------------------------------------------------------------------------- argument checks
def _positive(flag: str, value: float | None, allow_zero: bool = True) -> float | None:
    if value is None:
        return None
    if not math.isfinite(value) or value < 0 or (not allow_zero and value == 0):
        raise PlanError(flag, f"must be a {'non-negative' if allow_zero else 'positive'} number, got {value!r}")
    return value


def _check_args(args: argparse.Namespace) -> None:
    """What can be checked flag by flag, before anything is built."""
    chosen = [f for f, v in (("--model", args.model), ("--config", args.config), ("--paper", args.paper)) if v]
    if len(chosen) != 1:
        raise PlanError("--model/--config/--paper", "give exactly one of them" + (
            f" (got {', '.join(chosen)})" if chosen else " (e.g. --paper resnet50)"))
    for flag, v in (("--batch-size", args.batch_size), ("--world-size", args.world_size),
                    ("--gpus-per-node", args.gpus_per_node), ("--measure-repeats", args.measure_repeats),
                    ("--max-factor-side", args.max_factor_side)):
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
    if args.max_factor_side is not None and args.paper:
        raise PlanError("--max-factor-side", "--paper models are planned with dense factors, as the paper ran them")


def _schedules(text: str | None) -> list[SimSchedule]:
    """The schedules of ``--schedules`` (names of :data:`~.timeline.SIM_SCHEDULES`), or the default ones."""
    names = list(DEFAULT_SCHEDULES)
    if text is not None:
        names = [s.strip() for s in text.split(",") if s.strip()]
        bad = [s for s in names if s not in SIM_SCHEDULES]
        if bad or not names:
            raise PlanError("--schedules", f"unknown schedule(s) {', '.join(map(repr, bad)) or '(none given)'}; "
                            f"valid: {', '.join(SIM_SCHEDULES)}")
        names = list(dict.fromkeys(names))
    return [SIM_SCHEDULES[n] for n in names]


_UNITS = {"": 1e9, "b": 1.0, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2.0**10, "mib": 2.0**20, "gib": 2.0**30, "tib": 2.0**40}


def gpu_memory_bytes(text: str | None) -> float | None:
    """``--gpu-memory``: a size with an optional unit (GB, GiB, MB, MiB, TB, ...; none: GB) -> bytes."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if m is None or m.group(2) not in _UNITS or float(m.group(1)) <= 0:
        raise PlanError("--gpu-memory", f"expected a positive size with a unit, e.g. 16GB, 15.5GiB or 12000MB "
                        f"(units: GB, GiB, MB, MiB, TB, TiB; none means GB), got {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


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


@dataclass(frozen=True)
class _NetworkFlags:
    """Which description of the network was given: an all-reduce fit, per-link numbers, intra-node numbers."""

    fit: bool
    link: bool
    intra: bool


def _network_flags(args: argparse.Namespace) -> _NetworkFlags:
    flags = _NetworkFlags(fit=args.alpha is not None or args.beta is not None,
                          link=args.link_alpha is not None or args.link_beta is not None,
                          intra=args.intra_alpha is not None or args.intra_beta is not None)
    for names, given in ((("--alpha", "--beta"), (args.alpha, args.beta)),
                         (("--link-alpha", "--link-beta"), (args.link_alpha, args.link_beta)),
                         (("--intra-alpha", "--intra-beta"), (args.intra_alpha, args.intra_beta))):
        if (given[0] is None) != (given[1] is None):
            missing = names[0] if given[0] is None else names[1]
            raise PlanError(missing, f"give both {names[0]} and {names[1]}, or neither")
    if flags.link and flags.fit:
        raise PlanError("--alpha/--link-alpha", "give an all-reduce fit (--alpha/--beta) or per-link numbers "
                        "(--link-alpha/--link-beta), not both")
    if flags.intra and not flags.link:
        raise PlanError("--intra-alpha", "intra-node numbers go with per-link numbers (--link-alpha/--link-beta)")
    if args.fit_world_size is not None and not flags.fit:
        raise PlanError("--fit-world-size", "only goes with --alpha/--beta")
    if args.measure and (flags.link or flags.fit):
        raise PlanError("--measure", "measures the network itself: drop --alpha/--beta/--link-*")
    return flags


# -------------------------------------------------------------------------------- the cluster
@dataclass
class _Network:
    """The cluster of the plan and how it was obtained."""

    cluster: Cluster
    source: str
    measured: dict[str, Any] | None = None
    paper_workload: Workload | None = None  # --paper on the paper's network: the calibrated workload there


def _process_group() -> tuple[bool, _Teardown]:
    """Join the torch.distributed group that torchrun describes (unless already in one): whether this
    created it, and what tears it down."""
    import torch.distributed as dist

    if not dist.is_available():
        raise PlanError("--measure", "this torch build has no torch.distributed")
    if dist.is_initialized():
        return False, _nothing
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise PlanError("--measure", f"needs a process group: launch with torchrun (e.g. torchrun "
                        f"--nproc_per_node=4 -m lightning_spdkfac.cli plan ... --measure); {', '.join(missing)} "
                        "not set")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", init_method="env://")

    def teardown() -> None:
        dist.barrier()
        dist.destroy_process_group()

    return True, teardown


def _measure(args: argparse.Namespace, sides: list[FactorShape], inverse: InverseCost | None
             ) -> tuple[int, int, AlphaBeta, AlphaBeta, InverseCost | None, dict[str, Any]]:
    """Measure on the process group: (rank, group size, all-reduce fit, broadcast fit, inverse model
    (rank 0 only, unless given), details). ``sides``: the factors' shapes; messages are probed up to the
    largest packed factor, inversions at the sides of the dense matrices (dense factors, grouped blocks)."""
    import torch.distributed as dist

    from ..comm.profile import measure_allreduce, measure_broadcast, probe_sizes
    from ..schedule import fit_alpha_beta, measure_inverse_cost

    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2:
        raise PlanError("--measure", "the process group has 1 rank: nothing to measure (launch 2 or more)")
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    sizes = probe_sizes(max(packed_numel(n) for n in sides) * 4, cap=args.measure_max_mb * 2**20)
    ar = measure_allreduce(sizes, repeats=args.measure_repeats)
    bc = measure_broadcast(sizes, repeats=args.measure_repeats)
    fit_ar, fit_bc = fit_alpha_beta(sizes, ar), fit_alpha_beta(sizes, bc)
    ns = sorted({side(n) for n in sides if not is_diagonal(n)} or {side(n) for n in sides})
    probe = sorted({ns[0], ns[len(ns) // 2], ns[-1], max(8, ns[-1] // 2), max(16, 2 * ns[0])})
    if inverse is None and rank == 0:
        inverse = measure_inverse_cost(probe, device=device)
    details = {"group_world_size": world, "backend": backend, "device": str(device), "sizes_bytes": sizes,
               "allreduce_s": ar, "broadcast_s": bc, "allreduce_fit": ab_dict(fit_ar), "broadcast_fit": ab_dict(fit_bc),
               "inverse_ns": probe if args.inverse is None else []}
    return rank, world, fit_ar, fit_bc, inverse, details


def _measured_network(args: argparse.Namespace, model: ModelSource, inverse: InverseCost | None
                      ) -> tuple[_Network | None, _Teardown]:
    """``--measure``: the network measured on the process group; None on ranks > 0 (rank 0 prints)."""
    _, teardown = _process_group()
    rank, group, fit_ar, fit_bc, inverse, measured = _measure(
        args, [n for s in model.specs for n in (s.a_shape, s.g_shape)], inverse)
    if rank != 0:
        return None, teardown
    assert inverse is not None  # measured on rank 0 when not given
    p = args.world_size or group
    g = args.gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if p == group:
        cluster = Cluster(p, fit_ar, fit_bc, fit_bc, inverse, gpus_per_node=g, name="measured")
        source = f"measured on this process group ({measured['backend']})"
    else:
        cluster = Cluster.from_fit(fit_ar, group, p, inverse, gpus_per_node=g, name="measured, scaled")
        source = (f"all-reduce measured on {group} ranks ({measured['backend']}), scaled to {p} "
                  "with ring collectives")
    if args.inverse is None:
        source += f", inversions measured on {measured['device']}"
    return _Network(cluster, source, measured=measured), teardown


def _paper_network(args: argparse.Namespace, p: int, inverse: InverseCost | None, notes: list[str]) -> _Network:
    """``--paper`` without network flags: the paper's calibrated cluster (and workload) at ``p`` GPUs."""
    from .paper import PAPER_WORLD, paper_case

    case = paper_case(args.paper)
    if p == PAPER_WORLD:
        workload, cluster = case.workload, case.cluster
        source = "the paper's calibrated cluster (16 nodes x 4 GPUs, fitted all-reduce)"
    else:
        workload, cluster = case.at_world(p)
        source = f"the paper's network (all-reduce fitted at {PAPER_WORLD}) scaled to {p} (ring)"
        notes.append(f"the paper's measured gradient all-reduce time is scaled by the all-reduce model "
                     f"from {PAPER_WORLD} to {p} GPUs")
    if args.gpus_per_node is not None and args.gpus_per_node != cluster.gpus_per_node:
        raise PlanError("--gpus-per-node", f"the paper's cluster has {cluster.gpus_per_node} GPUs per "
                        "node (give --link-alpha/--link-beta with --intra-* for another topology)")
    if inverse is not None:
        cluster = cluster.with_inverse(inverse)
    return _Network(cluster, source, paper_workload=workload)


def _given_network(args: argparse.Namespace, flags: _NetworkFlags, p: int, inverse: InverseCost | None
                   ) -> _Network:
    """The cluster of the network flags (per-link numbers, an all-reduce fit), or the paper's network at ``p``."""
    from .paper import PAPER_WORLD, paper_cluster, paper_inverse

    inv = inverse if inverse is not None else paper_inverse()
    g = args.gpus_per_node
    try:
        if flags.link:
            cluster = Cluster.ring(p, args.link_alpha, args.link_beta, inv, gpus_per_node=g or 1,
                                   intra_alpha=args.intra_alpha, intra_beta=args.intra_beta)
            return _Network(cluster, "ring collectives from per-link numbers"
                            + (" (hierarchical)" if flags.intra else ""))
        if flags.fit:
            p0 = args.fit_world_size or p
            if p0 < 2:
                raise PlanError("--fit-world-size", "an all-reduce fit needs a world size >= 2: give "
                                "--fit-world-size (the P it was measured at)")
            cluster = Cluster.from_fit(AlphaBeta(args.alpha, args.beta), p0, p, inv, gpus_per_node=g or 1)
            return _Network(cluster, f"all-reduce fit at {p0} GPUs" + (f" scaled to {p}" if p0 != p else "")
                            + " (per-link numbers of a ring; broadcasts as a pipelined chain)")
        base = paper_cluster(p, inv)
        cluster = Cluster(p, base.allreduce, base.broadcast, base.reduce, inv, gpus_per_node=g or base.gpus_per_node)
        return _Network(cluster, f"the paper's network (all-reduce fitted at {PAPER_WORLD}) scaled to {p} (ring; "
                        "broadcasts costed like the all-reduce, as in the paper's calibration)")
    except ValueError as e:
        raise PlanError("--gpus-per-node" if "gpus_per_node" in str(e) else "--world-size", str(e)) from None


def _network(args: argparse.Namespace, model: ModelSource, notes: list[str]) -> tuple[_Network | None, _Teardown]:
    """The cluster: measured (None on ranks > 0), the paper's, or from the network flags."""
    from .paper import PAPER_WORLD

    flags = _network_flags(args)
    inverse = _inverse(args.inverse) if args.inverse is not None else None
    if args.measure:
        return _measured_network(args, model, inverse)
    p = args.world_size or PAPER_WORLD
    if args.paper and not (flags.link or flags.fit or flags.intra):
        net = _paper_network(args, p, inverse, notes)
    else:
        net = _given_network(args, flags, p, inverse)
    if inverse is None:
        net.source += "; inversions: the paper's GPU (calibrated)"
    return net, _nothing


# -------------------------------------------------------------------------------- the workload
def _paper_workload(args: argparse.Namespace, model: ModelSource, net: _Network,
                    notes: list[str]) -> tuple[Workload, str]:
    """A paper model's workload: the calibrated times (on the paper's network: with its measured gradient
    all-reduce), or from ``--tflops``."""
    from .models import PAPER_MODELS
    from .paper import paper_case

    _, _, paper_batch = PAPER_MODELS[args.paper]
    if args.tflops is not None:
        with torch.device("meta"):
            total = sum(t.numel() for t in PAPER_MODELS[args.paper][0]().parameters())
        workload = Workload.from_rates(model.name, model.specs, model.batch or paper_batch,
                                       flops_per_s=args.tflops * 1e12,
                                       factor_flops_per_s=(args.factor_tflops or args.tflops) * 1e12,
                                       other_params=max(0, total - sum(s.params for s in model.specs)))
        return workload, f"the paper's model at {args.tflops:g} TFLOP/s"
    if net.paper_workload is not None:
        workload = net.paper_workload
    else:
        workload = paper_case(args.paper, grad_comm="model").workload
        notes.append("the paper's measured gradient all-reduce time is for its own network: GradComm "
                     "is modelled from the parameter count and this cluster's all-reduce instead")
    if model.batch is not None and model.batch != paper_batch:
        workload = workload.with_batch(model.batch)
        notes.append(f"paper's calibrated times scaled linearly from batch {paper_batch} to {model.batch}")
    return workload, "the paper's model, times calibrated to its measurements"


def _workload(args: argparse.Namespace, model: ModelSource, net: _Network, notes: list[str]) -> tuple[Workload, str]:
    """The per-GPU times of the model and where they come from."""
    if args.paper:
        return _paper_workload(args, model, net, notes)
    tflops = args.tflops if args.tflops is not None else 20.0
    ftflops = args.factor_tflops if args.factor_tflops is not None else tflops
    workload = Workload.from_rates(model.name, model.specs, model.batch or 32, flops_per_s=tflops * 1e12,
                                   factor_flops_per_s=ftflops * 1e12, other_params=model.other_params)
    return workload, f"{model.source}, {tflops:g} TFLOP/s" + (f" ({ftflops:g} for factors)" if ftflops != tflops else "")


def _inputs(args: argparse.Namespace) -> tuple[PlanInputs | None, _Teardown]:
    """Everything the plan needs from the arguments; ``None`` on ranks > 0 of ``--measure``. The second
    value tears down what was set up (the process group ``--measure`` created)."""
    _check_args(args)
    gpu_memory = gpu_memory_bytes(args.gpu_memory)
    schedules = _schedules(args.schedules)
    notes: list[str] = []
    model = model_source(args, notes)
    if model.options is not None:
        schedules.append(sim_schedule_from_options(model.options))
    net, teardown = _network(args, model, notes)
    if net is None:
        return None, teardown
    workload, source = _workload(args, model, net, notes)
    inputs = PlanInputs(workload=workload, cluster=net.cluster, schedules=schedules, workload_source=source,
                        cluster_source=net.source, notes=notes, config_strategy=model.strategy_args,
                        measured=net.measured, input_shape=model.shape, input_dtype=args.input_dtype,
                        strategy_class=model.strategy_class, gpu_memory=gpu_memory,
                        max_factor_side=model.max_factor_side)
    return inputs, teardown


def _import_hint(e: PlanError) -> str:
    """For a --model whose module was not found: where it was looked for and how to make it importable."""
    if e.flag != "--model" or "ModuleNotFoundError" not in e.message:
        return ""
    return (f"\n  (looked in the working directory {os.getcwd()} and the installed packages; give the dotted "
            f"module path as you would import it (pkg.module:Class), run from the folder that holds it, or add "
            f"that folder to PYTHONPATH)")


def main(argv: list[str] | None = None) -> int:
    """``spdkfac plan [options]``: print the plan; 0 on success, 2 on a bad argument (message on stderr)."""
    parser = _parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as e:  # --help (0) or an argparse error (2, already printed)
        return int(e.code or 0)
    teardown: _Teardown = _nothing
    try:
        inputs, teardown = _inputs(args)
        if inputs is None:  # a rank > 0 of --measure: rank 0 prints
            return 0
        result = plan(inputs)
        text = render(result)
        if args.json:
            try:
                write_json(result, args.json)
            except OSError as e:
                raise PlanError("--json", f"cannot write {args.json!r}: {e.strerror or e}") from None
        print(text)
        if args.json:
            print(f"\nwritten: {args.json}")
        return 0
    except PlanError as e:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {e}{_import_hint(e)}", file=sys.stderr)
        return 2
    finally:
        teardown()
