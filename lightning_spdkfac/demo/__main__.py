"""``python -m lightning_spdkfac.demo`` (``make demo``): K-FAC vs. SGD on 8x8 digits, over 8 seeds, and a verdict.

Trains ``configs/digits.yaml`` (SGD + the KFAC callback) and ``configs/digits_sgd.yaml`` (the same
run without it) through the ``spdkfac fit`` CLI, in this process, seed by seed (both optimizers back to
back: a slow spell of a shared machine hits both alike), then prints the median and range over the seeds
of the final accuracy, the epochs and the time to 97% validation accuracy, and a verdict that holds: K-FAC
wins (or loses) only when it is faster (slower) to 97% on every seed, in the process's CPU seconds, paired
by seed; otherwise it is a tie, and the line says on how many seeds each was faster. About 40 s on 2 cores.
Results go to ``demo_runs/`` (``<out>/seed<S>/kfac``, ``<out>/seed<S>/sgd``, ``<out>/summary.json``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import yaml

from ..cli import main as cli_main

REPO = Path(__file__).resolve().parents[2]
RUNS = (("K-FAC", "kfac", "digits.yaml"), ("SGD", "sgd", "digits_sgd.yaml"))
# The demo's seeds (weights and data split): enough that the verdict's spread is the seeds', not one run's.
DEFAULT_SEEDS = (0, 1, 2, 3, 4, 5, 6, 7)


def run_config(config: Path, run_dir: Path, extra: list[str]) -> dict:
    """``spdkfac fit --config CONFIG`` into ``run_dir``; returns TimeToAccuracy's results."""
    args = ["fit", "--config", str(config), f"--trainer.default_root_dir={run_dir}", *extra]
    path = run_dir / "time_to_accuracy.json"
    path.unlink(missing_ok=True)  # never report a previous run's numbers
    argv, sys.argv = sys.argv, sys.argv[:1]  # the demo's own options are not the CLI's
    t0 = time.perf_counter()
    try:
        cli_main(args)
    finally:
        sys.argv = argv
    wall = time.perf_counter() - t0
    if not path.is_file():
        raise FileNotFoundError(f"{config} wrote no {path.name} into {run_dir} (is TimeToAccuracy configured?)")
    result = json.loads(path.read_text())
    result["process_seconds"] = round(wall, 3)  # setup, data loading and fit
    return result


def describe(saved_config: Path) -> str:
    """One line on the setting, from the config the K-FAC run saved."""
    cfg = yaml.safe_load(saved_config.read_text())
    m = cfg["model"]["init_args"]
    return (
        f"K-FAC vs SGD on scikit-learn's 8x8 digits: seed {cfg['seed_everything']}, {cfg['trainer']['max_epochs']} "
        f"epochs, SGD(lr={m['lr']}, momentum={m['momentum']}, {m['lr_schedule']} schedule) in both"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lightning_spdkfac.demo", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("demo_runs"), help="run directory (default: demo_runs)")
    p.add_argument("--configs", type=Path, default=REPO / "configs", help="folder of digits*.yaml")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: for this tiny model more threads only add overhead, "
                        "and single-threaded timings stay comparable on a busy machine)")
    p.add_argument("--epochs", type=int, default=None, help="override trainer.max_epochs (for a quick look)")
    p.add_argument("--seeds", type=_seed_list, default=list(DEFAULT_SEEDS), metavar="S[,S...]",
                   help="run both configs once per seed (seed_everything and the data split's seed), interleaved, "
                        "and print the median and range over seeds (default: "
                        f"{','.join(map(str, DEFAULT_SEEDS))}; one seed gives one run's table, no spread)")
    p.add_argument("-v", "--verbose", action="store_true", help="keep Lightning's own messages")
    return p.parse_args(argv)


