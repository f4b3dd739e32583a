"""K-FAC step overhead versus SGD, against the FLOP floor.

Run ``python benchmarks/overhead.py`` (``--help`` for options; ``make bench`` runs it with ``--blocks 40``).
For each model (the MLP 784-256-256-10 and a digits-style CNN) it times an SGD step (momentum 0.9, lr 0.01:
at 0.1 K-FAC diverges on this random data) and the same step with ``KFACPreconditioner.step()`` added
(factor_update_steps=1, inv_update_steps=10, library defaults otherwise), on identical copies of the model and
the same fixed-seed random batches (``--n-batches``, cycled). The final losses and a count of subnormal
values are checked. After warm-up steps the two alternate in blocks of ``inv_update_steps`` steps, each
timed as a whole, so every K-FAC block holds exactly one inverse step (amortized, not dropped by the
median). Reported: the median per-step time of each and the ratio of the medians.

FLOP floor: ``(baseline + kfac_added) / baseline`` (the FLOP conventions of ``_common.py``), with the
baseline 3 x the forward GEMMs: the stricter choice, since autograd skips the first layer's grad-input GEMM
(the exact-autograd variant is printed too). Efficiency = floor ratio / measured ratio (1.0: K-FAC's extra
FLOPs run at the SGD step's rate). The recorded runs: docs/results/single-process.md.

``--breakdown-blocks N`` (default 10) adds a separate instrumented pass that splits the K-FAC step into
phases (time, FLOPs, rate, time beyond its FLOPs at the SGD step's rate); it does not affect the main
figures. ``--profile N`` prints the torch.profiler operator table of N K-FAC blocks. ``--quick``: the MLP,
2 blocks of 2 steps, batch 8.
"""

from __future__ import annotations

import copy
import math
import sys
import warnings

import torch
import torch.nn.functional as F
from _common import (
    PhaseTimer,
    baseline_flops,
    bench_parser,
    env_info,
    format_table,
    interleaved_blocks,
    kfac_added_flops,
    layer_shapes,
    mlp,
    parse,
    print_table,
    random_batches,
    save_json,
    set_seed,
    set_threads,
    summarize,
    write_json,
)
from torch import nn

from lightning_spdkfac import KFACPreconditioner

MODELS = ("mlp", "cnn")


