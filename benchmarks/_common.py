"""The benchmark harness: every script in benchmarks/ is its workloads, its configurations and its table.

This module owns what they share: the command line (:func:`bench_parser`, :func:`parse` with its ``--quick``
overrides), the torch thread setting (:func:`set_threads`), interleaved repetition (:func:`interleave`: runs of
several configurations alternated repeat by repeat, with progress lines; :func:`interleaved_blocks`), medians
and spread (:func:`spread`, :func:`summarize`), result folders (:func:`out_dir`, :func:`fresh_run_dir`: a new
``benchmarks/results/run-<stamp>-<name>/`` unless ``--out`` or ``--refresh`` says otherwise), JSON and PNG
output (:func:`save_json`, :func:`write_json`, :func:`pyplot`, :func:`save_png`), tables (:func:`print_table`,
:func:`format_table`) and progress lines (:class:`Progress`). Below them: layer shapes and FLOP accounting.

FLOP convention (one multiply-add = 2 FLOPs; a GEMM of (m x k) by (k x n) = 2*m*n*k):

* R, the rows of a layer: ``nn.Linear`` -> batch * leading dims of its input;
  ``nn.Conv2d`` -> batch * output locations (Ho * Wo); ``in`` = in_features (Conv2d: C_in*kh*kw),
  ``out`` = out_features (Conv2d: C_out); ``a = in + 1`` with a bias, else ``in``.
* baseline (SGD) per step, per layer: forward GEMM 2*R*in*out, grad-weight GEMM 2*R*in*out, and
  grad-input GEMM 2*R*in*out only when the layer input requires grad (autograd skips it for the
  first layer, whose input is data); plus R*out for the bias gradient. Activations, pooling,
  loss, zero_grad and the SGD update are elementwise and ignored (< 1 % here).
* K-FAC added per factor step, per layer: A = 2*R*in^2 (+ R*in for the bias row sums),
  G = 2*R*out^2, running averages 3 per factor element (a^2 + out^2), preconditioning
  G_inv @ M @ A_inv = 2*out^2*a + 2*out*a^2, KL clip 2*out*a; per inverse step: Cholesky n^3/3 +
  cholesky_inverse 2n^3/3 = n^3 per factor of side n. Factor terms are divided by
  factor_update_steps and inverse terms by inv_update_steps (amortized per optimizer step).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import torch
from torch import nn


def set_seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def env_info() -> dict:
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or "unknown",
        "cpu_model": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # the SIMD level torch's kernels use
    }


def cpu_model() -> str:
    """The CPU's model name (figures move across CPU vendors and generations: record which one)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# ------------------------------------------------------------------------------ workloads
def mlp(*widths: int, act: type[nn.Module] = nn.ReLU) -> nn.Sequential:
    """Linear layers through ``widths`` (``mlp(784, 256, 10)``), ``act`` between them, none after the last."""
    layers: list[nn.Module] = []
    for i in range(len(widths) - 1):
        layers += [act(), nn.Linear(widths[i], widths[i + 1])] if i else [nn.Linear(widths[0], widths[1])]
    return nn.Sequential(*layers)


def random_batches(g: torch.Generator, n: int, batch: int, *shape: int, classes: int = 10) -> list[tuple]:
    """``n`` batches of normal inputs ``(batch, *shape)`` and uniform labels, drawn from ``g`` in that order."""
    return [(torch.randn(batch, *shape, generator=g), torch.randint(0, classes, (batch,), generator=g))
            for _ in range(n)]


# ------------------------------------------------------------------------------ shapes
@dataclass
class LayerShape:
    name: str
    kind: str  # "Linear" or "Conv2d"
    rows: int  # R
    in_features: int  # in (Conv2d: C_in * kh * kw)
    out_features: int
    has_bias: bool
    input_requires_grad: bool  # False -> autograd computes no grad-input GEMM for this layer

    @property
    def a_dim(self) -> int:
        return self.in_features + int(self.has_bias)


