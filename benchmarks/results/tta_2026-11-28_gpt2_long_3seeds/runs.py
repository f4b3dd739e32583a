"""Issue 37's gpt2_long measurement with 3 seeds: a list of runs, each through the harness's own ``run_one``.

The harness runs its sweep, re-runs and K-FAC rows one after another on one core; on this 2-core machine two queues
of these runs go side by side instead (two processes, one torch thread each, CPU seconds of the process as the
clock, so that the other process's load does not count). Each run's record (history included) is appended to
``--out`` (a runs.jsonl); ``summarize.py`` beside this file computes the target (tuned AdamW's median final val
loss) and every run's time to it.

    python benchmarks/results/tta_2026-11-28_gpt2_long_3seeds/runs.py --out OUT.jsonl \\
        --runs '[["adamw", "adamw", 0.003, 0, null], ["kfac on muon", "muon", 0.03, 1, {}]]'

A run is ``[tag, optimizer, lr, seed, kfac]``: ``kfac`` null for the baseline, else the ``KFAC(...)`` arguments
(``log_step_time`` is set off, as the harness does).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # benchmarks/
import time_to_accuracy as tta  # noqa: E402
from _common import set_threads  # noqa: E402

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--runs", required=True, help="JSON list of [tag, optimizer, lr, seed, kfac or null]")
    p.add_argument("--workload", default="gpt2_long")
    args = p.parse_args()
    set_threads(1)
    tta.CLOCK = "cpu"
    tta.quiet_lightning()
    w = tta.WORKLOADS[args.workload]
    tta.run_one(w, "sgd", w.lrs["sgd"][0], 0, 1, {"log_step_time": False})  # untimed warm-up, as the harness does
    for tag, opt, lr, seed, kfac in json.loads(args.runs):
        kw = None if kfac is None else {"log_step_time": False, **kfac}
        r = tta.run_one(w, opt, lr, seed, w.budget, kw)
        r["tag"] = tag
        with open(args.out, "a") as f:
            f.write(json.dumps(r, default=str) + "\n")
        print(tag, opt, lr, seed, "final", r["final_metric"], "wall", r["wall_seconds"], flush=True)
