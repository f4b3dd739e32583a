"""Time to tuned AdamW's validation loss on a transformers GPT-2 (examples/hf_gpt2.py), K-FAC at library defaults.

    python benchmarks/hf_gpt2_tta.py                       # the recorded run (about 35 minutes on 1 thread)
    python benchmarks/hf_gpt2_tta.py --budget 1 --lrs 0.01 --seeds 0    # a smoke run (about 2 minutes)

The model and data are those of configs/hf_gpt2*.yaml (``bench_model``, ``bench_data``): GPT2LMHeadModel from a
GPT2Config (2 layers, width 64, 50257-token tied head, random init) on the stdlib byte corpus, 16 x 64 bytes per
step, validation every 10 steps on 32 fixed windows, AdamW (weight decay 0.1, betas 0.9/0.95), 10 warmup steps
then cosine to lr/10 over the budget. One run is ``time_to_accuracy.run_one`` (the same timing: wall seconds
from just before ``trainer.fit`` to the end of each validation, so setup and validation count for everyone).

1. AdamW lr sweep, one seed (``--sweep-seed``), the fixed budget; the tuned lr is the one with the lowest final
   validation loss (``--sweep-from`` reuses an earlier results.json's sweep).
2. Seed by seed, alternating which goes first: AdamW at the tuned lr and ``KFAC()`` at library defaults on the
   same AdamW and lr (the same initial weights and batches per seed).
3. Target = the median over the seeds of AdamW's own final validation loss (phase 2), so AdamW's median time to
   it is essentially its whole run. Reported: median and [min-max] seconds to the target per optimizer, the
   ratio K-FAC / AdamW, the optimizer steps to the target, and the per-step cost ratio K-FAC / AdamW (seconds
   at the last validation over steps). Also the times to the sweep seed's final loss at the tuned lr.

Output: ``--out`` (default a fresh ``benchmarks/results/run-<date>-<time>-hf_gpt2_tta/``) with results.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import statistics
import sys
import time
import warnings
from typing import Any

import torch
from _common import env_info, format_table, fresh_run_dir, write_json
from time_to_accuracy import Workload, _retarget, run_one, summarize

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from examples.hf_gpt2 import bench_data, bench_model  # noqa: E402

WORKLOAD = Workload("hf_gpt2", "transformers GPT-2 (2x64, vocab 50257, tied head) on stdlib bytes, val loss",
                    bench_model, bench_data, "val_loss", "min", math.nan, budget=8,
                    lrs={"adamw": [1e-3, 3e-3, 1e-2, 3e-2]}, quick_budget=1)
KFAC_DEFAULTS = {"log_step_time": False}  # KFAC() at library defaults (no logger in these runs)

SWEEP_COLUMNS = [("lr", "AdamW lr", ".3g"), ("final", "final val loss", ".4f"), ("best", "best val loss", ".4f"),
                 ("wall_s", "wall s", ".1f"), ("diverged", "diverged", "")]
TTA_COLUMNS = [("optimizer", "optimizer", ""), ("lr", "lr", ".3g"), ("median_s", "median s to target", ".1f"),
               ("span", "[min-max]", ""), ("reached", "reached", ""), ("steps", "median steps to target", ".0f"),
               ("step_s", "median s/step", ".3f"), ("final", "median final", ".4f"),
               ("wall", "median wall s", ".1f")]


def per_step_seconds(run: dict) -> float:
    """Seconds per optimizer step up to the last validation (setup and validations included)."""
    last = run["history"][-1]
    return last["seconds"] / last["step"]


def tta_rows(w: Workload, runs: dict[str, list[dict]], lr: float) -> tuple[list[dict], dict[str, dict]]:
    rows, sums = [], {}
    for label, rs in runs.items():
        s = summarize(w, rs)
        steps = [r["epoch_to_target"] * 10 if r["reached"] else math.inf for r in rs]  # 10 steps per epoch
        s["median_steps"] = statistics.median(steps)
        s["median_step_s"] = statistics.median(per_step_seconds(r) for r in rs)
        s["median_wall"] = statistics.median(r["history"][-1]["seconds"] for r in rs)
        sums[label] = s
        span = f"[{s['min_s']:.1f}-{s['max_s']:.1f}]" if s["min_s"] is not None else "[-]"
        rows.append({"optimizer": label, "lr": lr, "median_s": s["median_s"], "span": span,
                     "reached": f"{s['reached']}/{s['n']}",
                     "steps": s["median_steps"] if math.isfinite(s["median_steps"]) else None,
                     "step_s": s["median_step_s"], "final": s["final"], "wall": s["median_wall"]})
    return rows, sums


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--lrs", default=",".join(f"{x:g}" for x in WORKLOAD.lrs["adamw"]), help="AdamW lr sweep")
    p.add_argument("--sweep-seed", type=int, default=0)
    p.add_argument("--seeds", default="0,1,2", help="seeds of the AdamW / K-FAC comparison")
    p.add_argument("--budget", type=int, default=WORKLOAD.budget, help="epochs of 10 optimizer steps")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sweep-from", default=None, metavar="RESULTS_JSON", help="reuse an earlier run's sweep")
    p.add_argument("--out", default=None, help="a fresh folder (default benchmarks/results/run-<stamp>-hf_gpt2_tta)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")
    warnings.filterwarnings("ignore", ".*weight is tied to.*")  # K-FAC's one note about wte, once per fit
    for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    out = args.out or fresh_run_dir("hf_gpt2_tta")
    if os.path.exists(out) and os.listdir(out):
        p.error(f"--out {out} is not empty: give a fresh folder")
    os.makedirs(out, exist_ok=True)
    lrs = [float(x) for x in args.lrs.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    w = WORKLOAD
    payload: dict[str, Any] = {"argv": sys.argv, "args": vars(args), "env": env_info(), "date": time.strftime("%F")}
    t_all = time.perf_counter()

    def do(lr: float, seed: int, kfac: dict | None, tag: str) -> dict:
        r = run_one(w, "adamw", lr, seed, args.budget, kfac)
        r["tag"] = tag
        r.pop("workload")
        print(f"  seed {seed} {tag:<14} lr {lr:<7.3g} final {r['final_metric']:.4f}  wall {r['wall_seconds']:.1f}s"
              f"  {per_step_seconds(r) if r['history'] else float('nan'):.3f} s/step"
              f"{'  DIVERGED' if r['diverged'] else ''}{'  ' + r['error'] if r['error'] else ''}", flush=True)
        return r

    run_one(w, "adamw", lrs[0], 0, 1, KFAC_DEFAULTS)  # untimed warm-up: imports, allocator, first calls

    # 1. the AdamW lr sweep (one seed) or a recorded one
    if args.sweep_from:
        import json

        with open(args.sweep_from) as f:
            sweep = json.load(f)["sweep"]
        print(f"sweep from {args.sweep_from}")
    else:
        sweep = [do(lr, args.sweep_seed, None, "sweep adamw") for lr in lrs]
    finite = [r for r in sweep if math.isfinite(r["final_metric"]) and not r["diverged"]]
    if not finite:
        raise SystemExit("no AdamW run of the sweep finished")
    best = min(finite, key=lambda r: r["final_metric"])
    best_lr = best["lr"]
    sweep_rows = [{"lr": r["lr"], "final": r["final_metric"],
                   "best": min(h["val_loss"] for h in r["history"]) if r["history"] else None,
                   "wall_s": r["wall_seconds"], "diverged": "yes" if r["diverged"] else "no"} for r in sweep]
    at_edge = best_lr in (min(lrs), max(lrs)) and len(lrs) > 1
    sweep_table = (f"-- AdamW lr sweep, seed {best['seed']}, {args.budget * 10} steps; tuned lr {best_lr:g}"
                   f"{' (AT THE EDGE of the grid)' if at_edge else ''}\n" + format_table(sweep_rows, SWEEP_COLUMNS))
    print(sweep_table, flush=True)
    payload.update(sweep=sweep, sweep_table=sweep_table, tuned_lr=best_lr, tuned_lr_at_grid_edge=at_edge)

    # 2. AdamW and K-FAC, seed by seed, alternating which runs first
    runs: dict[str, list[dict]] = {"AdamW (tuned)": [], "KFAC() on AdamW": []}
    for i, seed in enumerate(seeds):
        order = [("AdamW (tuned)", None), ("KFAC() on AdamW", KFAC_DEFAULTS)]
        for label, kfac in order if i % 2 == 0 else order[::-1]:
            runs[label].append(do(best_lr, seed, kfac, "adamw" if kfac is None else "kfac defaults"))

    # 3. targets: AdamW's own median final loss over the seeds (the headline), and the sweep seed's final loss
    tables, results = [], {}
    targets = {"adamw_median_final": statistics.median(r["final_metric"] for r in runs["AdamW (tuned)"]),
               "sweep_seed_final": best["final_metric"]}
    for key, target in targets.items():
        wt = dataclasses.replace(w, target=target)
        for rs in runs.values():
            _retarget(wt, rs)
        rows, sums = tta_rows(wt, runs, best_lr)
        a, k = sums["AdamW (tuned)"], sums["KFAC() on AdamW"]
        ratio = k["median_s"] / a["median_s"] if k["median_s"] and a["median_s"] else None
        ratio_wall = k["median_s"] / a["median_wall"] if k["median_s"] else None
        step_ratio = k["median_step_s"] / a["median_step_s"]
        fmt = {k: f"{v:.2f}" if v is not None else "n/a (the median seed did not reach the target)"
               for k, v in (("ratio", ratio), ("wall", ratio_wall))}
        text = (f"-- time to val loss <= {target:.4f} ({key}), seeds {seeds}, {args.budget * 10} steps, AdamW lr "
                f"{best_lr:g}\n" + format_table(rows, TTA_COLUMNS)
                + f"\n   ratio K-FAC / AdamW, median time to target: {fmt['ratio']}"
                + f"; K-FAC median time to target / AdamW median wall time: {fmt['wall']}")
        text += f"; per-step cost K-FAC / AdamW: {step_ratio:.2f}"
        tables.append(text)
        results[key] = {"target": target, "summaries": sums, "ratio": ratio, "ratio_to_adamw_wall": ratio_wall,
                        "per_step_ratio": step_ratio,
                        "per_seed": {label: [{"seed": r["seed"], "seconds_to_target": r["seconds_to_target"],
                                              "steps_to_target": r["epoch_to_target"] and r["epoch_to_target"] * 10,
                                              "final": r["final_metric"], "s_per_step": per_step_seconds(r)}
                                             for r in rs] for label, rs in runs.items()}}
    payload.update(targets=targets, results=results, table="\n\n".join([sweep_table, *tables]),
                   runs=runs, wall_seconds=round(time.perf_counter() - t_all, 1))
    write_json(os.path.join(out, "results.json"), payload)
    print("\n" + "\n\n".join(tables))
    print(f"\nwrote {out}/results.json ({payload['wall_seconds']:.0f} s in all)")


if __name__ == "__main__":
    main()
