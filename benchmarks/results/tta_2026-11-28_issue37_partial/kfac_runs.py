"""Issue 37's reduced gpt2_long measurement: the K-FAC rows, run beside (not after) the baseline sweep.

The 2-core machine was shared; the harness's K-FAC phase starts only after its sweep, which would not have finished in
time. This runs the same ``run_one`` (same model, data, seed, schedule, CPU-seconds clock) for each configuration
given, at the lrs fixed before the sweep (AdamW 1e-2 and Muon 3e-2: the sweep's only lrs), appending each run's
record to ``--out`` (a runs.jsonl). Times to target are computed afterwards against the sweep's target
(``summarize.py`` beside this file).

    python benchmarks/results/tta_2026-11-28_issue37_partial/kfac_runs.py --out OUT.jsonl
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # benchmarks/
import time_to_accuracy as tta  # noqa: E402
from _common import set_threads  # noqa: E402

CONFIGS = [("kfac defaults", "adamw", 1e-2, {"log_step_time": False}),
           ("kfac on_muon", "muon", 3e-2, {"log_step_time": False})]

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--workload", default="gpt2_long")
    args = p.parse_args()
    set_threads(1)
    tta.CLOCK = "cpu"
    tta.quiet_lightning()
    w = tta.WORKLOADS[args.workload]
    tta.run_one(w, "sgd", w.lrs["sgd"][0], 0, 1, {"log_step_time": False})  # untimed warm-up, as the harness does
    for tag, opt, lr, kfac in CONFIGS:
        r = tta.run_one(w, opt, lr, 0, w.budget, kfac)
        r["tag"] = tag
        with open(args.out, "a") as f:
            f.write(json.dumps(r, default=str) + "\n")
        print(tag, opt, lr, "final", r["final_metric"], "wall", r["wall_seconds"], flush=True)
