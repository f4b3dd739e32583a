"""Soak (load) benchmark: a long SPD-KFAC run with re-planning, watched for memory and step-time growth.

Run ``python benchmarks/soak.py`` (``--help`` for options): numbers and a verdict against stated thresholds,
in ``soak.json`` in a fresh ``benchmarks/results/run-*-soak/`` (``--refresh``: the committed
``benchmarks/results/soak.json``; ``--out DIR``: ``DIR/soak.json``). ``--quick``: 20 steps of a 32-wide MLP
in windows of 10, re-planning every 5 (seconds).

Setup: ``--world-size`` (2) gloo ranks of ``--threads`` (1) torch threads. Model: an MLP 256-256-256-10 with
ReLU (factors of side 257/256/10) in ``DistributedDataParallel``; ``KFACPreconditioner`` with an
``SPDDistributor`` (schedule "spd") on a process group of its own, ``profile_steps=(3, 8)`` and
``--replan-every`` (50): every 50 factor steps the distributor re-measures the factor ready times for 5 steps
and makes a new fusion plan (39 re-plans in 2000 steps). SGD with momentum, lr 0.01, damping 0.03,
``--inv-update-steps`` (10); every step a fresh random batch of ``--batch`` (64) per rank (a stream per rank),
so the loss stays near log(10) and the gradients keep their size for the whole run.

Measured on every rank, per window of ``--window`` (100) steps: the resident set size at the window's end
(``VmRSS``), the median wall time of a step (zero_grad, forward, backward, ``pre.step()``, ``opt.step()``)
and of ``pre.step()`` alone, the re-plans started, the objects tracked by Python's gc (where a leak of Python
objects shows first) and the subnormal entries of the running factors and their inverses (``subn``).
Reported: a table per window; least-squares slopes of RSS (MiB per 1000 steps) and of the median step time
(ms and % per 1000 steps) over the windows after the first (which holds the start-up: cost-model
measurement, first profile), and of RSS over the second half; last-window / first-window ratios (of window 0
and of window 1). At the end, RSS after ``gc.collect()`` and after glibc's ``malloc_trim(0)``: growth that
``malloc_trim`` gives back was free heap the allocator kept, not memory in use.

Verdict "no growth" when, on every rank, the RSS slope over the second half is below ``--max-rss-slope``
(2 MiB per 1000 steps, a leak of 2 KiB per step) and the step-time slope below ``--max-time-slope`` (5 % of
the median step per 1000 steps). The second half for RSS because glibc's heap reaches its high-water mark
over the first ~1000 steps (a few MiB, the same with ``--replan-every 0``, returned by ``malloc_trim``) and
moves in steps of 0.5-2 MiB at any time, where a leak keeps a constant slope.

Subnormal entries (found by this benchmark, docs/faults.md): G rows and columns of ReLU units that stop firing
decay geometrically in the running average into the subnormal range, where x86 arithmetic is many times
slower; ``--steps 6000 --window 250`` showed the K-FAC step growing from 4 to 44 ms, and ``--flush-denormal``
(flush-to-zero in the ranks) kept it at 4.0 ms (benchmarks/results/soak_6000_steps*.json).
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import (
    Progress,
    bench_parser,
    check_positive,
    loadavg,
    mlp,
    output_paths,
    parse,
    print_table,
    random_batches,
    run_gloo,
    save_json,
)
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_spdkfac import KFACPreconditioner
from lightning_spdkfac.comm.scheduler import SPDDistributor, SPDOptions

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")  # the committed soak.json


def rss_mib() -> float:
    """Resident set size of this process in MiB (``VmRSS`` of /proc/self/status)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0  # kB
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def _malloc_trim_rss() -> float | None:
    """RSS after glibc's ``malloc_trim(0)`` (None where there is no glibc)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return None
    return rss_mib()


def subnormal_entries(pre: KFACPreconditioner) -> int:
    """Entries of the running factors and their inverses that are subnormal (0 < |x| < finfo.tiny)."""
    count = 0
    for layer in pre.layers.values():
        for t in (layer.A, layer.G, layer.A_inv, layer.G_inv):
            if t is not None and t.is_floating_point():
                a = t.abs()
                count += int(((a > 0) & (a < torch.finfo(t.dtype).tiny)).sum())
    return count


def worker(rank: int, world: int, cfg: dict) -> dict:
    """One rank of the soak run; returns its per-window records."""
    torch.manual_seed(cfg["seed"])  # identical initial weights on every rank
    if cfg["flush_denormal"]:
        torch.set_flush_denormal(True)  # subnormal results become 0 (x86 FTZ/DAZ), in this rank only
    model = mlp(cfg["width"], cfg["width"], cfg["width"], 10)
    gen = torch.Generator().manual_seed(cfg["seed"] + 1 + rank)  # a different data stream per rank
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    options = SPDOptions.from_schedule("spd", profile_steps=tuple(cfg["profile_steps"]),
                                       replan_every=cfg["replan_every"] or None)
    distributor = SPDDistributor(options, process_group=dist.new_group())
    pre = KFACPreconditioner(model, damping=cfg["damping"], factor_update_steps=1,  # every step, as documented
                             inv_update_steps=cfg["inv_update_steps"],
                             lr=lambda step: opt.param_groups[0]["lr"], distributor=distributor)
    windows: list[dict] = []
    step_s: list[float] = []
    kfac_s: list[float] = []
    replans = plan_changes = 0
    measuring = distributor.describe()["measuring"]
    groups = distributor.plan_groups
    rss_start = rss_mib()
    t_run = time.perf_counter()
    bar = Progress(cfg["steps"] // cfg["window"], "window") if rank == 0 else None
    for step in range(cfg["steps"]):
        # fresh random inputs and labels every step: nothing to memorize (see the module docstring)
        ((x, y),) = random_batches(gen, 1, cfg["batch"], cfg["width"])
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        t1 = time.perf_counter()
        pre.step()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        step_s.append(t3 - t0)
        kfac_s.append(t2 - t1)
        now_measuring = distributor.describe()["measuring"]
        replans += int(now_measuring and not measuring and step > 0)
        measuring = now_measuring
        plan_changes += int(distributor.plan_groups != groups)
        groups = distributor.plan_groups
        if (step + 1) % cfg["window"] == 0:
            windows.append({
                "end_step": step + 1,
                "rss_mib": rss_mib(),
                "step_ms": statistics.median(step_s) * 1e3,
                "step_p90_ms": statistics.quantiles(step_s, n=10)[-1] * 1e3,
                "kfac_ms": statistics.median(kfac_s) * 1e3,
                "replans": replans,
                "plan_changes": plan_changes,
                "gc_objects": len(gc.get_objects()),
                "subnormal": subnormal_entries(pre),
                "loss": float(loss.detach()),
            })
            step_s.clear()
            kfac_s.clear()
            replans = plan_changes = 0
            if bar is not None:
                bar.tick(f"rank 0 at {windows[-1]['rss_mib']:.0f} MiB, step {windows[-1]['step_ms']:.1f} ms")
    wall = time.perf_counter() - t_run
    rss_end = rss_mib()
    gc.collect()  # then what a full gc and glibc's malloc_trim give back (allocator retention, not a leak)
    return {
        "rank": rank,
        "rss_start_mib": rss_start,
        "rss_end_mib": rss_end,
        "rss_after_gc_mib": rss_mib(),
        "rss_after_malloc_trim_mib": _malloc_trim_rss(),
        "wall_s": wall,
        "windows": windows,
        "factor_steps": distributor.factor_steps,
        "final_plan": [list(g) for g in distributor.plan_groups],
        "skipped_factor_steps": pre.skipped_factor_steps,
    }


# ------------------------------------------------------------------------------ analysis
def slope_per_1000(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (steps), per 1000 steps."""
    return 1000.0 * statistics.linear_regression(xs, ys).slope if len(xs) > 1 else float("nan")