# ------------------------------------------------------------------------------ models
def make_cnn() -> nn.Module:
    """The digits-style CNN (8x8 single-channel inputs)."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 4 * 4, 128), nn.ReLU(),
        nn.Linear(128, 10),
    )


def make_model_and_data(name: str, batch: int, n_batches: int, seed: int):
    set_seed(seed)
    if name == "mlp":
        model, shape = mlp(784, 256, 256, 10), (784,)
    elif name == "cnn":
        model, shape = make_cnn(), (1, 8, 8)
    else:
        raise ValueError(f"unknown model {name!r}; choose from {MODELS}")
    return model, random_batches(torch.Generator().manual_seed(seed + 1), n_batches, batch, *shape)


# ------------------------------------------------------------------------------ runners
class Runner:
    """One model copy + optimizer (+ optional K-FAC) stepping through the fixed data."""

    def __init__(self, model: nn.Module, data, args, kfac: bool, **kfac_options):
        self.model = model.train()
        self.data = data
        self.i = 0
        self.opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        # On a GPU every step ends with a synchronize, so that a block's wall time is its kernels' time.
        self.sync = args.device.startswith("cuda")
        self.pre = None
        if kfac:  # kfac_options: further KFACOptions fields (benchmarks/factor_approx.py: factor_approx)
            options = {"factor_update_steps": 1, "inv_update_steps": args.inv_update_steps, **kfac_options}
            self.pre = KFACPreconditioner(model, **options)
        self.last_loss: torch.Tensor | None = None

    def step(self) -> None:
        x, y = self.data[self.i % len(self.data)]
        self.i += 1
        self.opt.zero_grad()
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        if self.pre is not None:
            self.pre.step(self.opt)
        self.opt.step()
        self.last_loss = loss.detach()
        if self.sync:
            torch.cuda.synchronize()

    def instrumented_step(self, t: PhaseTimer) -> None:
        """Same as step(), with the phases outside the library timed into ``t``."""
        x, y = self.data[self.i % len(self.data)]
        self.i += 1
        t.wrap("zero_grad", self.opt.zero_grad)()
        loss = t.wrap("forward", lambda: F.cross_entropy(self.model(x), y))()
        t.wrap("backward", loss.backward)()
        t.wrap("pre.step", self.pre.step if self.pre is not None else lambda opt: None)(self.opt)
        t.wrap("opt.step", self.opt.step)()
        self.last_loss = loss.detach()


PRE_METHODS = ("_accumulate_a", "_accumulate_g", "_update_factors", "_all_finite",
               "_update_inverses", "_precondition")
LAYER_METHODS = ("update_factors",)
HELPER_METHODS = ("grad_matrix", "write_grad")


def instrument(pre: KFACPreconditioner, t: PhaseTimer) -> set[str]:
    """Time the library's phases by wrapping instance attributes (the library is not modified).

    Returns the names that could be wrapped; a method the library no longer has is skipped and
    the phases built on it are reported as unavailable.
    """
    done = set()
    for name in PRE_METHODS:
        if callable(getattr(pre, name, None)):
            setattr(pre, name, t.wrap(name, getattr(pre, name)))
            done.add(name)
    layers = list(pre.layers.values())
    for objs, names in ((layers, LAYER_METHODS), ([layer.helper for layer in layers], HELPER_METHODS)):
        for name in names:
            if objs and all(callable(getattr(o, name, None)) for o in objs):
                for o in objs:
                    setattr(o, name, t.wrap(name, getattr(o, name)))
                done.add(name)
    return done


# ------------------------------------------------------------------------------ one model
def bench_model(name: str, args) -> dict:
    base_model, data = make_model_and_data(name, args.batch, args.n_batches, args.seed)
    base_model = base_model.to(args.device)
    data = [(x.to(args.device), y.to(args.device)) for x, y in data]
    shapes = layer_shapes(base_model, data[0][0])
    sgd = Runner(copy.deepcopy(base_model), data, args, kfac=False)
    kfac = Runner(copy.deepcopy(base_model), data, args, kfac=True)
    k = args.inv_update_steps

    for _ in range(args.warmup):
        sgd.step()
        kfac.step()
    times = interleaved_blocks({"sgd": sgd.step, "kfac": kfac.step}, args.blocks, k)

    base = baseline_flops(shapes)
    added = kfac_added_flops(shapes, inv_update_steps=k, factor_update_steps=1)
    s_sgd, s_kfac = summarize(times["sgd"]), summarize(times["kfac"])
    measured = s_kfac["median_s"] / s_sgd["median_s"]
    # Headline floor: baseline 3 x the forward GEMMs (the stricter count: see the module docstring).
    fwd3 = 3 * base["forward"]
    floor = (fwd3 + added["total"]) / fwd3
    floor_autograd = (base["total"] + added["total"]) / base["total"]
    result = {
        "model": name, "batch": args.batch, "layers": shapes, "sgd": s_sgd, "kfac": s_kfac,
        "sgd_ms": 1e3 * s_sgd["median_s"], "kfac_ms": 1e3 * s_kfac["median_s"], "measured_ratio": measured,
        "floor_ratio": floor, "efficiency": floor / measured, "floor_ratio_autograd": floor_autograd,
        "efficiency_autograd": floor_autograd / measured, "baseline_flops": base, "kfac_added_flops": added,
        "baseline_gflop": base["total"] / 1e9, "added_gflop": added["total"] / 1e9,
        "sgd_gflops_rate": base["total"] / s_sgd["median_s"] / 1e9, "per_block_s": times,
    }
    if args.breakdown_blocks > 0:
        result["breakdown"] = breakdown(sgd, kfac, base, added, args)
    if args.profile > 0:
        result["_profile_table"] = profile(kfac, args.profile * k)
    for label, r in (("sgd", sgd), ("kfac", kfac)):
        loss = float(r.last_loss)
        result[f"{label}_final_loss"] = loss
        if not math.isfinite(loss):
            warnings.warn(f"{name}/{label}: non-finite loss; timings are not representative", stacklevel=1)
    sub = count_subnormal(sgd, kfac)
    result["subnormal_values"] = sub
    if sub:
        warnings.warn(f"{name}: {sub} subnormal values in parameters/gradients/factors; CPU timings "
                      "may be distorted", stacklevel=1)
    skipped = kfac.pre.skipped_factor_steps
    result["kfac_skipped_factor_steps"] = skipped
    if skipped:
        warnings.warn(f"{name}: K-FAC skipped {skipped} factor updates (non-finite values)", stacklevel=1)
    kfac.pre.remove_hooks()
    return result


def count_subnormal(*runners: Runner) -> int:
    """Nonzero values below the smallest normal float (slow paths on CPUs) in the final state."""
    ts = []
    for r in runners:
        ts += [p for p in r.model.parameters()] + [p.grad for p in r.model.parameters() if p.grad is not None]
        ts += [b for st in r.opt.state.values() for b in st.values() if isinstance(b, torch.Tensor)]
        if r.pre is not None:
            for layer in r.pre.layers.values():
                ts += [t for t in (layer.A, layer.G, layer.A_inv, layer.G_inv) if t is not None]
    n = 0
    for t in ts:
        if t.is_floating_point():
            a = t.detach().abs()
            n += int(((a > 0) & (a < torch.finfo(t.dtype).tiny)).sum())
    return n


def breakdown(sgd: Runner, kfac: Runner, base: dict, added: dict, args) -> dict:
    """Per-phase ms/step of instrumented runs (interleaved blocks), with FLOPs and excess time.

    "beyond floor" = phase time - phase FLOPs / (rate of the whole SGD step); the column sums to
    K-FAC time - floor ratio x SGD time, so it says where the efficiency gap comes from. GEMM-heavy
    phases run faster than the SGD step's average rate and come out negative.
    """
    k = args.inv_update_steps
    ts, tk = PhaseTimer(), PhaseTimer()
    have = instrument(kfac.pre, tk) | {"zero_grad", "forward", "backward", "pre.step", "opt.step"}
    steps = 0
    for _ in range(args.breakdown_blocks):
        for _ in range(k):
            sgd.instrumented_step(ts)
        for _ in range(k):
            kfac.instrumented_step(tk)
        steps += k
    S = {n: 1e3 * v / steps for n, v in ts.totals.items()}  # ms per step
    K = {n: 1e3 * v / steps for n, v in tk.totals.items()}

    def ms(plus: tuple[str, ...], minus: tuple[str, ...] = ()) -> float | None:
        if not all(n in have for n in plus + minus):
            return None
        return sum(K.get(n, 0.0) for n in plus) - sum(K.get(n, 0.0) for n in minus)

    phases = [  # (phase, ms/step, FLOPs/step or None, SGD counterpart)
        ("zero_grad", ms(("zero_grad",)), None, "zero_grad"),
        ("forward (w/o A stats)", ms(("forward",), ("_accumulate_a",)), base["forward"], "forward"),
        ("  A stats (hook: rows + x^T x)", ms(("_accumulate_a",)), added["A_factors"], None),
        ("backward (w/o G stats)", ms(("backward",), ("_accumulate_g",)), base["total"] - base["forward"],
         "backward"),
        ("  G stats (hook: rows + d^T d)", ms(("_accumulate_g",)), added["G_factors"], None),
        ("step: finite check", ms(("_all_finite",)), None, None),
        ("step: running averages", ms(("update_factors",)), added["running_avg"], None),
        ("step: factor bookkeeping",
         ms(("_update_factors",), ("update_factors", "_all_finite")), None, None),
        ("step: inverses (amortized)", ms(("_update_inverses",)), added["inverses"], None),
        ("step: grad_matrix (cat)", ms(("grad_matrix",)), None, None),
        ("step: precondition matmuls + KL", ms(("_precondition",), ("grad_matrix", "write_grad")),
         added["precondition"] + added["kl_clip"], None),
        ("step: write_grad (scaled copy)", ms(("write_grad",)), None, None),
        ("step: other (reset, bookkeeping)",
         ms(("pre.step",), ("_update_factors", "_update_inverses", "_precondition")), None, None),
        ("opt.step", ms(("opt.step",)), None, "opt.step"),
    ]
    sgd_total = sum(S.values())
    kfac_total = sum(K[n] for n in ("zero_grad", "forward", "backward", "pre.step", "opt.step"))
    rate = base["total"] / (sgd_total / 1e3)  # FLOP/s the SGD step achieves end to end
    rows = [{
        "phase": phase, "ms": t_ms, "sgd_ms": None if sgd_name is None else S.get(sgd_name),
        "gflop": None if flops is None else flops / 1e9,
        "gflops_rate": None if not flops or t_ms is None or t_ms <= 0 else flops / (t_ms / 1e3) / 1e9,
        "excess_ms": None if t_ms is None else t_ms - (0.0 if flops is None else 1e3 * flops / rate),
    } for phase, t_ms, flops, sgd_name in phases]
    total_flops = base["total"] + added["total"]
    rows.append({
        "phase": "total", "ms": kfac_total, "sgd_ms": sgd_total, "gflop": total_flops / 1e9,
        "gflops_rate": total_flops / (kfac_total / 1e3) / 1e9,
        "excess_ms": kfac_total - 1e3 * total_flops / rate,
    })
    return {"steps": steps, "kfac_total_ms": kfac_total, "sgd_total_ms": sgd_total, "sgd_phases_ms": S,
            "sgd_rate_gflops": rate / 1e9, "instrumented": sorted(have), "phases": rows}


def profile(kfac: Runner, steps: int) -> str:
    """torch.profiler operator table (sorted by self CPU time) of ``steps`` K-FAC steps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    with tprofile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            kfac.step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    return f"{steps} K-FAC steps, self CPU time:\n{table}"


