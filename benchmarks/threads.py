"""K-FAC and SGD steps on CPU at 1 and 2 intra-op threads, with and without a busy core.

Interleaved in one invocation: for every repeat, with the background spinner off and then on (a
subprocess running ``while True: pass``), each variant runs one timed block of ``--steps`` optimizer
steps on a small MLP and on the digits CNN (random data of the right shape):

- ``sgd@T`` / ``kfac@T``: torch.set_num_threads(T), K-FAC with no thread cap;
- ``kfac@2 cap1``: torch at 2 threads, K-FAC's own phases (factor statistics in the hooks, factor
  updates, inversions, preconditioning) capped at 1 thread (``lightning_spdkfac.telemetry``'s cap, the
  library default).

Prints per-step medians (ms) with the spread (min-max) over repeats, and ratios against ``sgd@1`` and
``kfac@2 cap1``. Also times the thread switch the cap costs.

    python benchmarks/threads.py                 # prints; writes nothing
    python benchmarks/threads.py --out DIR       # also writes DIR/threads.json
    python benchmarks/threads.py --quick         # the mlp, 1 repeat of 2 steps (seconds)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from _common import (
    bench_parser,
    env_info,
    interleave,
    loadavg,
    mlp,
    parse,
    print_table,
    random_batches,
    save_json,
    spread,
)
from torch import nn

from lightning_spdkfac import KFACPreconditioner
from lightning_spdkfac.demo import DigitsCNN

VARIANTS = (("sgd@1", "sgd", 1, None), ("sgd@2", "sgd", 2, None), ("kfac@1", "kfac", 1, None),
            ("kfac@2", "kfac", 2, None), ("kfac@2 cap1", "kfac", 2, 1))


def make_model(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if name == "mlp":
        return (mlp(256, 256, 256, 10), *random_batches(g, 1, 128, 256)[0])
    model = DigitsCNN().net  # the demo's CNN: 2 convs, 2 linears
    x = torch.rand(64, 1, 8, 8, generator=g)
    return model, x, torch.randint(0, 10, (len(x),), generator=g)


def make_step(model_name: str, kind: str, cap: int | None, inv_every: int) -> Callable[[], None]:
    model, x, y = make_model(model_name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    pre = None
    if kind == "kfac":
        pre = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=inv_every, damping=0.01,
                                 lr=0.01)
        pre.timer.thread_cap = cap  # None: no cap (torch's threads)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        if pre is not None:
            pre.step()
        opt.step()

    return step


def switch_cost_us(n: int = 20000) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        torch.set_num_threads(before)
    return (time.perf_counter() - t0) / n * 1e6


def run(args: argparse.Namespace) -> dict:
    steps = {(m, label): make_step(m, kind, cap, args.inv_every)
             for m in args.models for label, kind, _, cap in VARIANTS}
    threads = {label: t for label, _, t, _ in VARIANTS}
    for (_, label), fn in steps.items():  # warm up every variant (allocations, first inverse)
        torch.set_num_threads(threads[label])
        for _ in range(args.inv_every):
            fn()
    loads = [loadavg(os.getloadavg())]
    proc: subprocess.Popen | None = None

    def block(busy: str, m: str, label: str, fn: Callable[[], None]) -> Callable[[], float]:
        def run_block() -> float:
            nonlocal proc
            if busy == "busy" and proc is None:
                proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # the background spinner
                time.sleep(0.3)  # let it take a core
            elif busy == "idle" and proc is not None:
                proc.kill()
                proc.wait()
                proc = None
            torch.set_num_threads(threads[label])
            t0 = time.perf_counter()
            for _ in range(args.steps):
                fn()
            return (time.perf_counter() - t0) / args.steps
        return run_block

    # every repeat: all variants with the spinner off, then all with it on (a fixed order)
    try:
        times = interleave({(m, busy, label): block(busy, m, label, fn) for busy in ("idle", "busy")
                            for (m, label), fn in steps.items()}, args.reps, order="fixed")
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
    loads.append(loadavg(os.getloadavg()))
    torch.set_num_threads(threads["kfac@2"])
    med = {k: spread(ts, 1e3) for k, ts in times.items()}
    rows = [{"model": m, "cpu": busy, "variant": label, "median_ms": s["median"], "min_ms": s["min"],
             "max_ms": s["max"], "vs_sgd1": s["median"] / med[(m, busy, "sgd@1")]["median"],
             "vs_cap1": s["median"] / med[(m, busy, "kfac@2 cap1")]["median"]} for (m, busy, label), s in med.items()]
    return {"rows": rows, "loads": loads, "switch_pair_us": switch_cost_us(), "env": env_info(),
            "args": {"repeats": args.reps, **vars(args)}}


def main(argv: list[str] | None = None) -> None:
    p = bench_parser(__doc__, out="folder for threads.json (default: print only)", reps=7,
                     reps_flags=("--repeats", "--reps"))
    p.add_argument("--models", nargs="+", default=["mlp", "cnn"], choices=["mlp", "cnn"])
    p.add_argument("--steps", type=int, default=10, help="steps per timed block")
    p.add_argument("--inv-every", type=int, default=10, help="K-FAC inv_update_steps (factors every step)")
    args = parse(p, argv, quick={"models": ["mlp"], "reps": 1, "steps": 2, "inv_every": 2})
    if os.cpu_count() is not None and len(os.sched_getaffinity(0)) < 2:
        sys.exit("needs at least 2 usable cores")
    result = run(args)
    print(f"load average (1, 5, 15 min) before and after: {result['loads']}")
    print(f"thread switch (set 1, restore): {result['switch_pair_us']:.2f} us")
    print_table(result["rows"], [
        ("model", "model", "s"), ("cpu", "cpu", "s"), ("variant", "variant", "s"),
        ("median_ms", "median ms", ".2f"), ("min_ms", "min", ".2f"), ("max_ms", "max", ".2f"),
        ("vs_sgd1", "/ sgd@1", ".2f"), ("vs_cap1", "/ kfac@2 cap1", ".2f")])
    if args.out:
        save_json(args.out, "threads.json", result)


if __name__ == "__main__":
    main()