def _seed_list(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds must be comma-separated integers such as 0,1,2, got {text!r}") from None
    if len(set(seeds)) != len(seeds) or any(s < 0 for s in seeds):
        raise argparse.ArgumentTypeError(f"--seeds must be distinct non-negative integers, got {text!r}")
    return seeds


def _spread(values: list[float], fmt: str) -> str:
    """median [min-max] of the values, or the one value."""
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def _cpu(run: dict, cpu: str, wall: str) -> float:
    """The run's CPU seconds ``cpu``, or its wall seconds ``wall`` in a record without them."""
    value = run.get(cpu)
    return float(run[wall] if value is None else value)


def format_seed_table(per_seed: dict[int, dict[str, dict]]) -> str:
    """One row per optimizer: median [min-max] over seeds; epochs and time to target over the seeds
    that reached it (how many did is shown). Times are the process's CPU seconds (wall seconds for a record
    without them): on a shared machine wall-clock time measures the neighbours too."""
    first = next(iter(per_seed.values()))
    pct = f"{next(iter(first.values()))['target']:.0%}"
    header = ("", "final val acc", f"reached {pct}", f"epochs to {pct}", f"CPU time to {pct}", "total CPU time")
    rows = [header]
    for name in first:
        runs = [seed_results[name] for seed_results in per_seed.values()]
        reached = [r for r in runs if r["epoch"] is not None]
        rows.append((
            name,
            _spread([100 * r["final_val_acc"] for r in runs], "{:.1f}%"),
            f"{len(reached)} of {len(runs)}",
            _spread([r["epoch"] for r in reached], "{:g}") if reached else "-",
            _spread([_cpu(r, "cpu_seconds", "seconds") for r in reached], "{:.1f} s") if reached else "-",
            _spread([_cpu(r, "total_cpu_seconds", "total_seconds") for r in runs], "{:.1f} s"),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    per = "; ".join(
        f"seed {seed}: " + ", ".join(f"{name} {r['epoch'] if r['epoch'] is not None else '-'}" for name, r in res.items())
        for seed, res in per_seed.items()
    )
    return "\n".join(lines) + f"\nepochs to {pct} per seed: {per}"


def _time(run: dict, clock: str) -> float:
    """The run's time to the target on ``clock`` (``cpu_seconds``, falling back to wall ``seconds`` for a
    record without it); infinite when it missed the target."""
    if run["epoch"] is None:
        return math.inf
    value = run.get(clock)
    return float(run["seconds"] if value is None else value)


def _ratio(value: float) -> str:
    return "K-FAC never" if math.isinf(value) else "SGD never" if value == 0 else f"{value:.2f}x"


def verdict(runs: dict[str, list[dict]], clock: str = "cpu_seconds") -> str:
    """One line: K-FAC against SGD in time to the target, per seed, and a verdict that holds.

    ``runs``: optimizer name -> its runs, one per seed, in the same seed order for both. Each seed gives
    one ratio, K-FAC's time to the target over SGD's on ``clock`` (a run that missed the target counts as
    never reaching it; a seed where neither reached it gives none). K-FAC **wins** when it is faster on every
    seed, **loses** when it is slower on every seed; anything else is a **tie**: the spread over the seeds
    covers 1. The median and the range of the ratios are printed either way.
    """
    kfac, sgd = runs["K-FAC"], runs["SGD"]
    pct = f"{kfac[0]['target']:.0%}"
    ratios = []
    for k, g in zip(kfac, sgd):
        tk, tg = _time(k, clock), _time(g, clock)
        if not (math.isinf(tk) and math.isinf(tg)):
            ratios.append(tk / tg if tg > 0 else math.inf)  # x/inf = 0: SGD never; inf/x = inf: K-FAC never
    if not ratios:
        return f"verdict: neither reached {pct} on any of the {len(kfac)} seeds: no verdict."
    n, faster, slower = len(ratios), sum(r < 1 for r in ratios), sum(r > 1 for r in ratios)
    median = statistics.median(sorted(ratios))
    finite = [r for r in ratios if 0 < r < math.inf]
    missed = [f"{who} missed {pct} on {k} seed{'s' if k > 1 else ''}"
              for who, k in (("SGD", sum(r == 0 for r in ratios)), ("K-FAC", sum(math.isinf(r) for r in ratios))) if k]
    inside = ([f"{_ratio(min(finite))} to {_ratio(max(finite))}"] if finite else []) + missed
    spread = _ratio(median) if n == 1 else f"{_ratio(median)} median over {n} seeds [{'; '.join(inside)}]"
    if faster == n:
        word, why = "K-FAC wins", f"faster to {pct} on every seed ({n} of {n})"
    elif slower == n:
        word, why = "K-FAC loses", f"slower to {pct} on every seed ({n} of {n})"
    else:
        word, why = "tie", (f"K-FAC faster to {pct} on {faster} of {n} seeds and slower on {slower}: the spread over "
                            "the seeds covers 1")
    what = "CPU seconds of this process" if clock == "cpu_seconds" else "wall-clock seconds"
    one = "; one seed has no spread: the default seeds give a verdict that holds" if n == 1 else ""
    return (f"verdict: {word}: K-FAC/SGD time to {pct} = {spread} ({what}, paired by seed, a run that missed "
            f"counting as never); {why}{one}.")


def epoch_cost_line(runs: dict[str, list[dict]]) -> str | None:
    """Why the verdict is what it is: epochs to the target (median over the seeds that reached it) and what an
    epoch costs, K-FAC's over SGD's (median over the seeds of the CPU seconds per epoch of the whole fit)."""
    kfac, sgd = runs["K-FAC"], runs["SGD"]
    pct = f"{kfac[0]['target']:.0%}"
    costs = [(k["total_cpu_seconds"] / k["epochs"]) / (g["total_cpu_seconds"] / g["epochs"])
             for k, g in zip(kfac, sgd) if k.get("total_cpu_seconds") and g.get("total_cpu_seconds")
             and k.get("epochs") and g.get("epochs")]
    ek = [r["epoch"] for r in kfac if r["epoch"] is not None]
    eg = [r["epoch"] for r in sgd if r["epoch"] is not None]
    if not costs or not ek or not eg:
        return None
    return (f"why: epochs to {pct}, median over the seeds that reached it: K-FAC {statistics.median(ek):g} "
            f"({len(ek)} of {len(kfac)} seeds), SGD {statistics.median(eg):g} ({len(eg)} of {len(sgd)}); "
            f"a K-FAC epoch costs {statistics.median(costs):.2f}x an SGD epoch (CPU seconds, median over seeds).")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if not args.verbose:
        logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)
        logging.getLogger("lightning_fabric").setLevel(logging.WARNING)
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    extra = [] if args.epochs is None else [f"--trainer.max_epochs={args.epochs}"]
    t0 = time.perf_counter()
    # Seed by seed, both optimizers back to back: a slow spell of a shared machine hits both alike.
    results: dict[int, dict[str, Any]] = {}  # seed -> optimizer -> its results
    for seed in args.seeds:
        seeded = [*extra, f"--seed_everything={seed}", f"--data.init_args.seed={seed}"]
        results[seed] = {}
        for name, sub, config in RUNS:
            print(f"seed {seed}: training {name:5s} ({config}) ...", flush=True)
            results[seed][name] = run_config(args.configs / config, args.out / f"seed{seed}" / sub, seeded)
    total = time.perf_counter() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(results, indent=2))
    print()
    first = args.out / f"seed{args.seeds[0]}" / "kfac" / "config.yaml"
    print(describe(first).replace(f"seed {args.seeds[0]}", f"seed{'s' if len(args.seeds) > 1 else ''} "
                                  f"{','.join(map(str, args.seeds))}")
          + f"; torch threads: {args.threads}" + ("; median [min-max] over seeds" if len(args.seeds) > 1 else ""))
    print(format_seed_table(results))
    by_optimizer = {name: [res[name] for res in results.values()] for name in next(iter(results.values()))}
    why = epoch_cost_line(by_optimizer)
    if why:
        print(why)
    print(verdict(by_optimizer))
    print(f"\ntotal CPU time: the whole fit's (setup excluded). Demo wall time {total:.1f} s; "
          f"per-epoch history in {args.out}/**/time_to_accuracy.json")
    return results


if __name__ == "__main__":
    main()
