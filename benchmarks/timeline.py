"""Timeline of one SPD-KFAC training iteration on 2 ranks, drawn from real PyTorch profiler traces.

Run ``PYTHONPATH=. python benchmarks/timeline.py`` from the repository root (``--help`` for options; about a
minute on 2 cores: 3 independent runs of ~20 s, the least disturbed one is drawn; ``--refresh`` rewrites the
committed docs/timeline.{json,png}). It trains the small ResNet of ``benchmarks/iteration_time.py`` (synthetic
CIFAR-shaped data, 32 images per rank, SGD lr 0.01 momentum 0.9, K-FAC damping 0.03) for 13 steps with the
Lightning ``Trainer`` on ``--world-size`` gloo processes (one torch thread each), strategy
``SPDKFACStrategy(schedule="spd", profile_steps=(2, 5))`` and callback ``KFAC(factor_update_steps=1,
inv_update_steps=4, trace_step=12)``: step 12 comes after the SPD profiling window (the fusion plan is fixed,
factor all-reduces are pipelined) and updates the inverses. The callback writes one Chrome trace per rank of
that step; this script extracts the intervals, writes ``timeline.json``, draws ``timeline.png`` (per rank the
main thread coloured by what it does, and the gloo worker threads of the K-FAC and DDP process groups with
their collectives) and prints, per rank, the milliseconds of each category beside the library's own
``StepTimer`` numbers of the same step. ``--trace-dir`` keeps the traces (open them in Perfetto);
``--analyse-only`` redraws from kept traces.

Where the intervals come from (the categories below, also in the JSON; the ranks share the host's clock, 0 is
the earliest rank's start of the step). Under Lightning the optimizer closure (forward, backward, the K-FAC
step in ``on_before_optimizer_step``) runs inside ``Optimizer.step#SGD.step``, the step's range. Backward
after the last ``autograd::engine::evaluate_function`` event is DDP's reducer waiting for its gradient
all-reduces. ``kfac/factor_comm_wait`` also holds the unpacking of the reduced triangles, so it is split with
the library's per-group stamps (``FusedAllReduce.last_timings``: ``wait_start`` to ``work_end`` is blocked
on the all-reduce), put on the trace's clock with ``timeline/clock`` ranges recorded between two
``time.perf_counter`` reads. The ``timeline/*`` ranges are this script's, opened around library calls only
while the profiler records: ``factor_handover`` around ``SPDDistributor.factor_final``, ``inverse_publish``
around ``InverseBroadcaster.publish`` / ``expect`` and ``inverse_wait`` around ``InverseBroadcaster.wait``
(the library times these with ``StepTimer.add`` only), and a ``kfac_step_end`` marker after the ``KFAC``
callback's hook.

Communication: ``gloo:all_reduce`` / ``gloo:broadcast`` events on gloo's worker threads, from the start of a
collective to its completion (waiting for the peer included); the threads are told apart by process group by
listing this process's ``pt_gloo_runloop`` threads before and after the strategy creates the K-FAC group.
The launch is the ``c10d::allreduce_`` / ``c10d::broadcast_`` op on the main thread (the K-FAC all-reduces
found by the library's launch stamps, the others are DDP's), matched to the k-th collective its group's
workers start; launch to start is drawn thin and pale (queued). A collective shorter than a pixel is drawn
one pixel wide (the JSON has the real times). Main-thread time in none of these is "other" (Lightning hooks,
``zero_grad``, bookkeeping). Times include the profiler's overhead and whatever else runs on the machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import asdict

import torch
from _common import DOCS, bench_parser, out_dir, parse, pyplot, save_json, save_png
from torch.profiler import record_function

MAIN_CATEGORIES = {  # key: (legend label, colour, where its intervals come from), main thread, in legend order
    "forward": ("forward", "#4c72b0", "DistributedDataParallel.forward range"),
    "backward": ("backward", "#9ab8e0", "timeline/backward range (script's LightningModule.backward)"),
    "ddp_wait": ("wait: DDP gradient all-reduce (end of backward)", "#5f6f82",
                 "timeline/backward after the last autograd::engine::evaluate_function event"),
    "factor_compute": ("K-FAC factors (hooks)", "#dd8452", "kfac/factor_compute ranges"),
    "handover": ("pack + launch a K-FAC collective", "#f5c89a",
                 "timeline/factor_handover and timeline/inverse_publish ranges (script, around library calls)"),
    "factor_wait": ("wait: factor all-reduce", "#c44e52",
                    "FusedAllReduce.last_timings wait_start..work_end (library stamps on the trace clock)"),
    "factor_unpack": ("factor unpack + average", "#e8a0a0", "kfac/factor_comm_wait ranges minus factor_wait"),
    "factor_update": ("factor running averages", "#ccb974", "kfac/factor_update ranges"),
    "inverse_compute": ("inversion", "#55a868", "kfac/inverse_compute ranges"),
    "inverse_wait": ("wait: inverse broadcast (+ unpack)", "#8172b3",
                     "timeline/inverse_wait (script, around InverseBroadcaster.wait) and kfac/inverse_comm_wait"),
    "precondition": ("preconditioning", "#937860", "kfac/precondition ranges"),
    "optimizer": ("optimizer step (SGD)", "#da8bc3",
                  "timeline/kfac_step_end marker to the end of Optimizer.step#SGD.step"),
    "other": ("other (Lightning, zero_grad, bookkeeping)", "#e3e3e3",
              "Optimizer.step#SGD.step time in none of the above"),
}
COMM_CATEGORIES = {  # kind: (legend label, colour, source)
    "factor_allreduce": ("factor all-reduce on a gloo thread", "#c44e52",
                         "c10d::allreduce_ launch on the main thread, gloo:all_reduce on a K-FAC group gloo thread"),
    "inverse_broadcast": ("inverse broadcast on a gloo thread", "#8172b3",
                          "c10d::broadcast_ launch on the main thread, gloo:broadcast on a K-FAC group gloo thread"),
    "ddp_allreduce": ("DDP gradient all-reduce on a gloo thread", "#7f7f7f",
                      "c10d::allreduce_ launch on the main thread, gloo:all_reduce on a default group gloo thread"),
}
RANGE_CATEGORY = {
    "timeline/backward": "backward",
    "kfac/factor_compute": "factor_compute",
    "timeline/factor_handover": "handover",
    "timeline/inverse_publish": "handover",
    "kfac/factor_comm_wait": "factor_unpack",  # waits inside it come from the library's stamps
    "kfac/factor_update": "factor_update",
    "kfac/inverse_compute": "inverse_compute",
    "kfac/inverse_comm_wait": "inverse_wait",
    "timeline/inverse_wait": "inverse_wait",
    "kfac/precondition": "precondition",
}
MODEL_NAME = "SmallResNet (benchmarks/iteration_time.py)"


# ------------------------------------------------------------------------------ the ranks
def _gloo_threads() -> set[int]:
    """Native ids of this process's gloo worker threads (ProcessGroupGloo names them pt_gloo_runloop)."""
    out = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == "pt_gloo_runloop":
                    out.add(int(tid))
        except OSError:
            pass
    return out