# ------------------------------------------------------------------------------ main
def parse_args(argv=None):
    p = bench_parser(__doc__.split("\n\n")[0], threads=None, seed=0,
                     out="folder for overhead.json (default: print only, or --json)")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ",".join(MODELS))
    p.add_argument("--blocks", type=int, default=30, help="timed blocks per optimizer (each inv-update-steps steps)")
    p.add_argument("--warmup", type=int, default=50, help="warm-up steps per optimizer (rounded up to a block)")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--n-batches", type=int, default=32, help="distinct random batches, cycled")
    p.add_argument("--inv-update-steps", type=int, default=10, help="K-FAC inverse period = block length")
    p.add_argument("--lr", type=float, default=0.01,
                   help="SGD learning rate (momentum 0.9); K-FAC diverges on this random data at 0.1")
    p.add_argument("--device", default="cpu",
                   help="where the models train (cuda: every step ends with torch.cuda.synchronize; the "
                   "host-timed --breakdown-blocks and --profile are off there)")
    p.add_argument("--breakdown-blocks", type=int, default=10,
                   help="instrumented blocks for the per-phase K-FAC breakdown (0: off)")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="torch.profiler over N K-FAC blocks")
    p.add_argument("--json", metavar="OUT", default=None, help="write the results as JSON")
    args = parse(p, argv, quick={"models": "mlp", "blocks": 2, "warmup": 0, "batch": 8, "n_batches": 2,
                                 "inv_update_steps": 2, "breakdown_blocks": 1})
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    if args.device.startswith("cuda"):
        args.breakdown_blocks = args.profile = 0  # host clocks around asynchronous kernels: not phase times
    bad = [m for m in args.models if m not in MODELS]
    if bad or not args.models:
        p.error(f"--models: unknown {bad}; choose from {', '.join(MODELS)}")
    if args.blocks < 1 or args.inv_update_steps < 1 or args.warmup < 0:
        p.error("--blocks and --inv-update-steps must be >= 1, --warmup >= 0")
    k = args.inv_update_steps
    args.warmup = -(-args.warmup // k) * k  # whole blocks: inverse steps land at block starts
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    env = env_info()
    results = [bench_model(m, args) for m in args.models]

    if args.device.startswith("cuda"):
        env["device"] = torch.cuda.get_device_name(torch.device(args.device))
        print(f"device {args.device}: {env['device']}")
    print(f"{env['cpu_model']} ({env['cpu_capability']})  torch {env['torch']}  threads {env['threads']}  "
          f"cpus {env['cpu_count']}  "
          f"blocks {args.blocks} x {args.inv_update_steps} steps per optimizer (interleaved)  "
          f"warm-up {args.warmup} steps  batch {args.batch}")
    print_table(results, [
        ("model", "model", "s"), ("sgd_ms", "SGD ms/step", ".3f"), ("kfac_ms", "K-FAC ms/step", ".3f"),
        ("measured_ratio", "measured", ".2f"), ("floor_ratio", "FLOP floor", ".2f"),
        ("efficiency", "efficiency", ".2f"), ("baseline_gflop", "SGD GFLOP", ".4f"),
        ("added_gflop", "K-FAC +GFLOP", ".4f"), ("sgd_gflops_rate", "SGD GFLOP/s", ".1f"),
    ])
    print("(medians of per-step block times; measured = K-FAC/SGD; efficiency = floor/measured, "
          "target >= 0.85)")
    noisy = [r["model"] for r in results
             if any((r[o]["q3_s"] - r[o]["q1_s"]) > 0.1 * r[o]["median_s"] for o in ("sgd", "kfac"))]
    if noisy:
        print(f"WARNING: noisy timings for {', '.join(noisy)} (IQR > 10% of the median): "
              "is the machine busy? Use more --blocks or a quiet machine.")
    for r in results:
        s, kf = r["sgd"], r["kfac"]
        print(f"  {r['model']}: SGD IQR {1e3 * s['q1_s']:.3f}-{1e3 * s['q3_s']:.3f} ms, "
              f"K-FAC IQR {1e3 * kf['q1_s']:.3f}-{1e3 * kf['q3_s']:.3f} ms, "
              f"drift last/first third {s['drift']:.2f} / {kf['drift']:.2f}; "
              f"floor / efficiency with the exact autograd baseline (no first-layer grad-input) "
              f"{r['floor_ratio_autograd']:.2f} / {r['efficiency_autograd']:.2f}; "
              f"final loss {r['sgd_final_loss']:.3f} / {r['kfac_final_loss']:.3f}")
        fl = r["kfac_added_flops"]
        print("    K-FAC +MFLOP/step: " + ", ".join(f"{n} {v / 1e6:.1f}" for n, v in fl.items()))
    for r in results:
        b = r.get("breakdown")
        if not b:
            continue
        print(f"\n== K-FAC step breakdown: {r['model']} ({b['steps']} instrumented steps; "
              f"K-FAC {b['kfac_total_ms']:.3f} ms/step, SGD {b['sgd_total_ms']:.3f} ms/step at "
              f"{b['sgd_rate_gflops']:.1f} GFLOP/s) ==")
        print(format_table(b["phases"], [
            ("phase", "phase", "s"), ("ms", "ms/step", ".3f"), ("sgd_ms", "SGD ms/step", ".3f"),
            ("gflop", "GFLOP", ".4f"), ("gflops_rate", "GFLOP/s", ".1f"),
            ("excess_ms", "beyond floor ms", ".3f"),
        ]))
        print("(beyond floor = phase time - phase FLOPs at the SGD step's GFLOP/s; sums to K-FAC time - "
              "floor x SGD time; '-' = not instrumented)")
    for r in results:
        table = r.pop("_profile_table", None)
        if table:
            print(f"\n== torch.profiler: {r['model']}, {table}")
    payload = {"env": env, "args": vars(args), "results": results}
    if args.json:
        write_json(args.json, payload)
        print(f"\nwrote {args.json}")
    if args.out:
        save_json(args.out, "overhead.json", payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