def analyse(results: list[dict], args) -> dict:
    summary = {}
    for r in results:
        w = r["windows"]
        fit = w[1:] if len(w) > 2 else w  # the first window holds start-up
        xs = [row["end_step"] for row in fit]
        rss_slope = slope_per_1000(xs, [row["rss_mib"] for row in fit])
        late = w[len(w) // 2:]
        rss_late_slope = slope_per_1000([row["end_step"] for row in late], [row["rss_mib"] for row in late])
        time_slope = slope_per_1000(xs, [row["step_ms"] for row in fit])
        median_ms = statistics.median(row["step_ms"] for row in fit)
        summary[r["rank"]] = {
            "rss_slope_mib_per_1000": rss_slope,
            "rss_late_slope_mib_per_1000": rss_late_slope,
            "step_ms_slope_per_1000": time_slope,
            "step_ms_slope_percent_per_1000": 100.0 * time_slope / median_ms,
            "kfac_ms_slope_per_1000": slope_per_1000(xs, [row["kfac_ms"] for row in fit]),
            "gc_objects_slope_per_1000": slope_per_1000(xs, [row["gc_objects"] for row in fit]),
            "median_step_ms": median_ms,
            "rss_last_over_first": w[-1]["rss_mib"] / w[0]["rss_mib"],
            "rss_last_over_second": w[-1]["rss_mib"] / w[1]["rss_mib"],  # parse_args: at least two windows
            "rss_last_minus_second_mib": w[-1]["rss_mib"] - w[1]["rss_mib"],
            "step_last_over_first": w[-1]["step_ms"] / w[0]["step_ms"],
            "step_last_over_second": w[-1]["step_ms"] / w[1]["step_ms"],
            "replans": sum(row["replans"] for row in w),
            "rss_start_mib": r["rss_start_mib"],
        }
    ok = all(s["rss_late_slope_mib_per_1000"] < args.max_rss_slope
             and s["step_ms_slope_percent_per_1000"] < args.max_time_slope for s in summary.values())
    return {"summary": summary, "no_growth": ok}


def print_report(results: list[dict], res: dict, args) -> None:
    rows = []
    for i, _ in enumerate(results[0]["windows"]):
        row = {"steps": f"{i * args.window}-{(i + 1) * args.window - 1}"}
        for r in results:
            w = r["windows"][i]
            k = r["rank"]
            row.update({f"rss{k}": w["rss_mib"], f"ms{k}": w["step_ms"], f"kfac{k}": w["kfac_ms"],
                        f"obj{k}": w["gc_objects"], f"sub{k}": w["subnormal"]})
        row["replans"] = results[0]["windows"][i]["replans"]
        row["loss"] = results[0]["windows"][i]["loss"]
        rows.append(row)
    cols = [("steps", "steps", "")]
    for r in results:
        k = r["rank"]
        cols += [(f"rss{k}", f"RSS{k} MiB", ".1f"), (f"ms{k}", f"step{k} ms", ".2f"), (f"kfac{k}", f"kfac{k} ms", ".2f"),
                 (f"obj{k}", f"gc obj{k}", "d"), (f"sub{k}", f"subn{k}", "d")]
    cols += [("replans", "replans", "d"), ("loss", "loss r0", ".3f")]
    print_table(rows, cols)
    print()
    srows = [{"rank": k, **s} for k, s in res["summary"].items()]
    print_table(srows, [
        ("rank", "rank", "d"), ("rss_slope_mib_per_1000", "RSS MiB/1000 steps", "+.3f"),
        ("rss_late_slope_mib_per_1000", "2nd half", "+.3f"), ("rss_last_minus_second_mib", "RSS last-w1 MiB", "+.2f"),
        ("rss_last_over_first", "RSS last/w0", ".4f"), ("rss_last_over_second", "RSS last/w1", ".4f"),
        ("step_ms_slope_per_1000", "step ms/1000 steps", "+.3f"),
        ("step_ms_slope_percent_per_1000", "step %/1000 steps", "+.2f"), ("step_last_over_first", "step last/w0", ".3f"),
        ("step_last_over_second", "step last/w1", ".3f"), ("gc_objects_slope_per_1000", "gc obj/1000 steps", "+.1f"),
        ("replans", "replans", "d")])
    n = len(results[0]["windows"])
    print(f"\nslopes over windows 1..{n - 1} (window 0 is start-up), '2nd half' over windows {n // 2}..{n - 1}; "
          f"verdict thresholds: RSS 2nd-half slope < {args.max_rss_slope:g} MiB and step-time slope < "
          f"{args.max_time_slope:g} % per 1000 steps")
    print("verdict:", "no growth of memory or step time" if res["no_growth"] else "GROWTH (see the slopes)")
    subnormal = max(r["windows"][-1]["subnormal"] for r in results)
    if subnormal:
        print(f"note: {subnormal} subnormal entries in the factors/inverses at the end; arithmetic on them is slow "
              f"on x86 and the K-FAC step grows while they last (see the module docstring; --flush-denormal)")
    for r in results:
        trim = r["rss_after_malloc_trim_mib"]
        print(f"rank {r['rank']}: RSS at start {r['rss_start_mib']:.1f} MiB, at the end {r['rss_end_mib']:.1f}, after "
              f"gc.collect() {r['rss_after_gc_mib']:.1f}, after malloc_trim(0) "
              f"{'-' if trim is None else f'{trim:.1f}'} MiB; {r['factor_steps']} factor steps")


def parse_args(argv=None):
    p = bench_parser(__doc__.split("\n\n")[0], threads=1, seed=0, out="folder for soak.json (instead of --json)",
                     refresh="write the committed benchmarks/results/soak.json (unless --json or --out says otherwise)")
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps")
    p.add_argument("--window", type=int, default=100, help="steps per measurement window")
    p.add_argument("--replan-every", type=int, default=50, help="re-measure and re-plan every this many steps (0: never)")
    p.add_argument("--profile-steps", type=int, nargs=2, default=(3, 8), metavar=("START", "END"))
    p.add_argument("--inv-update-steps", type=int, default=10)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--damping", type=float, default=0.03)
    p.add_argument("--max-rss-slope", type=float, default=2.0,
                   help="MiB per 1000 steps, over the second half of the run")
    p.add_argument("--flush-denormal", action="store_true",
                   help="torch.set_flush_denormal(True) in the ranks (subnormal floats become 0)")
    p.add_argument("--max-time-slope", type=float, default=5.0, help="percent of the median step per 1000 steps")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole run")
    p.add_argument("--json", default=None,
                   help="'' to skip (default: soak.json in a fresh benchmarks/results/run-*/)")
    args = parse(p, argv, quick={"steps": 20, "window": 10, "replan_every": 5, "profile_steps": (1, 3), "width": 32,
                                 "batch": 8, "inv_update_steps": 2})
    if args.steps < 2 * args.window or args.window < 10:
        p.error("--steps must be at least two windows and --window at least 10")
    check_positive(p, args, "world_size", "threads")
    output_paths(args, "soak", RESULTS, json="soak.json")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import soak  # the ranks need a function of an importable module, not of __main__

    cfg = {k: getattr(args, k) for k in ("steps", "window", "replan_every", "profile_steps", "inv_update_steps",
                                         "width", "batch", "lr", "damping", "seed", "flush_denormal")}
    results, env = run_gloo(soak.worker, args, cfg, pg_timeout=600.0,
                            note=f"{args.steps} steps, replan_every {args.replan_every}  ")
    if results is None:
        return 1
    res = analyse(results, args)
    print_report(results, res, args)
    print(f"wall time {env['wall_s']:.0f} s; load average after {loadavg(env['loadavg_after'])}")
    if args.json:
        payload = {"env": env, "args": vars(args), "ranks": results, **res}
        save_json(*os.path.split(os.path.abspath(args.json)), payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