def _clock_marks(n: int = 5) -> list[tuple[int, int]]:
    """``timeline/clock`` ranges, each between two perf_counter_ns reads: maps library stamps on the trace."""
    marks = []
    for _ in range(n):
        a = time.perf_counter_ns()
        with record_function("timeline/clock"):
            pass
        marks.append((a, time.perf_counter_ns()))
    return marks


def _instrument() -> None:
    """Ranges around two library calls that have none (only while a profiler records)."""
    from lightning_spdkfac.comm.broadcast import InverseBroadcaster
    from lightning_spdkfac.comm.scheduler import SPDDistributor

    def wrap(cls, method: str, name: str) -> None:
        orig = getattr(cls, method)

        def wrapped(self, *args, **kwargs):
            if not torch._C._autograd._profiler_enabled():
                return orig(self, *args, **kwargs)
            with record_function(name):
                return orig(self, *args, **kwargs)

        setattr(cls, method, wrapped)

    wrap(SPDDistributor, "factor_final", "timeline/factor_handover")
    wrap(InverseBroadcaster, "publish", "timeline/inverse_publish")
    wrap(InverseBroadcaster, "expect", "timeline/inverse_publish")
    wrap(InverseBroadcaster, "wait", "timeline/inverse_wait")


def worker(rank: int, world: int, cfg: dict) -> dict:
    """One rank: a short Lightning fit whose step ``cfg['step']`` is traced; what the analysis needs."""
    import pytorch_lightning as pl
    import torch.nn.functional as F
    from iteration_time import make_data, make_model

    from lightning_spdkfac import KFAC, SPDKFACStrategy

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    warnings.filterwarnings("ignore")
    for name in ("pytorch_lightning", "lightning", "lightning.pytorch", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    default_threads = _gloo_threads()  # the default group exists already (run_distributed made it)
    _instrument()

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_model(cfg["seed"])

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def backward(self, loss, *args, **kwargs):
            with record_function("timeline/backward"):  # loss.backward() whole, DDP's final sync included
                loss.backward(*args, **kwargs)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=cfg["lr"], momentum=0.9)

    class Probe(pl.Callback):
        """After ``KFAC`` in the callback list: its hooks run inside the traced window."""

        def __init__(self, kfac: KFAC):
            self.kfac = kfac
            self.active = False
            self.out: dict = {"rank": rank}

        def setup(self, trainer, pl_module, stage):
            self.out["kfac_threads"] = sorted(_gloo_threads() - default_threads)  # the strategy's new group
            self.out["default_threads"] = sorted(default_threads)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            pre = self.kfac.preconditioner
            self.active = pre.steps == cfg["step"] and self.kfac._profiler is not None
            if self.active:
                self.out["marks"] = _clock_marks()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if not self.active:
                return
            with record_function("timeline/kfac_step_end"):
                pass
            self.out["marks"] += _clock_marks()
            pre = self.kfac.preconditioner
            d = pre.distributor
            timings = d._fused.last_timings  # this step's factor reduction (FusedAllReduce)
            plan = d.describe()
            self.out.update(
                timer=dict(pre.timer.last),
                fused=None if timings is None else asdict(timings),
                pipelined=plan["pipelined"],
                measuring=plan["measuring"],
                groups=plan["groups"],
                owners=plan["owners"],
                inverse_step=(cfg["step"] % cfg["inv_update_steps"] == 0),
                layers=[ly.name for ly in pre.layers.values()],
            )

    data = make_data(rank, cfg["batch"], cfg["n_batches"], cfg["seed"])
    loader = torch.utils.data.DataLoader(data, batch_size=None, shuffle=False)
    # factors every step, as when docs/timeline.png was drawn (the library's default became 5: SPD's profiling
    # window, in factor steps, would then run past the traced step)
    kfac = KFAC(damping=cfg["damping"], factor_update_steps=1, inv_update_steps=cfg["inv_update_steps"],
                trace_step=cfg["step"],
                trace_dir=cfg["trace_dir"], log_step_time=False)
    probe = Probe(kfac)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, max_steps=cfg["step"] + 1,
        strategy=SPDKFACStrategy(schedule="spd", profile_steps=tuple(cfg["profile_steps"])),
        callbacks=[kfac, probe], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False,
    )
    trainer.fit(Module(), loader)
    out = probe.out
    if "timer" not in out:
        raise RuntimeError(f"step {cfg['step']} was not traced on rank {rank}")
    if out["measuring"] or not out["pipelined"]:
        raise RuntimeError(f"step {cfg['step']} is inside the SPD profiling window: raise --step")
    out["trace"] = os.path.join(cfg["trace_dir"], f"kfac_step{cfg['step']}_rank{rank}.json")
    with open(os.path.join(cfg["trace_dir"], f"timeline_meta_rank{rank}.json"), "w") as f:
        json.dump(out, f)
    return out


