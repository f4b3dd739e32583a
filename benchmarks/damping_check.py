"""K-FAC at two dampings on the tuned baselines of benchmarks/time_to_accuracy.py, 3 seeds each.

    python benchmarks/damping_check.py [--dampings 1e-3,3e-2] [--seeds 0,1,2]

The check behind the default damping (README, "Time to accuracy"): for the digits CNN and the MLP
autoencoder, with SGD and AdamW at the learning rates their sweeps picked, one line per (workload,
optimizer, damping) with the seconds to target per seed (None: not reached), the final metric and
whether the run diverged. Prints only; nothing is written.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import time_to_accuracy as tta  # noqa: E402

# (workload, optimizer, lr, epochs): the winners of the recorded sweeps (benchmarks/results/tta_*)
CASES = [("digits", "sgd", 0.1, 8), ("digits", "adamw", 0.016, 8),
         ("autoencoder", "adamw", 0.003, 30), ("autoencoder", "sgd", 1.0, 30)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dampings", default="1e-3,3e-2")
    p.add_argument("--seeds", default="0,1,2")
    args = p.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    for name in ("pytorch_lightning", "lightning_fabric", "lightning_spdkfac"):
        logging.getLogger(name).setLevel(logging.ERROR)
    seeds = [int(s) for s in args.seeds.split(",")]
    for workload, opt, lr, epochs in CASES:
        for damping in (float(d) for d in args.dampings.split(",")):
            runs = [tta.run_one(tta.WORKLOADS[workload], opt, lr, seed, epochs, {"damping": damping})
                    for seed in seeds]
            print(json.dumps({
                "workload": workload, "optimizer": opt, "lr": lr, "damping": damping,
                "seconds_to_target": [r["seconds_to_target"] for r in runs],
                "final_metric": [round(r["final_metric"], 4) for r in runs],
                "diverged": [r["diverged"] for r in runs],
            }), flush=True)


if __name__ == "__main__":
    main()