def layer_shapes(model: nn.Module, example: torch.Tensor) -> list[LayerShape]:
    """Shapes and rows of every nn.Linear / nn.Conv2d as seen in one forward of ``example``."""
    shapes: list[LayerShape] = []
    handles = []

    def make_hook(name: str):
        def hook(module, inputs, output):
            x = inputs[0]
            if isinstance(module, nn.Linear):
                rows = x.numel() // x.shape[-1]
                n_in = module.in_features
                n_out = module.out_features
            else:
                rows = output.numel() // output.shape[-3]  # B * Ho * Wo (also unbatched)
                n_in = module.in_channels * module.kernel_size[0] * module.kernel_size[1]
                n_out = module.out_channels
            shapes.append(LayerShape(name, type(module).__name__, rows, n_in, n_out,
                                     module.bias is not None, bool(x.requires_grad)))

        return hook

    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            if isinstance(m, nn.Conv2d) and m.groups != 1:
                raise ValueError(f"{name}: grouped convolutions are not covered by the FLOP model")
            handles.append(m.register_forward_hook(make_hook(name)))
    was_training = model.training
    try:
        model.train()
        with torch.enable_grad():  # requires_grad of each layer input, as in a training step
            model(example)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return shapes


# ------------------------------------------------------------------------------ FLOPs
def gemm(m: int, n: int, k: int) -> int:
    return 2 * m * n * k


def baseline_flops(shapes: Sequence[LayerShape]) -> dict[str, int]:
    """FLOPs of forward + backward of the Linear/Conv2d layers (see the module docstring)."""
    fwd = sum(gemm(s.rows, s.out_features, s.in_features) for s in shapes)
    grad_w = fwd
    grad_in = sum(gemm(s.rows, s.in_features, s.out_features) for s in shapes if s.input_requires_grad)
    bias = sum(s.rows * s.out_features for s in shapes if s.has_bias)
    out = {"forward": fwd, "grad_weight": grad_w, "grad_input": grad_in, "grad_bias": bias}
    out["total"] = sum(out.values())
    return out


def kfac_added_flops(
    shapes: Sequence[LayerShape], inv_update_steps: int = 10, factor_update_steps: int = 1
) -> dict[str, float]:
    """FLOPs K-FAC adds per optimizer step (factor and inverse work amortized)."""
    a_f = g_f = avg = prec = kl = inv = 0.0
    for s in shapes:
        a, n_in, n_out, r = s.a_dim, s.in_features, s.out_features, s.rows
        a_f += gemm(n_in, n_in, r) + (r * n_in if s.has_bias else 0)
        g_f += gemm(n_out, n_out, r)
        avg += 3 * (a * a + n_out * n_out)
        prec += gemm(n_out, a, n_out) + gemm(n_out, a, a)
        kl += 2 * n_out * a
        inv += a**3 + n_out**3  # Cholesky n^3/3 + cholesky_inverse 2n^3/3 per factor
    out = {
        "A_factors": a_f / factor_update_steps,
        "G_factors": g_f / factor_update_steps,
        "running_avg": avg / factor_update_steps,
        "precondition": prec,
        "kl_clip": kl,
        "inverses": inv / inv_update_steps,
    }
    out["total"] = sum(out.values())
    return out


# ------------------------------------------------------------------------------ timing
K = TypeVar("K", bound=Hashable)


def interleave(configs: Mapping[K, Callable[[], float | None]], reps: int, order: str = "rotate",
               label: str = "repeat", progress: bool = True) -> dict[K, list[float]]:
    """Run every configuration once per repeat, alternated repeat by repeat; each one's values in repeat order.

    A configuration's call returns the value to record (seconds it measured itself), or None to record the
    wall seconds of the call. ``order``: ``"rotate"`` (repeat r starts at the r-th configuration, so that a
    slow spell of a shared machine does not always hit the same one), ``"alternate"`` (forwards, then
    backwards) or ``"fixed"``. A progress line per repeat goes to stderr unless ``progress`` is False.
    """
    keys = list(configs)
    out: dict[K, list[float]] = {k: [] for k in keys}
    bar = Progress(reps, label) if progress else None
    gc.collect()
    for rep in range(reps):
        if order == "rotate":
            turn = keys[rep % len(keys):] + keys[:rep % len(keys)]
        elif order == "alternate":
            turn = keys if rep % 2 == 0 else keys[::-1]
        else:
            turn = keys
        for k in turn:
            t0 = time.perf_counter()
            value = configs[k]()
            out[k].append(time.perf_counter() - t0 if value is None else value)
        if bar is not None:
            bar.tick()
    return out


