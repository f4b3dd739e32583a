"""K-FAC-expand versus K-FAC-reduce (``factor_approx``) versus plain SGD: time per training step.

Run ``python benchmarks/factor_approx.py`` (``--help`` for options). Model: the demo's CIFAR ResNet
(``lightning_spdkfac.demo.cifar.ResNetCIFAR`` as a plain ``nn.Module``; ResNet-8, ``--blocks 3`` for ResNet-20)
on a fixed set of ``--n-batches`` random ``(batch, 3, 32, 32)`` batches, cycled, one torch thread by default.
Three copies of the model with SGD (momentum 0.9, lr 0.01): plain, ``KFACPreconditioner(factor_approx="expand")``
and ``factor_approx="reduce"``, factors every step and inverses every 10 (the paper's timing setting;
``--defaults``: the library's intervals). A step is zero_grad, forward, backward (the K-FAC hooks run here),
``pre.step()`` and ``opt.step()``, timed with overhead.py's runner in interleaved blocks of
``inv_update_steps`` steps (every K-FAC block holds one inverse step) after ``--warmup`` steps.

Reported: median ms per step, the ratio to SGD, the FLOP floor (the step's multiply-adds with K-FAC over those
without), the K-FAC overhead (median minus SGD's) and the mean per-step time of K-FAC's own phases
(``pre.timer``). docs/results/single-process.md has the recorded runs. ``--out DIR`` also writes
DIR/factor_approx.json; ``--quick``: 2 blocks of 2 steps at batch 8 (seconds).
"""

from __future__ import annotations

import copy
import math

import torch
from _common import (
    bench_parser,
    env_info,
    interleaved_blocks,
    layer_shapes,
    parse,
    print_table,
    random_batches,
    save_json,
    set_seed,
    set_threads,
    spread,
)
from overhead import Runner as OverheadRunner

from lightning_spdkfac.demo.cifar import ResNetCIFAR
from lightning_spdkfac.kfac.options import KFACOptions
from lightning_spdkfac.telemetry import PHASES

VARIANTS = ("sgd", "expand", "reduce")
SHOWN_PHASES = ("factor_compute", "factor_update", "inverse_compute", "precondition")


class Runner(OverheadRunner):
    """overhead.py's runner (one model copy, its SGD and, unless ``approx`` is None, its preconditioner),
    adding up K-FAC's phase times over the steps since :meth:`reset_phases`."""

    def __init__(self, model: torch.nn.Module, data, args, approx: str | None):
        if approx is None:
            super().__init__(model, data, args, kfac=False)
        else:
            super().__init__(model, data, args, kfac=True, factor_approx=approx,
                             factor_update_steps=args.factor_update_steps)
        self.reset_phases()

    def step(self) -> None:
        super().step()
        if self.pre is not None:
            for name, seconds in self.pre.timer.last.items():
                self.phases[name] += seconds
        self.steps += 1

    @property
    def loss(self) -> float:
        return math.nan if self.last_loss is None else float(self.last_loss)

    def reset_phases(self) -> None:
        self.phases = dict.fromkeys(PHASES, 0.0)
        self.steps = 0


def flop_floor(model: torch.nn.Module, x: torch.Tensor, approx: str, factor_every: int, inv_every: int) -> float:
    """(model + K-FAC FLOPs) / model FLOPs of one training step, from the layers' shapes.

    Model: forward + backward = 3 x the forward's 2 x multiply-adds of every Conv2d/Linear. K-FAC, per
    layer with A side a, G side g, R_a / R_g factor rows (expand: every position; reduce: every example):
    factor Gram matrices 2 (R_a a^2 + R_g g^2) every ``factor_every`` steps, Cholesky and inverse of
    both about a^3 + g^3 every ``inv_every`` steps, preconditioning 2 (g^2 a + g a^2) every step.
    """
    base = kfac = 0.0
    for s in layer_shapes(model, x):  # rows: batch x positions (im2col locations, a Linear's leading dims)
        a, g = s.a_dim, s.out_features
        base += 3 * 2 * s.rows * s.in_features * g
        rows = s.rows if approx == "expand" else x.shape[0]
        kfac += 2 * rows * (a * a + g * g) / factor_every + (a**3 + g**3) / inv_every + 2 * (g * g * a + g * a * a)
    return (base + kfac) / base


