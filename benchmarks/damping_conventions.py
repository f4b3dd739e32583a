"""How the damping is split between A and G, measured: the evidence behind the pi-balanced default.

    python benchmarks/damping_conventions.py [--conventions factor,pi,relative,model] [--seeds 0]
                                             [--dampings 1e-4,1e-3,1e-2,1e-1] [--cases digits-sgd,...]

For each convention, case and damping, one line of JSON: seconds and epoch to target per seed
(None: not reached), final metric and divergence (final train loss above the first, or non-finite),
on the workloads of benchmarks/time_to_accuracy.py. The conventions (docs/math.md, "Inverses"):

- ``factor``: lambda added to each factor, (A + lambda I)^-1 and (G + lambda I)^-1: the block is damped
  by only lambda^2 where both factors are small (the convention before pi-balancing).
- ``pi``: the library's convention, A + pi sqrt(lambda) I and G + sqrt(lambda)/pi I.
- ``relative``: lambda relative to each layer's scale, sqrt(lambda) tr(A)/dim A and sqrt(lambda) tr(G)/dim G
  (damping lambda * mean eigenvalue of A (x) G): a constant factor on the loss would not change it.
- ``model``: pi-balanced with lambda times the model-wide mean eigenvalues of A and of G (all layers
  pooled), so layers keep their absolute relation while the loss's scale drops out.
- ``eigen``: ``inverse_method="eigen"``, the exact damping 1/(d_A d_G + lambda) in the factors' eigenbases.

The conventions other than ``pi`` are installed by replacing ``Inverter._factor_dampings``
(the one place the split is decided) in this process. Prints the lines; ``--out DIR`` also writes them to
DIR/damping_conventions.jsonl. ``--quick``: digits-sgd, pi, damping 1e-3, one epoch.
"""

from __future__ import annotations

import json
import logging
import math
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import time_to_accuracy as tta
import torch
from _common import Progress, bench_parser, parse, set_threads

from lightning_spdkfac.kfac.inverse_steps import Inverter
from lightning_spdkfac.kfac.layer_state import KFACLayer

Split = dict[tuple[int, str], torch.Tensor]
PI = Inverter._factor_dampings


def _mean_eig(f: torch.Tensor) -> torch.Tensor:
    return f.diagonal().sum(dtype=torch.float64) / f.shape[0]


def per_factor(layers: list[KFACLayer], damping: float) -> Split:
    d = torch.tensor(damping, dtype=torch.float64)
    return {(ly.index, w): d for ly in layers for w in ("A", "G")}


def relative(layers: list[KFACLayer], damping: float) -> Split:
    root = math.sqrt(damping)
    out: Split = {}
    for ly in layers:
        assert ly.A is not None and ly.G is not None
        out[(ly.index, "A")], out[(ly.index, "G")] = root * _mean_eig(ly.A), root * _mean_eig(ly.G)
    return out


def model_wide(layers: list[KFACLayer], damping: float) -> Split:
    a = [ly.A for ly in layers if ly.A is not None]
    g = [ly.G for ly in layers if ly.G is not None]
    scale_a = sum(float(f.diagonal().sum()) for f in a) / sum(f.shape[0] for f in a)
    scale_g = sum(float(f.diagonal().sum()) for f in g) / sum(f.shape[0] for f in g)
    return PI(layers, damping * scale_a * scale_g)


CONVENTIONS: dict[str, Callable[[list[KFACLayer], float], Split]] = {
    "factor": per_factor, "pi": PI, "relative": relative, "model": model_wide, "eigen": PI}

# name -> (workload, optimizer, lr, epochs): the repro (SGD 0.05) and the recorded sweep winners
CASES = {"digits-sgd": ("digits", "sgd", 0.05, 8), "digits-adamw": ("digits", "adamw", 0.016, 8),
         "autoencoder-adamw": ("autoencoder", "adamw", 0.003, 30)}


def main(argv: list[str] | None = None) -> None:
    p = bench_parser(__doc__, out="folder for damping_conventions.jsonl (default: print only)", threads=1)
    p.add_argument("--conventions", default=",".join(CONVENTIONS))
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--dampings", default="1e-4,1e-3,1e-2,1e-1")
    p.add_argument("--seeds", default="0")
    p.add_argument("--epochs", type=int, default=None, help="epochs of every case (default: the case's own)")
    args = parse(p, argv, quick={"conventions": "pi", "cases": "digits-sgd", "dampings": "1e-3", "epochs": 1})
    set_threads(args.threads)
    warnings.filterwarnings("ignore")
    for name in ("pytorch_lightning", "lightning_fabric", "lightning_spdkfac"):
        logging.getLogger(name).setLevel(logging.ERROR)
    seeds = [int(s) for s in args.seeds.split(",")]
    dampings = [float(d) for d in args.dampings.split(",")]
    cases, conventions = args.cases.split(","), args.conventions.split(",")
    lines: list[str] = []
    bar = Progress(len(cases) * len(conventions) * len(dampings), "run")
    try:
        for case in cases:
            workload, opt, lr, epochs = CASES[case]
            for conv in conventions:
                Inverter._factor_dampings = staticmethod(CONVENTIONS[conv])  # type: ignore[method-assign]
                for damping in dampings:
                    kfac = {"damping": damping, "log_step_time": False}
                    if conv == "eigen":
                        kfac["inverse_method"] = "eigen"
                    runs = [tta.run_one(tta.WORKLOADS[workload], opt, lr, seed, args.epochs or epochs, kfac)
                            for seed in seeds]
                    lines.append(json.dumps({
                        "case": case, "convention": conv, "damping": damping,
                        "seconds_to_target": [r["seconds_to_target"] for r in runs],
                        "epoch_to_target": [r["epoch_to_target"] for r in runs],
                        "final_metric": [round(r["final_metric"], 4) for r in runs],
                        "diverged": [r["diverged"] for r in runs],
                    }))
                    print(lines[-1], flush=True)
                    bar.tick()
    finally:
        Inverter._factor_dampings = staticmethod(PI)  # type: ignore[method-assign]
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        Path(args.out, "damping_conventions.jsonl").write_text("".join(line + "\n" for line in lines))
        print(f"wrote {Path(args.out, 'damping_conventions.jsonl')}")


if __name__ == "__main__":
    main()
