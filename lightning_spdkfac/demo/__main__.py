"""``python -m lightning_spdkfac.demo`` (``make demo``): K-FAC vs. SGD on 8x8 digits, as a table.

Trains ``configs/digits.yaml`` (SGD + the KFAC callback) and ``configs/digits_sgd.yaml`` (the same
run without it) through the ``spdkfac fit`` CLI, in this process, one after the other, then
prints final accuracy, epochs and wall time to 97% validation accuracy and total time for both.
Results go to ``demo_runs/`` (``<out>/kfac``, ``<out>/sgd``, ``<out>/summary.json``).
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


def format_table(results: dict[str, dict]) -> str:
    target = next(iter(results.values()))["target"]
    pct = f"{target:.0%}"
    header = ("", "final val acc", "best val acc", f"epochs to {pct}", f"time to {pct}", "total time")
    rows = [header]
    for name, r in results.items():
        reached = r["epoch"] is not None
        rows.append((
            name,
            f"{r['final_val_acc']:.2%}",
            f"{r['best_val_acc']:.2%}",
            f"{r['epoch']} of {r['epochs']}" if reached else f"not in {r['epochs']}",
            f"{r['seconds']:.1f} s" if reached else "not reached",
            f"{r['total_seconds']:.1f} s",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lightning_spdkfac.demo", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("demo_runs"), help="run directory (default: demo_runs)")
    p.add_argument("--configs", type=Path, default=REPO / "configs", help="folder of digits*.yaml")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: for this tiny model more threads only add overhead, "
                        "and single-threaded timings stay comparable on a busy machine)")
    p.add_argument("--epochs", type=int, default=None, help="override trainer.max_epochs (for a quick look)")
    p.add_argument("--seeds", type=_seed_list, default=None, metavar="S[,S...]",
                   help="run both configs once per seed (seed_everything and the data split's seed), interleaved, "
                        "and print the median and range over seeds (default: the configs' seed only)")
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


def format_seed_table(per_seed: dict[int, dict[str, dict]]) -> str:
    """One row per optimizer: median [min-max] over seeds; epochs and time to target over the seeds
    that reached it (how many did is shown)."""
    first = next(iter(per_seed.values()))
    pct = f"{next(iter(first.values()))['target']:.0%}"
    header = ("", "final val acc", f"reached {pct}", f"epochs to {pct}", f"time to {pct}", "total time")
    rows = [header]
    for name in first:
        runs = [seed_results[name] for seed_results in per_seed.values()]
        reached = [r for r in runs if r["epoch"] is not None]
        rows.append((
            name,
            _spread([100 * r["final_val_acc"] for r in runs], "{:.1f}%"),
            f"{len(reached)} of {len(runs)}",
            _spread([r["epoch"] for r in reached], "{:g}") if reached else "-",
            _spread([r["seconds"] for r in reached], "{:.1f} s") if reached else "-",
            _spread([r["total_seconds"] for r in runs], "{:.1f} s"),
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


def verdict(runs: dict[str, list[dict]]) -> str:
    """One line: who reached the target first in seconds, and by how much (medians over the runs given).

    ``runs``: optimizer name -> its runs (one per seed). A run that did not reach the target counts as
    never reaching it; the median of the seconds then is the median with those as infinite.
    """
    first = next(iter(runs.values()))[0]
    pct = f"{first['target']:.0%}"

    def median_seconds(rs: list[dict]) -> float:
        return statistics.median([r["seconds"] if r["epoch"] is not None else math.inf for r in rs])

    kfac, sgd = median_seconds(runs["K-FAC"]), median_seconds(runs["SGD"])
    if math.isinf(kfac) and math.isinf(sgd):
        return f"verdict: neither reached {pct} (median over the runs)."
    if math.isinf(kfac):
        return f"verdict: SGD reached {pct} in {sgd:.1f} s; K-FAC did not (median over the runs): K-FAC loses."
    if math.isinf(sgd):
        return f"verdict: K-FAC reached {pct} in {kfac:.1f} s; SGD did not (median over the runs): K-FAC wins."
    ratio = kfac / sgd
    word = "ties with SGD (within 10%)" if 0.9 <= ratio <= 1.1 else "wins" if ratio < 1 else "loses"
    return (f"verdict: K-FAC {word} in seconds: {pct} in {kfac:.1f} s against SGD's {sgd:.1f} s "
            f"(K-FAC/SGD = {ratio:.2f}x, median over the runs, a run that missed counting as never; "
            "one run moves by a third on a busy machine).")


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
    results: dict[Any, dict[str, Any]]  # optimizer -> its results, or seed -> optimizer -> its results
    if args.seeds is None:
        results = {}
        for name, sub, config in RUNS:
            print(f"training {name:5s} ({config}) ...", flush=True)
            results[name] = run_config(args.configs / config, args.out / sub, extra)
    else:
        # Seed by seed, both optimizers back to back: a slow spell of a shared machine hits both alike.
        results = {}
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
    if args.seeds is None:
        print(describe(args.out / "kfac" / "config.yaml") + f"; torch threads: {args.threads}")
        print(format_table(results))
        print(verdict({name: [r] for name, r in results.items()}))
    else:
        first = args.out / f"seed{args.seeds[0]}" / "kfac" / "config.yaml"
        print(describe(first).replace(f"seed {args.seeds[0]}", f"seeds {','.join(map(str, args.seeds))}")
              + f"; torch threads: {args.threads}; median [min-max] over seeds")
        print(format_seed_table(results))
        print(verdict({name: [res[name] for res in results.values()] for name in next(iter(results.values()))}))
    print(f"\ntotal time: fit wall time (setup excluded). Demo wall time {total:.1f} s; "
          f"per-epoch history in {args.out}/**/time_to_accuracy.json")
    return results


if __name__ == "__main__":
    main()
