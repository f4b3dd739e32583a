"""One process: iteration time with ``async_inverses`` on and off, interleaved in one invocation.

The issue's setting: one process, 1 intra-op thread (``torch.set_num_threads(1)``), factors and inverses every
step, models whose inversions are at least a third of the step. With ``async_inverses=True`` the inversions of
step k run on a worker thread during ``opt.step()`` and the forward/backward of step k+1 and are swapped in at
the start of step k+1's ``pre.step()``: with a second core free, their time leaves the step.

Models (random data of the right shape, SGD lr 0.01 momentum 0.9, K-FAC damping 0.03, kl_clip default):

- ``mlp``: 4 Linear layers 512 wide (A and G factors up to 513 x 513), batch 256;
- ``cnn``: the ``SmallResNet`` of ``benchmarks/iteration_time.py`` (A factors up to 1153 x 1153), batch 32.

For every repeat, each (model, setting) pair runs one timed block of ``--steps`` steps, the pairs in a
rotating order. Reported per pair: the median ms per step over repeats with the min-max spread, the share
of the synchronous step spent in inversions (``inverse_compute``), and the ratio async/sync of the medians
(and of each repeat's block, as a spread). Target: ratio <= 0.8 where the inversion share is >= 1/3.

    python benchmarks/async_inverses.py                # prints; writes nothing
    python benchmarks/async_inverses.py --out DIR      # also writes DIR/async_inverses.json
    python benchmarks/async_inverses.py --quick        # a 128-wide mlp, 2 repeats of 2 steps (seconds)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from _common import (
    bench_parser,
    env_info,
    interleave,
    mlp,
    parse,
    print_table,
    random_batches,
    save_json,
    set_threads,
)
from torch import nn

from lightning_spdkfac import KFACPreconditioner

TARGET = 0.8


def make_model(name: str, width: int = 512) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if name == "mlp":
        model: nn.Module = mlp(width, width, width, width, 10)
        x, y = random_batches(g, 1, 256, width)[0]
    else:
        # imported here: iteration_time imports Lightning (seconds), which the mlp does not need
        from iteration_time import SmallResNet

        model = SmallResNet()
        x, y = random_batches(g, 1, 32, 3, 32, 32)[0]
    return model, x, y


def make_step(model_name: str, async_inverses: bool, width: int = 512) -> tuple[Callable[[], None], KFACPreconditioner]:
    model, x, y = make_model(model_name, width)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    pre = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1, damping=0.03,
                             async_inverses=async_inverses)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        pre.step(opt)
        opt.step()

    return step, pre


def run(args: argparse.Namespace) -> dict:
    set_threads(1)
    pairs = {(m, mode): make_step(m, mode == "async", args.width) for m in args.models for mode in ("sync", "async")}
    for fn, _ in pairs.values():  # warm-up: allocations, first inverses
        for _ in range(args.warmup):
            fn()
    inv_share: dict[str, list[float]] = {m: [] for m in args.models}

    def block(key: tuple[str, str]) -> Callable[[], None]:
        fn, pre = pairs[key]

        def run_block() -> None:
            inv = 0.0
            for _ in range(args.steps):
                fn()
                inv += pre.timer.last["inverse_compute"]
            if key[1] == "sync":
                inv_share[key[0]].append(inv / args.steps)  # seconds per step; a share below
        return run_block

    raw = interleave({k: block(k) for k in pairs}, args.reps)
    times = {k: [t / args.steps for t in ts] for k, ts in raw.items()}
    inv_share = {m: [s / t for s, t in zip(v, times[(m, "sync")])] for m, v in inv_share.items()}
    rows = []
    for m in args.models:
        sync, asyn = times[(m, "sync")], times[(m, "async")]
        ratios = [a / s for a, s in zip(asyn, sync)]
        for mode, ts in (("sync", sync), ("async", asyn)):
            rows.append({
                "model": m, "mode": mode, "median_ms": 1e3 * statistics.median(ts), "min_ms": 1e3 * min(ts),
                "max_ms": 1e3 * max(ts),
                "inv_share": statistics.median(inv_share[m]) if mode == "sync" else float("nan"),
                "ratio": statistics.median(asyn) / statistics.median(sync) if mode == "async" else float("nan"),
                "ratio_min": min(ratios) if mode == "async" else float("nan"),
                "ratio_max": max(ratios) if mode == "async" else float("nan"),
            })
    return {"rows": rows, "env": env_info(), "args": {"repeats": args.reps, **vars(args)}, "target": TARGET}


def main(argv: list[str] | None = None) -> None:
    p = bench_parser(__doc__, out="folder for async_inverses.json (default: print only)", reps=7,
                     reps_flags=("--repeats", "--reps"))
    p.add_argument("--models", nargs="+", default=["mlp", "cnn"], choices=["mlp", "cnn"])
    p.add_argument("--steps", type=int, default=10, help="steps per timed block")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each pair first")
    p.add_argument("--width", type=int, default=512, help="the mlp's width")
    args = parse(p, argv, quick={"models": ["mlp"], "reps": 2, "steps": 2, "warmup": 1, "width": 128})
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("needs at least 2 usable cores (the worker thread runs on the second)")
    result = run(args)
    print_table(result["rows"], [
        ("model", "model", "s"), ("mode", "inverses", "s"), ("median_ms", "median ms/step", ".1f"),
        ("min_ms", "min", ".1f"), ("max_ms", "max", ".1f"), ("inv_share", "inversion share", ".2f"),
        ("ratio", "async/sync", ".3f"), ("ratio_min", "per-repeat min", ".3f"),
        ("ratio_max", "per-repeat max", ".3f")])
    for row in result["rows"]:
        if row["mode"] == "async":
            share = next(r["inv_share"] for r in result["rows"] if r["model"] == row["model"] and r["mode"] == "sync")
            verdict = "PASS" if row["ratio"] <= TARGET else "MISS"
            note = "" if share >= 1 / 3 else " (inversion share below 1/3: outside the target's setting)"
            print(f"{row['model']}: async/sync {row['ratio']:.3f} (target <= {TARGET}) {verdict}{note}")
    if args.out:
        save_json(args.out, "async_inverses.json", result)


if __name__ == "__main__":
    main()