# ------------------------------------------------------------------------------ the analysis
def _union(intervals) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _total(intervals) -> float:
    return sum(e - s for s, e in _union(intervals))


def _paint(intervals: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """Non-overlapping segments: at each instant the shortest (innermost) interval covering it."""
    cuts = sorted({t for s, e, _ in intervals for t in (s, e)})
    segs: list[tuple[float, float, str]] = []
    for a, b in zip(cuts, cuts[1:]):
        cover = [(e - s, cat) for s, e, cat in intervals if s <= a and e >= b]
        if not cover:
            continue
        cat = min(cover, key=lambda c: c[0])[1]
        if segs and segs[-1][2] == cat and segs[-1][1] == a:
            segs[-1] = (segs[-1][0], b, cat)
        else:
            segs.append((a, b, cat))
    return segs


def _align(stamps: list[float], times: list[float]) -> list[int]:
    """Indices j_0 < j_1 < ... into ``times`` minimizing sum |times[j_i] - stamps[i]| (both sorted)."""
    n, m = len(stamps), len(times)
    if n > m:
        raise RuntimeError(f"{n} launch stamps of the library but only {m} c10d::allreduce_ ops in the trace")
    inf = float("inf")
    cost = [[inf] * (m + 1) for _ in range(n + 1)]  # cost[i][j]: first i stamps within the first j times
    cost[0] = [0.0] * (m + 1)
    for i in range(1, n + 1):
        for j in range(i, m + 1):
            cost[i][j] = min(cost[i][j - 1], cost[i - 1][j - 1] + abs(times[j - 1] - stamps[i - 1]))
    picked, j = [], m
    for i in range(n, 0, -1):
        while cost[i][j] == cost[i][j - 1] and j > i:
            j -= 1
        picked.append(j - 1)
        j -= 1
    return picked[::-1]


def _clock_offset(events: list[dict], marks: list) -> tuple[float, float]:
    """trace_us = perf_counter_us + offset, from the ``timeline/clock`` ranges; (offset, spread) in us."""
    ranges = sorted((e for e in events if e["name"] == "timeline/clock"), key=lambda e: e["ts"])
    if len(ranges) != len(marks):
        raise RuntimeError(f"{len(ranges)} timeline/clock ranges in the trace for {len(marks)} marks")
    offsets = sorted((e["ts"] - (a + b) / 2e3, (b - a) / 1e3) for e, (a, b) in zip(ranges, marks))
    best = min(offsets, key=lambda o: o[1])[0]  # the tightest read
    spread = max(abs(o - best) for o, _ in offsets)
    return best, spread


def analyse_rank(trace: dict, meta: dict) -> dict:
    """Intervals (absolute trace microseconds) of one rank's traced step."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and isinstance(e.get("tid"), int)]
    steps = [e for e in events if e["name"].startswith("Optimizer.step#")]
    if len(steps) != 1:
        raise RuntimeError(f"expected one Optimizer.step range in the trace, found {len(steps)}")
    step = steps[0]
    main = step["tid"]
    t_start, t_end = step["ts"], step["ts"] + step["dur"]
    on_main = [e for e in events if e["tid"] == main]
    offset, clock_spread = _clock_offset(on_main, meta["marks"])

    def span(e):
        return e["ts"], e["ts"] + e["dur"]

    missing = [name for name in ("kfac/factor_compute", "kfac/factor_comm_wait", "kfac/inverse_compute",
                                 "kfac/precondition", "DistributedDataParallel.forward")
               if not any(e["name"] == name for e in on_main)]
    if missing:
        raise RuntimeError(f"rank {meta['rank']}: no {missing} range in the trace")
    intervals = [(t_start, t_end, "other")]
    intervals += [(*span(e), "forward") for e in on_main if e["name"] == "DistributedDataParallel.forward"]
    backward = [span(e) for e in on_main if e["name"] == "timeline/backward"]
    if len(backward) != 1:
        raise RuntimeError(f"expected one timeline/backward range, found {len(backward)}")
    nodes = [span(e) for e in on_main if e["name"].startswith("autograd::engine::evaluate_function:")
             and backward[0][0] <= e["ts"] <= backward[0][1]]
    if not nodes:
        raise RuntimeError("no autograd::engine events (backward) in the trace")
    # After the last autograd node, backward() is DDP's reducer finishing: it waits for its bucket
    # all-reduces (no profiler event covers that wait).
    last_node = max(e for _, e in nodes)
    intervals.append((last_node, backward[0][1], "ddp_wait"))
    intervals += [(*span(e), RANGE_CATEGORY[e["name"]]) for e in on_main if e["name"] in RANGE_CATEGORY]
    end_marks = [e for e in on_main if e["name"] == "timeline/kfac_step_end"]
    if len(end_marks) != 1:
        raise RuntimeError("no timeline/kfac_step_end marker in the trace")
    intervals.append((sum(span(end_marks[0])) / 2, t_end, "optimizer"))

    # Factor reduction: the library's per-group stamps (perf_counter seconds) on the trace's clock.
    fused = meta["fused"]
    if fused is None:
        raise RuntimeError("the library kept no factor-reduction timings for the traced step")

    def us(t: float) -> float:
        return t * 1e6 + offset

    groups = meta["groups"]
    for g in range(len(groups)):
        if fused["work_end"][g] == fused["work_end"][g]:  # not NaN
            intervals.append((us(fused["wait_start"][g]), us(fused["work_end"][g]), "factor_wait"))
    segments = _paint(intervals)

    # Collectives: launches on the main thread, execution on gloo worker threads.
    kfac_threads, default_threads = set(meta["kfac_threads"]), set(meta["default_threads"])
    if not kfac_threads:
        raise RuntimeError("could not tell the K-FAC group's gloo threads (no new pt_gloo_runloop thread)")
    c10d_ar = sorted((e for e in on_main if e["name"] == "c10d::allreduce_"), key=lambda e: e["ts"])
    c10d_bc = sorted((e for e in on_main if e["name"] == "c10d::broadcast_"), key=lambda e: e["ts"])

    def gloo(name: str, threads: set[int]) -> list[dict]:
        return sorted((e for e in events if e["name"] == name and e["tid"] in threads), key=lambda e: e["ts"])

    # K-FAC all-reduce launches: the c10d ops that best fit the library's launch stamps, in order (a
    # stamp is taken just after its launch returns; two groups may launch microseconds apart).
    order = list(fused["launch_order"])
    picked = _align([us(fused["launch"][g]) for g in order], [e["ts"] + e["dur"] for e in c10d_ar])
    kfac_launch = [(g, c10d_ar[j]) for g, j in zip(order, picked)]
    worst = max((abs(us(fused["launch"][g]) - e["ts"] - e["dur"]) for g, e in kfac_launch), default=0.0)
    if worst > 20000:
        raise RuntimeError(f"a factor group's launch stamp is {worst / 1e3:.1f} ms from its c10d::allreduce_")
    kfac_ids = {id(e) for _, e in kfac_launch}
    ddp_launch = [e for e in c10d_ar if id(e) not in kfac_ids]

    comm = []
    for kind, launches, executions, threads in (
        ("factor_allreduce", kfac_launch, gloo("gloo:all_reduce", kfac_threads), kfac_threads),
        ("inverse_broadcast", list(enumerate(c10d_bc)), gloo("gloo:broadcast", kfac_threads), kfac_threads),
        ("ddp_allreduce", list(enumerate(ddp_launch)), gloo("gloo:all_reduce", default_threads), default_threads),
    ):
        # A process group's workers take collectives from one FIFO queue: k-th launched, k-th started.
        if len(launches) != len(executions):
            raise RuntimeError(f"rank {meta['rank']}: {len(launches)} {kind} launches on the main thread but "
                               f"{len(executions)} executions on its gloo threads")
        lanes = sorted(threads)
        for k, ((index, launch), ex) in enumerate(zip(launches, executions)):
            comm.append(dict(kind=kind, index=index, order=k, thread=lanes.index(ex["tid"]),
                             launch=launch["ts"], start=ex["ts"], end=ex["ts"] + ex["dur"]))
    kfac_ranges = [span(e) for e in on_main if e["name"].startswith("kfac/") and e["ts"] >= backward[0][1]]
    t_kfac_end = sum(span(end_marks[0])) / 2
    forward = [span(e) for e in on_main if e["name"] == "DistributedDataParallel.forward"]
    phases = [("forward", forward[0][0], forward[-1][1]), ("backward", *backward[0]),
              ("K-FAC step", min(s for s, _ in kfac_ranges), t_kfac_end), ("SGD", t_kfac_end, t_end)]
    return dict(rank=meta["rank"], start=t_start, end=t_end, segments=segments, comm=comm, phases=phases,
                n_kfac_threads=len(kfac_threads), clock_offset_spread_us=clock_spread,
                backward_end=backward[0][1], last_node=last_node, launch_fit_us=worst, timer=meta["timer"],
                owners=meta["owners"], groups=groups, layers=meta["layers"], inverse_step=meta["inverse_step"])


def summarize(r: dict) -> dict:
    """Milliseconds per category on one rank."""
    out = {"step": (r["end"] - r["start"]) / 1e3}
    for cat in MAIN_CATEGORIES:
        out[cat] = sum(e - s for s, e, c in r["segments"] if c == cat) / 1e3
    for kind in COMM_CATEGORIES:
        ops = [c for c in r["comm"] if c["kind"] == kind]
        out[f"{kind}_count"] = len(ops)
        out[f"{kind}_inflight"] = _total((c["launch"], c["end"]) for c in ops) / 1e3  # launch -> completion
        out[f"{kind}_executing"] = _total((c["start"], c["end"]) for c in ops) / 1e3  # on a gloo thread
    return out


def _factor_names(layers: list[str]) -> list[str]:
    """The distributor's canonical factor order: A in layer order, then G in reverse layer order."""
    return [f"{name}.A" for name in layers] + [f"{name}.G" for name in reversed(layers)]


def to_json(ranks: list[dict], origin: float, cfg: dict) -> dict:
    def ms(t: float) -> float:
        return round((t - origin) / 1e3, 3)

    return {
        "description": "One SPD-KFAC training iteration per rank, from PyTorch profiler traces "
                       "(see benchmarks/timeline.py). Times in ms from the earliest rank's start of the step.",
        "config": cfg,
        "categories": {k: {"label": label, "color": color, "thread": thread, "source": source}
                       for cats, thread in ((MAIN_CATEGORIES, "main"), (COMM_CATEGORIES, "gloo worker"))
                       for k, (label, color, source) in cats.items()},
        "ranks": [
            {
                "rank": r["rank"],
                "step": [ms(r["start"]), ms(r["end"])],
                "phases": [[label, ms(s), ms(e)] for label, s, e in r["phases"]],
                "main_thread": [[ms(s), ms(e), c] for s, e, c in r["segments"]],
                "collectives": [
                    dict(kind=c["kind"], index=c["index"], gloo_thread=c["thread"], launch=ms(c["launch"]),
                         start=ms(c["start"]), end=ms(c["end"]))
                    for c in r["comm"]
                ],
                "summary_ms": {k: round(v, 3) if isinstance(v, float) else v for k, v in r["summary"].items()},
                "library_step_timer_ms": {k: round(v * 1e3, 3) for k, v in r["timer"].items()},
                "inverse_owner": dict(zip(_factor_names(r["layers"]), r["owners"])),  # -1: every rank
                "fusion_groups": r["groups"],
                "clock_offset_spread_us": round(r["clock_offset_spread_us"], 1),
            }
            for r in ranks
        ],
    }


# ------------------------------------------------------------------------------ the picture
def plot(ranks: list[dict], origin: float, cfg: dict, path: str) -> str:
    plt = pyplot()
    from matplotlib.patches import Patch

    n_kfac = max(r["n_kfac_threads"] for r in ranks)
    lanes = ["main"] + [f"kfac{i}" for i in range(n_kfac)] + ["ddp"]
    names = {"main": "main thread", "ddp": "DDP group:\ngloo threads"}
    names.update({f"kfac{i}": f"K-FAC group:\ngloo thread {i + 1}" for i in range(n_kfac)})
    y = {lane: len(lanes) - 1 - i for i, lane in enumerate(lanes)}
    y["main"] += 0.25  # room for the phase brackets above it
    fig, axes = plt.subplots(len(ranks), 1, figsize=(11, 2.9 * len(ranks) + 2.0), sharex=True, squeeze=False)
    axes = axes[:, 0]
    end = max(r["end"] for r in ranks)

    def ms(t: float) -> float:
        return (t - origin) / 1e3

    pixel = (end - origin) / 1e3 / 1100  # ~ms per pixel: a collective shorter than that is drawn 1 pixel wide
    for ax, r in zip(axes, ranks):
        bars: dict[str, list[tuple[float, float]]] = {}
        for s, e, c in r["segments"]:
            bars.setdefault(c, []).append((ms(s), (e - s) / 1e3))
        for c, xs in bars.items():
            ax.broken_barh(xs, (y["main"] - 0.4, 0.8), facecolors=MAIN_CATEGORIES[c][1], linewidth=0)
        for c in r["comm"]:
            lane = "ddp" if c["kind"] == "ddp_allreduce" else f"kfac{c['thread']}"
            color = COMM_CATEGORIES[c["kind"]][1]
            if c["start"] > c["launch"]:  # queued: launched, not yet started by a worker thread
                ax.broken_barh([(ms(c["launch"]), (c["start"] - c["launch"]) / 1e3)], (y[lane] - 0.1, 0.2),
                               facecolors=color, alpha=0.35, linewidth=0)
            width = (c["end"] - c["start"]) / 1e3
            ax.broken_barh([(ms(c["start"]), max(width, pixel))], (y[lane] - 0.3, 0.6), facecolors=color,
                           edgecolor="white", linewidth=0.3 if width > 3 * pixel else 0)
        top = y["main"] + 0.55
        for label, s, e in r["phases"]:
            ax.plot([ms(s), ms(e)], [top, top], color="#444444", linewidth=0.8)
            for t in (s, e):
                ax.plot([ms(t), ms(t)], [top - 0.08, top], color="#444444", linewidth=0.8)
            if (e - s) / (end - origin) > 0.035:
                ax.text((ms(s) + ms(e)) / 2, top + 0.06, label, ha="center", va="bottom", fontsize=8.5)
        ax.set_yticks([y[lane] for lane in lanes], [names[lane] for lane in lanes], fontsize=9.5)
        ax.set_ylim(-0.5, y["main"] + 1.0)
        ax.set_xlim(0, ms(end) * 1.005)
        ax.grid(axis="x", color="#dddddd", linewidth=0.6)
        ax.set_axisbelow(True)
        ax.tick_params(axis="y", length=0)
        for side in ("top", "right", "left"):
            ax.spines[side].set_visible(False)
        owned = sum(1 for o in r["owners"] if o == r["rank"])
        everyone = sum(1 for o in r["owners"] if o == -1)
        sm = r["summary"]
        ax.set_title(f"rank {r['rank']}: step {sm['step']:.0f} ms; inverts {owned} of {len(r['owners'])} factors "
                     f"(+{everyone} small ones on every rank)", loc="left", fontsize=10)
        ax.set_title(f"blocked: factor all-reduces {sm['factor_wait']:.2f} ms, inverse broadcasts "
                     f"{sm['inverse_wait']:.0f} ms", loc="right", fontsize=9, color="#444444")
    axes[-1].set_xlabel("time since the start of the step (ms)")
    handles = [Patch(color=c, label=lab) for lab, c, _ in [*MAIN_CATEGORIES.values(), *COMM_CATEGORIES.values()]]
    handles.append(Patch(color="#c44e52", alpha=0.35, label="launched, queued for a gloo thread (thin)"))
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=9, frameon=False, handlelength=1.5,
               columnspacing=1.5)
    fig.suptitle(
        f"One SPD-KFAC training iteration: {MODEL_NAME}, batch {cfg['batch']} per rank, "
        f"{cfg['world_size']} gloo ranks x 1 thread (CPU)\n"
        f"optimizer step {cfg['step']}, an inverse-update step (inv_update_steps={cfg['inv_update_steps']}); "
        f"from the PyTorch profiler traces of KFAC(trace_step={cfg['step']})",
        fontsize=10.5,
    )
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    return save_png(fig, path, dpi=120)