def interleaved_blocks(
    steps: dict[str, Callable[[], None]], blocks: int, steps_per_block: int, progress: bool = False
) -> dict[str, list[float]]:
    """Alternate the step functions block by block (a fixed order); returns per-step seconds of each block.

    One block is ``steps_per_block`` consecutive calls timed as a whole, so periodic work
    (an inverse every ``steps_per_block`` steps) is amortized inside every block.
    """

    def block(fn: Callable[[], None]) -> Callable[[], float]:
        def run() -> float:
            t0 = time.perf_counter()
            for _ in range(steps_per_block):
                fn()
            return (time.perf_counter() - t0) / steps_per_block

        return run

    return interleave({k: block(fn) for k, fn in steps.items()}, blocks, "fixed", "block", progress)


def spread(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """Median, min, max, quartiles (inclusive method) and count of ``values``, each times ``scale``."""
    xs = [scale * v for v in values]
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) >= 2 else [xs[0]] * 3
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "q1": q[0], "q3": q[2], "n": len(xs)}


def summarize(per_step: Sequence[float]) -> dict[str, float]:
    """Median and spread of per-step times (seconds), plus a drift check (last third / first third)."""
    s, third = spread(per_step), max(1, len(per_step) // 3)
    drift = statistics.median(per_step[-third:]) / statistics.median(per_step[:third])
    return {"median_s": s["median"], "q1_s": s["q1"], "q3_s": s["q3"], "min_s": s["min"], "drift": drift,
            "n_blocks": s["n"]}


class PhaseTimer:
    """Accumulates wall time per named phase; ``wrap`` instruments a bound method or function."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        self.totals[name] = self.totals.get(name, 0.0) + seconds

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - t0)

        return timed


# ------------------------------------------------------------------------------ output
def print_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]], title: str | None = None) -> None:
    """Print :func:`format_table` of ``rows``, after ``title`` if given."""
    if title:
        print(title)
    print(format_table(rows, columns), flush=True)


def format_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """columns: (key, header, format spec). Right-aligned text table."""
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        cells.append([format(r[k], f) if r.get(k) is not None else "-" for k, _, f in columns])
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
DOCS = os.path.join(REPO, "docs")  # the figures the README and docs/ show


def fresh_run_dir(tag: str) -> str:
    """A new folder ``benchmarks/results/run-<date>-<time>-<tag>/`` (suffixed if taken), created now.

    The default destination of every benchmark's files: a run never overwrites committed results
    unless told to (``--refresh`` or an explicit path).
    """
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = os.path.join(RESULTS, f"run-{stamp}-{tag}")
    path, n = base, 1
    while True:
        try:
            os.makedirs(path)
            return path
        except FileExistsError:
            n += 1
            path = f"{base}-{n}"


def write_json(path: str, payload: dict, indent: int = 2) -> None:
    def default(o):
        if hasattr(o, "__dataclass_fields__"):
            return asdict(o)
        raise TypeError(f"not JSON serializable: {type(o).__name__}")

    with open(path, "w") as f:
        json.dump(payload, f, indent=indent, default=default)
        f.write("\n")


def save_json(folder: str | os.PathLike, name: str, payload: dict, indent: int = 2) -> str:
    """Write ``payload`` to ``folder/name`` (folder created), say so, return the path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    write_json(path, payload, indent)
    print(f"wrote {path}", flush=True)
    return path


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig: Any, path: str | os.PathLike, dpi: int = 110) -> str:
    """Save a matplotlib figure as PNG (folder created), close it, return the path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return str(path)


# ------------------------------------------------------------------------------ command line, threads, progress
_UNSET: Any = object()


def bench_parser(doc: str | None, *, quick: str | None = "the smallest meaningful run (seconds; CI runs it)",
                 out: str | None = "folder for the results (default: a fresh benchmarks/results/run-*/)",
                 threads: int | None = _UNSET, reps: int = _UNSET, reps_flags: Sequence[str] = ("--reps",),
                 seed: int = _UNSET, refresh: str | None = None) -> argparse.ArgumentParser:
    """The benchmarks' common argparse base: ``--quick``, ``--out``, ``--threads``, ``--reps``, ``--seed``,
    ``--refresh``, each only where given (a help text, or a default). ``doc``: the module docstring (shown
    whole by ``--help``). ``reps_flags``: the spellings of the repeat count (``dest`` is always ``reps``)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if quick:
        p.add_argument("--quick", action="store_true", help=quick)
    if out:
        p.add_argument("--out", default=None, help=out)
    if threads is not _UNSET:
        p.add_argument("--threads", type=int, default=threads,
                       help=f"torch.set_num_threads (default: {threads or 'torch' + chr(39) + 's'})")
    if reps is not _UNSET:
        p.add_argument(*reps_flags, dest="reps", type=int, default=reps, help=f"interleaved repeats (default {reps})")
    if seed is not _UNSET:
        p.add_argument("--seed", type=int, default=seed, help=f"random seed (default {seed})")
    if refresh:
        p.add_argument("--refresh", action="store_true", help=refresh)
    return p


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None = None, quick: Mapping[str, Any] | None = None,
          ) -> argparse.Namespace:
    """Parse; with ``--quick``, every option named in ``quick`` that the command line left at its default
    takes the quick value (what is given explicitly wins)."""
    args = p.parse_args(argv)
    if getattr(args, "quick", False) and quick:
        for k, v in quick.items():
            if getattr(args, k) == p.get_default(k):
                setattr(args, k, v)
    return args