def main(argv: list[str] | None = None) -> None:
    p = bench_parser(__doc__.split("\n\n")[0], threads=1, seed=0,
                     out="folder for factor_approx.json (default: print only)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--blocks", type=int, default=1, help="basic blocks per ResNet stage (1: ResNet-8, 3: ResNet-20)")
    p.add_argument("--factor-update-steps", type=int, default=1)
    p.add_argument("--inv-update-steps", type=int, default=10)
    p.add_argument("--defaults", action="store_true",
                   help="the library's default factor and inverse intervals instead of the two options above")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps of each variant first")
    p.add_argument("--blocks-timed", type=int, default=15, help="interleaved blocks of each variant")
    p.add_argument("--n-batches", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.01)
    p.set_defaults(device="cpu")  # overhead.Runner's device (a CPU benchmark)
    args = parse(p, argv, quick={"batch": 8, "inv_update_steps": 2, "warmup": 1, "blocks_timed": 2, "n_batches": 1})
    if args.defaults:
        d = KFACOptions()
        args.factor_update_steps, args.inv_update_steps = d.factor_update_steps, d.inv_update_steps

    set_threads(args.threads)
    set_seed(args.seed)
    base = ResNetCIFAR(blocks=(args.blocks,) * 3)
    g = torch.Generator().manual_seed(args.seed + 1)
    data = random_batches(g, args.n_batches, args.batch, 3, 32, 32)
    runners = {v: Runner(copy.deepcopy(base), data, args, None if v == "sgd" else v) for v in VARIANTS}
    floors = {v: 1.0 if v == "sgd" else flop_floor(copy.deepcopy(base), data[0][0], v, args.factor_update_steps,
                                                   args.inv_update_steps) for v in VARIANTS}
    k = args.inv_update_steps

    for _ in range(args.warmup):
        for r in runners.values():
            r.step()
    for r in runners.values():
        r.reset_phases()
    times = interleaved_blocks({v: r.step for v, r in runners.items()}, args.blocks_timed, k, progress=True)

    env = env_info()
    print(f"ResNetCIFAR(blocks={args.blocks}) batch {args.batch} x 3x32x32, {env['threads']} thread(s), "
          f"torch {env['torch']}, {env['cpu_model']}")
    pre = runners["expand"].pre
    assert pre is not None
    print(f"{len(pre.layers)} K-FAC layers; factors every {args.factor_update_steps} step(s), inverses every {k} steps; "
          f"median of {args.blocks_timed} interleaved blocks of {k} steps")
    ms = {v: spread(t, 1e3) for v, t in times.items()}
    med = {v: s["median"] for v, s in ms.items()}
    rows = []
    for v in VARIANTS:
        r = runners[v]
        row = {"variant": v, "ms": med[v], "q1": ms[v]["q1"], "q3": ms[v]["q3"],
               "vs_sgd": med[v] / med["sgd"], "floor": floors[v], "overhead": med[v] - med["sgd"], "loss": r.loss}
        for ph in SHOWN_PHASES:
            row[ph] = r.phases[ph] / r.steps * 1e3 if r.pre is not None and r.steps else None
        rows.append(row)
    print_table(rows, [
        ("variant", "variant", ""), ("ms", "ms/step", ".1f"), ("q1", "q1", ".1f"), ("q3", "q3", ".1f"),
        ("vs_sgd", "x SGD", ".2f"), ("floor", "FLOP floor", ".2f"), ("overhead", "K-FAC ms", ".1f"),
        ("factor_compute", "hooks ms", ".1f"), ("factor_update", "update ms", ".2f"),
        ("inverse_compute", "inverse ms", ".2f"), ("precondition", "precond ms", ".2f"), ("loss", "last loss", ".3f"),
    ])
    over_e, over_r = med["expand"] - med["sgd"], med["reduce"] - med["sgd"]
    print(f"expand / reduce step time: {med['expand'] / med['reduce']:.2f}x; "
          f"K-FAC overhead expand / reduce: {over_e / over_r:.2f}x" if over_r > 0 else
          f"expand / reduce step time: {med['expand'] / med['reduce']:.2f}x; reduce overhead <= 0 (noise)")
    hooks_e, hooks_r = (runners[v].phases["factor_compute"] / runners[v].steps for v in ("expand", "reduce"))
    print(f"factor statistics in the hooks, expand / reduce: {hooks_e / hooks_r:.1f}x")
    if args.out:
        save_json(args.out, "factor_approx.json", {"env": env, "args": vars(args), "rows": rows, "per_block_s": times})
    if not all(math.isfinite(r.loss) for r in runners.values()):
        raise SystemExit("a run diverged (non-finite loss): the timings are not of a healthy run")


if __name__ == "__main__":
    main()