# ------------------------------------------------------------------------------ main
def print_summary(ranks: list[dict]) -> None:
    """Per rank, ms per category; in parentheses the library's StepTimer value of the same step."""
    lib = {"factor_compute": "factor_compute", "factor_wait": "factor_comm_wait", "factor_unpack": "factor_pack",
           "factor_update": "factor_update", "inverse_compute": "inverse_compute",
           "inverse_wait": "inverse_comm_wait", "precondition": "precondition"}
    rows: list[tuple[str, list[float], list[float | None]]] = [
        ("step (Optimizer.step#SGD.step range)", [r["summary"]["step"] for r in ranks], [None] * len(ranks))
    ]
    for key, (label, *_) in MAIN_CATEGORIES.items():
        rows.append((f"main thread: {label}", [r["summary"][key] for r in ranks],
                     [r["timer"][lib[key]] * 1e3 if key in lib else None for r in ranks]))
    names = {"factor_allreduce": "factor all-reduces", "inverse_broadcast": "inverse broadcasts",
             "ddp_allreduce": "DDP gradient all-reduces"}
    for kind, name in names.items():
        n = ranks[0]["summary"][f"{kind}_count"]
        rows.append((f"{name} (x{n}) in flight: launch to completion", [r["summary"][f"{kind}_inflight"] for r in ranks],
                     [r["timer"]["factor_comm_inflight"] * 1e3 if kind == "factor_allreduce" else None
                      for r in ranks]))
        rows.append((f"{name} executing on a gloo thread", [r["summary"][f"{kind}_executing"] for r in ranks],
                     [None] * len(ranks)))
    width = max(len(label) for label, _, _ in rows) + 2
    print("\n" + "ms".ljust(width) + "".join(f"rank {r['rank']}  (library)".rjust(24) for r in ranks))
    for label, values, refs in rows:
        cells = "".join(f"{v:9.2f}  " + (f"({ref:8.2f})" if ref is not None else " " * 10) + " " * 3
                        for v, ref in zip(values, refs))
        print(label.ljust(width) + cells.rjust(24 * len(ranks)))
    print("(library): StepTimer.last of the traced step (lightning_spdkfac.telemetry); its factor_comm_inflight "
          "runs from launch to the end of the wait in step(), not to completion")