def set_threads(n: int | None) -> int:
    """torch.set_num_threads(n) unless n is None; the thread count now in force."""
    if n is not None:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def out_dir(args: argparse.Namespace, name: str, committed: str | os.PathLike | None = None,
            empty: bool = False) -> str:
    """Where a run writes: ``--out`` (created), else the committed folder under ``--refresh``, else a fresh
    ``benchmarks/results/run-<stamp>-<name>/``. ``empty``: a ``--out`` that holds files is refused (the run
    appends to what it writes there, so it never mixes with an earlier run's)."""
    if getattr(args, "out", None):
        if empty and os.path.isdir(args.out) and os.listdir(args.out):
            raise SystemExit(f"--out {args.out} exists and is not empty: results are never overwritten, give a new folder")
        os.makedirs(args.out, exist_ok=True)
        return str(args.out)
    if committed is not None and getattr(args, "refresh", False):
        return str(committed)
    return fresh_run_dir(name)


class Progress:
    """Progress lines for long runs, on stderr: ``label i/n, elapsed s, about s left``."""

    def __init__(self, total: int, label: str = "step") -> None:
        self.total, self.label, self.done, self.t0 = total, label, 0, time.perf_counter()

    def tick(self, note: str = "") -> None:
        self.done += 1
        el = time.perf_counter() - self.t0
        left = el / self.done * (self.total - self.done)
        print(f"{self.label} {self.done}/{self.total} done, {el:.0f} s, about {left:.0f} s left"
              + (f"; {note}" if note else ""), file=sys.stderr, flush=True)


# ---- shared by iteration_time and soak
def output_paths(args: argparse.Namespace, name: str, committed: str | os.PathLike, **files: str) -> None:
    """Set each option of ``files`` (option -> file name) that the command line left None to that file in
    :func:`out_dir`; the folder is chosen (and a fresh one made) only when one is needed."""
    missing = [k for k in files if getattr(args, k) is None]
    if missing:
        folder = out_dir(args, name, committed)
        for k in missing:
            setattr(args, k, os.path.join(folder, files[k]))


def check_positive(p: argparse.ArgumentParser, args: argparse.Namespace, *names: str, least: int = 1) -> None:
    """``p.error`` unless each option in ``names`` is at least ``least``."""
    for k in names:
        if getattr(args, k) < least:
            p.error(f"--{k.replace('_', '-')} must be >= {least}")


def run_gloo(worker: Callable, args: argparse.Namespace, cfg: dict, pg_timeout: float, note: str = ""
             ) -> tuple[list | None, dict]:
    """``worker(rank, world, cfg)`` on ``args.world_size`` gloo ranks of ``args.threads`` threads, bounded by
    ``args.timeout``: (the ranks' results, or None after printing why they failed; the environment, with load
    averages before and after and the wall time). A start line names the setup, ``note`` in it."""
    from lightning_spdkfac.multiprocess import RanksFailed, run_distributed

    env = env_info()
    env.update(world_size=args.world_size, threads_per_rank=args.threads, backend="gloo",
               loadavg_before=os.getloadavg())
    print(f"torch {env['torch']}  cpus {env['cpu_count']}  {args.world_size} gloo ranks x {args.threads} "
          f"thread(s)  {note}load average before {loadavg(env['loadavg_before'])}", flush=True)
    t0 = time.perf_counter()
    try:
        results = run_distributed(worker, args.world_size, cfg, timeout=args.timeout,
                                  pg_timeout=min(args.timeout, pg_timeout), threads=args.threads)
    except RanksFailed as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return None, env
    env["wall_s"] = time.perf_counter() - t0
    env["loadavg_after"] = os.getloadavg()
    return results, env


def loadavg(values: Sequence[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values)
