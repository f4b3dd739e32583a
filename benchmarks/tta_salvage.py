"""Rebuild the baseline-sweep summaries of an interrupted ``time_to_accuracy.py`` invocation from its log.

    python benchmarks/tta_salvage.py LOG --workload digits --epochs 8 --clock cpu --out DIR [--complete-seeds]

``time_to_accuracy.py`` writes results.json when a workload ends (and, since runs.jsonl, every run as it ends);
an invocation stopped before that leaves only its log, one line per run::

    [digits] seed 0 sweep adamw                  lr 0.008    target: 2.28s        final 0.9750  wall 6.1s

This parses those lines into per-run records without histories (time to target, final metric, divergence and
wall seconds as printed: the time to target is under the invocation's ``--clock``), summarizes them with
``time_to_accuracy.summarize`` per optimizer and lr, ranks them with its ``rank_key``, and writes DIR/results.json
with the sweep rows, the winners and the parsed runs (``history: []``, ``salvaged_from`` the log) but no ``runs``
entry that ``--baselines-from`` would re-score: it takes the rows as recorded. ``--complete-seeds`` keeps only the
seeds whose every (optimizer, lr) of the first seed ran, so that every row has the same seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

LINE = re.compile(r"^\s*\[(?P<w>[\w-]+)\] seed (?P<seed>\d+) sweep (?P<opt>\w+)\s+lr (?P<lr>\S+)\s+target: "
                  r"(?:(?P<t>[\d.]+)s|not reached)\s+final (?P<final>\S+)\s+wall (?P<wall>[\d.]+)s(?P<div>\s+DIVERGED)?")


def parse(path: str, workload: str) -> list[dict]:
    runs = []
    with open(path) as f:
        for line in f:
            m = LINE.match(line)
            if not m or m["w"] != workload:
                continue
            t = float(m["t"]) if m["t"] else None
            runs.append({"workload": workload, "optimizer": m["opt"], "lr": float(m["lr"]), "seed": int(m["seed"]),
                         "tag": f"sweep {m['opt']}", "reached": t is not None, "seconds_to_target": t,
                         "final_metric": float(m["final"]), "diverged": bool(m["div"]),
                         "wall_seconds": float(m["wall"]), "history": [], "salvaged_from": path})
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log")
    p.add_argument("--workload", required=True)
    p.add_argument("--epochs", type=int, required=True, help="the invocation's epochs (its log does not say)")
    p.add_argument("--clock", choices=("wall", "cpu"), required=True, help="the invocation's --clock")
    p.add_argument("--complete-seeds", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import time_to_accuracy as tta
    from _common import format_table

    w = tta.WORKLOADS[args.workload]
    runs = parse(args.log, args.workload)
    if not runs:
        raise SystemExit(f"no sweep lines of {args.workload!r} in {args.log}")
    seeds = sorted({r["seed"] for r in runs})
    if args.complete_seeds:
        first = {(r["optimizer"], r["lr"]) for r in runs if r["seed"] == seeds[0]}
        seeds = [s for s in seeds if {(r["optimizer"], r["lr"]) for r in runs if r["seed"] == s} >= first]
        runs = [r for r in runs if r["seed"] in seeds]
    sweep: dict[str, list[dict]] = {}
    for o in dict.fromkeys(r["optimizer"] for r in runs):
        for lr in sorted({r["lr"] for r in runs if r["optimizer"] == o}):
            rs = [r for r in runs if r["optimizer"] == o and math.isclose(r["lr"], lr)]
            sweep.setdefault(o, []).append({"lr": lr, **tta.summarize(w, rs), "from": args.log})
    winners = {o: min(rs, key=lambda s: tta.rank_key(w, s)) for o, rs in sweep.items()}
    edge = {o: len(rs) > 1 and winners[o]["lr"] in (rs[0]["lr"], rs[-1]["lr"]) for o, rs in sweep.items()}
    best_all = min(winners, key=lambda o: tta.rank_key(w, winners[o]))
    bases = [o for o in ("sgd", "adamw") if o in winners]
    best = min(bases, key=lambda o: tta.rank_key(w, winners[o])) if bases else None
    rows = [tta.row(f"{o}{' *' if s is winners[o] else ''}", s["lr"], s) for o, rs in sweep.items() for s in rs]
    table = "\n".join([f"== {w.name}: {w.title}, target {w.target:g}, {args.epochs} epochs, seeds {seeds}, time = "
                       f"{args.clock} seconds (salvaged from {args.log}: the invocation was stopped)",
                       format_table(rows, tta.COLUMNS)]
                      + [f"   note: the {o} winner lr {winners[o]['lr']:g} is at the edge of its grid"
                         for o, e in edge.items() if e])
    res = {"workload": w.name, "title": w.title, "monitor": w.monitor, "mode": w.mode, "target": w.target,
           "epochs": args.epochs, "seeds": seeds, "clock": args.clock, "lrs": {o: [s["lr"] for s in rs] for o, rs in sweep.items()},
           "sweep": sweep, "winners": winners, "winner_at_grid_edge": edge, "widened": {},
           "best_overall": {"optimizer": best_all, "lr": winners[best_all]["lr"]},
           "best_baseline": {"optimizer": best, "lr": winners[best]["lr"]} if best else None,
           "kfac_phase": False, "salvaged_from": args.log, "salvaged_runs": runs, "runs": [], "table": table}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"argv": sys.argv, "workloads": [res]}, f, indent=1, default=str)
    print(table)


if __name__ == "__main__":
    main()