def parse_args(argv=None) -> argparse.Namespace:
    p = bench_parser(__doc__.split("\n\n")[0], seed=0,
                     out="folder for timeline.json and .png (default: a fresh benchmarks/results/run-*/)",
                     refresh="write the committed docs/timeline.{json,png} the README shows (unless --json/--png "
                             "say otherwise)")
    p.add_argument("--step", type=int, default=12, help="optimizer step to trace (an inverse step, after the "
                   "profiling window)")
    p.add_argument("--inv-update-steps", type=int, default=4, help="KFAC(inv_update_steps=...)")
    p.add_argument("--profile-steps", default="2,5", help="SPD profiling window (start,end)")
    p.add_argument("--world-size", type=int, default=2, help="gloo processes (one torch thread each)")
    p.add_argument("--batch", type=int, default=32, help="batch per rank")
    p.add_argument("--n-batches", type=int, default=64, help="distinct synthetic batches per rank")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (momentum 0.9)")
    p.add_argument("--damping", type=float, default=0.03, help="K-FAC damping")
    p.add_argument("--attempts", type=int, default=3,
                   help="independent runs; the one whose traced step is shortest (least disturbed) is drawn")
    p.add_argument("--trace-dir", default=None,
                   help="keep the traces here, in attempt<k>/ (default: a temporary folder, removed)")
    p.add_argument("--analyse-only", action="store_true",
                   help="do not train: read the traces and metadata left in --trace-dir by an earlier run")
    p.add_argument("--json", default=None,
                   help="intervals as JSON ('' for none; default: timeline.json in a fresh benchmarks/results/run-*/)")
    p.add_argument("--png", default=None,
                   help="the picture ('' for none; default: timeline.png in a fresh benchmarks/results/run-*/)")
    p.add_argument("--timeout", type=float, default=600.0, help="bound on the distributed run (s)")
    args = parse(p, argv, quick={"attempts": 1, "batch": 8, "n_batches": 4})
    try:
        ps = [int(v) for v in args.profile_steps.split(",")]
    except ValueError:
        ps = []
    if len(ps) != 2 or not 0 <= ps[0] < ps[1]:
        p.error("--profile-steps: start,end with 0 <= start < end")
    args.profile_steps = ps
    if args.step <= ps[1] or args.step % args.inv_update_steps:
        p.error(f"--step must be after the profiling window (> {ps[1]}) and a multiple of --inv-update-steps")
    if args.attempts < 1:
        p.error("--attempts must be >= 1")
    if args.world_size < 2:
        p.error("--world-size must be >= 2")
    if args.analyse_only and not args.trace_dir:
        p.error("--analyse-only needs --trace-dir")
    if args.json is None or args.png is None:
        folder = out_dir(args, "timeline", DOCS)
        args.json = os.path.join(folder, "timeline.json") if args.json is None else args.json
        args.png = os.path.join(folder, "timeline.png") if args.png is None else args.png
    return args


def load_attempt(folder: str, args: argparse.Namespace) -> list[dict]:
    """The analysed ranks of one run, from its traces and the metadata its ranks wrote."""
    ranks = []
    for rank in range(args.world_size):
        with open(os.path.join(folder, f"timeline_meta_rank{rank}.json")) as f:
            meta = json.load(f)
        with open(os.path.join(folder, f"kfac_step{args.step}_rank{rank}.json")) as f:
            trace = json.load(f)
        r = analyse_rank(trace, meta)
        r["summary"] = summarize(r)
        ranks.append(r)
    return ranks


def checks(ranks: list[dict]) -> None:
    """Consistency of the extracted intervals, printed."""
    # The ranks' traces share the host clock: an all-reduce completes at nearly the same time on every rank.
    ends = [[c["end"] for c in sorted(r["comm"], key=lambda c: c["order"]) if c["kind"] == "factor_allreduce"]
            for r in ranks]
    skew = sorted(max(e) - min(e) for e in zip(*ends))
    if skew:
        print(f"cross-rank clock check: the same factor all-reduce completes {skew[len(skew) // 2] / 1e3:.3f} ms "
              f"apart on the ranks (median; max {skew[-1] / 1e3:.3f} ms)")
    for r in ranks:
        early = sum(1 for c in r["comm"] if c["start"] < c["launch"] - 50)
        ddp = [c["end"] for c in r["comm"] if c["kind"] == "ddp_allreduce"]
        print(f"rank {r['rank']}: {len(r['comm'])} collectives, {early} started on a gloo thread more than 0.05 ms "
              f"before their launch (should be 0); clock marks agree within {r['clock_offset_spread_us']:.0f} us; "
              f"library launch stamps within {r['launch_fit_us'] / 1e3:.2f} ms of their c10d ops' ends")
        if ddp:
            print(f"rank {r['rank']}: the end of backward() comes {(r['backward_end'] - r['last_node']) / 1e3:.1f} ms "
                  f"after the last autograd node and {(r['backward_end'] - max(ddp)) / 1e3:+.2f} ms after the "
                  f"end of DDP's last gradient all-reduce on its gloo thread")


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = {k: getattr(args, k) for k in ("step", "inv_update_steps", "profile_steps", "world_size", "batch",
                                         "n_batches", "lr", "damping", "seed")}
    trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="kfac_timeline_")
    attempts: list[tuple[float, int, list[dict]]] = []
    try:
        if args.analyse_only:
            k = 0
            while os.path.isdir(os.path.join(trace_dir, f"attempt{k}")):
                ranks = load_attempt(os.path.join(trace_dir, f"attempt{k}"), args)
                attempts.append((max(r["summary"]["step"] for r in ranks), k, ranks))
                k += 1
            if not attempts:
                raise SystemExit(f"no attempt*/ folder with traces in {trace_dir}")
        else:
            import timeline  # the ranks need a function of an importable module, not of __main__

            from lightning_spdkfac.multiprocess import run_distributed

            for k in range(args.attempts):
                folder = os.path.join(trace_dir, f"attempt{k}")
                os.makedirs(folder, exist_ok=True)
                t0 = time.perf_counter()
                run_distributed(timeline.worker, args.world_size, {**cfg, "trace_dir": folder},
                                timeout=args.timeout, threads=1)
                ranks = load_attempt(folder, args)
                attempts.append((max(r["summary"]["step"] for r in ranks), k, ranks))
                steps = ", ".join(f"{r['summary']['step']:.0f}" for r in ranks)
                print(f"attempt {k + 1}/{args.attempts}: {args.step + 1} steps in {time.perf_counter() - t0:.0f} s; "
                      f"traced step {steps} ms (ranks 0..{args.world_size - 1}); load average "
                      f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cpus", flush=True)
    finally:
        if not args.trace_dir:
            shutil.rmtree(trace_dir, ignore_errors=True)
    _, best, ranks = min(attempts, key=lambda a: a[0])
    cfg["attempt"] = best + 1
    cfg["attempts"] = len(attempts)
    if len(attempts) > 1:
        print(f"kept attempt {best + 1}: the shortest traced step (slowest rank), the least disturbed by other load")
    origin = min(r["start"] for r in ranks)
    print_summary(ranks)
    checks(ranks)
    if args.json:
        save_json(os.path.dirname(os.path.abspath(args.json)), os.path.basename(args.json),
                  to_json(ranks, origin, cfg), indent=1)
    if args.png:
        print(f"wrote {plot(ranks, origin, cfg, args.png)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
