"""Distributed iteration time of D-KFAC, MPD-KFAC and SPD-KFAC (and SPD's ablations) against DDP+SGD.

``python benchmarks/iteration_time.py --refresh`` writes the committed
``benchmarks/results/iteration_time.{json,png}`` (docs/results/distributed.md; without ``--refresh``: a fresh
run folder). At toy scale, the timing experiment of Shi, Zhang, Li (ICDCS 2021): the per-iteration time of
K-FAC under each schedule, split into the paper's categories, on ``--world-size`` gloo ranks on this machine
(``--threads`` torch threads each).

Model and data: a small ResNet without BatchNorm (:class:`SmallResNet`) on fixed synthetic CIFAR-shaped
batches (``--batch`` 32 per rank, ``--n-batches`` distinct ones cycled, a seed per rank, random labels), every
configuration from the same weights; SGD lr 0.01 momentum 0.9, K-FAC damping 0.03 (smaller dampings diverge
here, and few batches get memorized until the gradients underflow: either would time a degenerate run). Sized
for the paper's proportions (ResNet-50 under D-KFAC: factor computation 1.6x and inversion 2.1x the
forward+backward time): here about 1.9x and 2.0x on one core, A factors up to 1153 x 1153.

Configurations (DDP on the default group; K-FAC with a factor process group of its own, shared by the
configurations, which never overlap in time): ``sgd``, ``dkfac``, ``mpd``, ``spd``
(``SPDOptions.from_schedule(name)``), the SPD ablations ``spd-no-pipe`` (pipelining=False), ``spd-no-dtf``
(fusion="layerwise"), ``spd-no-lbp`` (placement="round_robin"), ``dpkfac``, ``auto`` and ``auto-async``
(schedule="auto", reported against the fastest fixed schedule it could pick), and ``dkfac``, ``mpd``, ``spd``,
``spd-no-pipe``, ``dpkfac`` with asynchronous inverses (``-async``); factor_update_steps=1 and each
``--inv-update-steps`` (1, the paper's setting, and 10). With deepspeed installed also ``ds0-sgd``,
``ds0-spd``, ``ds2-sgd``, ``ds2-spd``, ``ds2-dpkfac``: a DeepSpeed engine (fp32, ZeRO stage 0 or 2,
overlap_comm) in place of DDP, K-FAC reading ZeRO's gradients through
``DeepSpeedGradAccess``. Opt-in (``--configs``): ``spd-bucket``, ``spd-all``, ``spd-bf16``, ``spd-lbp``,
``spd-g-unfused`` (see ``_SPD_OVERRIDES``).

Timing: per inv_update_steps value, every configuration is built in the same worker processes and warmed up
(``--warmup`` steps, at least profile_steps[1] + 2 so that SPD's fusion plan is fixed, rounded up to whole
inverse periods). Then ``--blocks`` rounds, each one block of ``--steps`` steps (rounded up to a multiple of
inv_update_steps) per configuration, the first configuration rotating from round to round. Each iteration
starts after a ``dist.barrier()``; its time is the maximum over ranks, averaged over the block. Reported: the
median over blocks, the interquartile range, and the fastest block ("min", the least disturbed by other load).

Breakdown (ms per iteration, medians over blocks of rank-mean block means; rank-max in the JSON):
forward+backward is timed around zero_grad/forward/loss/backward, ``pre.step()`` and ``opt.step()``
separately, the K-FAC phases come from ``pre.timer.last`` (:mod:`lightning_spdkfac.telemetry`):

* FF&BP = forward+backward - factor_compute; it holds DDP's exposed gradient all-reduce (not separable) and
  the hooks' hand-over of final factors to the pipelined distributor.
* FactorComp = factor_compute + factor_update. FactorComm = factor_comm_wait (exposed communication).
  FactorPack = factor_pack (packing triangles in ``step()`` without pipelining, unpacking and averaging the
  reduced ones); "pack" and "unpack" are also timed alone afterwards.
* "FComm tot": the configuration's final fused groups all-reduced one after another with nothing else
  running (``--comm-repeats`` times, rank-max, median). "FComm infl": factor_comm_inflight (the union of the
  groups' launch -> completion intervals, an upper bound of the time communication was under way).
* InvComp = inverse_compute, InvComm = inverse_comm_wait, Precond = precondition, Opt = opt.step().
* KFACOther = pre.step() - its timed phases; Skew = rank-max iteration - rank-mean sum of the above.

"A perfect schedule would reach": from dkfac, all factor communication hidden and the inversions split evenly
with free broadcasts, 1 - (FComm exp + (1 - 1/world) InvComp) / iter; from mpd, all factor communication and
inverse broadcasts hidden, 1 - (FComm exp + InvComm) / iter.

Targets (issue), PASS/MISS per inv_update_steps value: spd/dkfac <= 0.75, spd/mpd <= 0.9, exposed factor
communication of spd <= 30% of FComm tot (and of FComm infl). ``--json`` gets every number (per block,
rank-mean and rank-max), the environment, the arguments and the plans (``distributor.describe()`` with factor
names); ``--png`` a stacked-bar chart of the breakdown (skipped with a message without matplotlib).
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import os
import sys
import time
import traceback
from importlib.util import find_spec
from statistics import fmean, median

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import (
    bench_parser,
    check_positive,
    interleave,
    loadavg,
    output_paths,
    parse,
    print_table,
    pyplot,
    random_batches,
    run_gloo,
    save_json,
    save_png,
    summarize,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_spdkfac import KFACPreconditioner
from lightning_spdkfac.comm.auto import AutoDistributor
from lightning_spdkfac.comm.dpkfac import DPKFACDistributor
from lightning_spdkfac.comm.scheduler import SPDDistributor, SPDOptions
from lightning_spdkfac.comm.triangle import pack_triu, triu_size, unpack_triu
from lightning_spdkfac.lightning.deepspeed import DeepSpeedGradAccess
from lightning_spdkfac.telemetry import PHASES

CONFIGS = ("sgd", "dkfac", "mpd", "spd", "spd-no-pipe", "spd-no-dtf", "spd-no-lbp",
           "dkfac-async", "mpd-async", "spd-async", "spd-no-pipe-async", "auto", "auto-async", "dpkfac", "dpkfac-async")
# schedule="auto" (comm/auto.py) and what it is measured against: "auto" times the four synchronous schedules,
# "auto-async" (async_inverses="auto") each of them with and without asynchronous inverses.
AUTO_FIXED = {
    "auto": ("dkfac", "mpd", "spd", "spd-no-pipe"),
    "auto-async": ("dkfac", "mpd", "spd", "spd-no-pipe", "dkfac-async", "mpd-async", "spd-async",
                   "spd-no-pipe-async"),
}
AUTO_TARGET = 1.03  # auto within 3% of the fastest fixed schedule of the setting
# DeepSpeed engines instead of DDP (ZeRO stage 0 / 2, fp32): SGD alone and with SPD-KFAC. Part of the
# default set when deepspeed is installed.
DEEPSPEED_CONFIGS = ("ds0-sgd", "ds0-spd", "ds2-sgd", "ds2-spd", "ds2-dpkfac")
# Opt-in variants (--configs) for investigation: other fusion policies under pipelining, bf16 messages.
EXTRA_CONFIGS = ("spd-bucket", "spd-all", "spd-bf16", "spd-lbp", "spd-g-unfused")
_SPD_OVERRIDES = {
    "spd": {},
    "spd-no-pipe": {"pipelining": False},
    "spd-no-dtf": {"fusion": "layerwise"},
    "spd-no-lbp": {"placement": "round_robin"},
    "spd-bucket": {"fusion": "bucket"},
    "spd-all": {"fusion": "all"},
    "spd-bf16": {"comm_dtype": "bfloat16"},
    # the improvements the cluster simulator asked for, one at a time (benchmarks/paper_table.py):
    "spd-lbp": {"placement": "lbp"},  # the paper's placement rule instead of the channel-aware one
    "spd-g-unfused": {"placement": "lbp", "fuse_g": False},  # and G factors unfused, as the paper's code
}
FIELDS = ("iter", "fwd_bwd", "pre_step", "opt") + PHASES  # one per-step record per rank
# The paper's categories (stacked-bar segments), then the extra columns.
SEGMENTS = ("FF&BP", "FactorComp", "FactorComm", "FactorPack", "InvComp", "InvComm", "Precond", "Opt",
            "KFACOther", "Skew")
COLORS = ("#4c72b0", "#dd8452", "#c44e52", "#e8a0a0", "#55a868", "#8172b3", "#937860", "#da8bc3", "#8c8c8c",
          "#cccccc")
TARGETS = (("spd/dkfac", 0.75), ("spd/mpd", 0.9), ("spd exposed/total factor comm", 0.30),
           ("spd exposed/inflight factor comm", 0.30))
NOTES = {
    "spd exposed/total factor comm": "  (total: the plan's all-reduces timed alone)",
    "spd exposed/inflight factor comm": "  (inflight: union of the all-reduces' launch->completion "
    "intervals, an upper bound of communication time)",
}


# ------------------------------------------------------------------------------ model and data
class BasicBlock(nn.Module):
    """relu(shortcut(x) + scale * conv2(relu(conv1(x)))): a ResNet basic block without BatchNorm."""

    def __init__(self, cin: int, cout: int, stride: int, scale: float = 0.25):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1)
        self.shortcut = nn.Conv2d(cin, cout, 1, stride) if stride != 1 or cin != cout else None
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv2(F.relu(self.conv1(x)))
        s = x if self.shortcut is None else self.shortcut(x)
        return F.relu(s + self.scale * y)


class SmallResNet(nn.Module):
    """32x32x3 -> stem 32 (stride 2, 16x16) -> blocks 32, 64 (8x8), 128 (4x4), 128 (2x2) -> pool -> 10."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, 2, 1)
        self.blocks = nn.Sequential(
            BasicBlock(32, 32, 1), BasicBlock(32, 64, 2), BasicBlock(64, 128, 2), BasicBlock(128, 128, 2)
        )
        self.fc = nn.Linear(128, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.relu(self.stem(x)))
        return self.fc(x.mean((2, 3)))


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return SmallResNet()


def make_data(rank: int, batch: int, n_batches: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return random_batches(torch.Generator().manual_seed(seed * 1000 + 17 + rank), n_batches, batch, 3, 32, 32)


def spd_options(name: str, profile_steps: tuple[int, int]) -> SPDOptions | None:
    if name.startswith("ds"):  # "ds<stage>-sgd" / "ds<stage>-spd"
        name = name.split("-", 1)[1]
    if name == "sgd":
        return None
    if name in ("auto", "auto-async"):
        return SPDOptions.from_schedule("auto", profile_steps=profile_steps,
                                        async_inverses="auto" if name == "auto-async" else None)
    flags = {"async_inverses": True} if name.endswith("-async") else {}
    name = name.removesuffix("-async")
    if name in ("dkfac", "mpd"):
        return SPDOptions.from_schedule(name, **flags)
    if name == "dpkfac":
        return SPDOptions.from_schedule(name, profile_steps=profile_steps, **flags)
    return SPDOptions.from_schedule("spd", profile_steps=profile_steps, **_SPD_OVERRIDES[name], **flags)


# ------------------------------------------------------------------------------ the workers
class Runner:
    """One configuration on this rank: its own model copy, DDP wrapper, optimizer and preconditioner."""

    def __init__(self, name: str, base: nn.Module, data, inv: int, cfg: dict, group):
        self.model = copy.deepcopy(base).train()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=cfg["lr"], momentum=0.9)
        self.engine = None
        grad_access = None
        if name.startswith("ds"):
            self.engine = self.ddp = _deepspeed_engine(self.model, self.opt, int(name[2]), cfg["batch"])
            grad_access = DeepSpeedGradAccess(lambda: self.engine)
        else:
            self.ddp = DDP(self.model)
        self.data, self.i = data, 0
        self.distributor = self.pre = None
        options = spd_options(name, cfg["profile_steps"])
        if options is not None:
            kind = (AutoDistributor if options.is_auto else DPKFACDistributor if options.schedule == "dpkfac"
                    else SPDDistributor)
            self.distributor = kind(options, process_group=group)
            self.pre = KFACPreconditioner(self.model, factor_update_steps=1, inv_update_steps=inv,
                                          damping=cfg["damping"], distributor=self.distributor,
                                          grad_access=grad_access,
                                          lr=lambda step: self.opt.param_groups[0]["lr"])
        self.last_loss = float("nan")

    def step(self) -> list[float]:
        """One step after a barrier on the default group; the record of FIELDS (seconds) on this rank."""
        dist.barrier()
        x, y = self.data[self.i % len(self.data)]
        self.i += 1
        pc = time.perf_counter
        t0 = pc()
        if self.engine is None:
            self.opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(self.ddp(x), y)
            loss.backward()
        else:  # the engine zeroes its gradients in step()
            loss = F.cross_entropy(self.engine(x), y)
            self.engine.backward(loss)
        t1 = pc()
        if self.pre is not None:
            self.pre.step()
        t2 = pc()
        (self.opt if self.engine is None else self.engine).step()
        t3 = pc()
        self.last_loss = loss.detach()
        last = self.pre.timer.last if self.pre is not None else {}
        return [t3 - t0, t1 - t0, t2 - t1, t3 - t2] + [float(last.get(p, 0.0)) for p in PHASES]

    def plan(self) -> dict | None:
        if self.distributor is None:
            return None
        d = self.distributor.describe()
        layers = list(self.pre.layers.values())
        canonical = [(i, "A") for i in range(len(layers))] + [(i, "G") for i in reversed(range(len(layers)))]
        label = {k: f"{layers[k[0]].name}.{k[1]}" for k in canonical}
        side = {k: getattr(layers[k[0]].helper, "a_dim" if k[1] == "A" else "g_dim") for k in canonical}
        order = [tuple(k) for k in d["order"]]
        return {
            "schedule": d["schedule"],
            "options": {k: getattr(self.distributor.options, k)
                        for k in ("pipelining", "fusion", "placement", "profile_steps")},
            "pipelined": d["pipelined"],
            "measuring": d["measuring"],
            "order": [label[k] for k in order],
            "groups": [[label[order[i]] for i in g] for g in d["groups"]],
            "group_elements": [sum(triu_size(side[order[i]]) for i in g) for g in d["groups"]],
            "owners": {label[k]: o for k, o in zip(canonical, d["owners"])},
            "sides": {label[k]: side[k] for k in canonical},
            "models": d["models"],
            "auto": d.get("auto"),
        }

    def close(self) -> None:
        if self.pre is not None:
            self.pre.remove_hooks()


def _deepspeed_engine(model: nn.Module, opt: torch.optim.Optimizer, stage: int, batch: int):
    """A DeepSpeed engine over ``model`` and ``opt`` on the already initialized gloo process group."""
    import deepspeed

    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))  # one machine: local rank = rank
    deepspeed.init_distributed("gloo")  # adopts the existing torch.distributed group
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True},
        "zero_allow_untested_optimizer": True,
    }
    engine, *_ = deepspeed.initialize(args=argparse.Namespace(device_rank=-1), model=model, optimizer=opt,
                                      model_parameters=model.parameters(), config=config,
                                      dist_init_required=False)
    return engine


def standalone_comm(plan: dict, group, repeats: int) -> list[float]:
    """Seconds (one value per repeat, on this rank) to all-reduce the plan's fused groups one after another with
    nothing else running, in the library's buffers (upper triangles plus one count per member): FComm tot."""
    bufs = [torch.zeros(e + len(g)) for e, g in zip(plan["group_elements"], plan["groups"])]
    for b in bufs:  # warm-up (connections, allocations)
        dist.all_reduce(b, group=group)
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for b in bufs:
            dist.all_reduce(b, group=group)
        times.append(time.perf_counter() - t0)
    return times


def pack_unpack_cost(plan: dict, repeats: int) -> tuple[list[float], list[float]]:
    """Seconds to pack every factor's upper triangle into its group buffer, and to unpack and average
    every group back into full matrices (what FusedAllReduce does at submit and inside its wait, so the
    unpacking is the library's factor_pack phase): CPU work of the factor reduction besides the all-reduce."""
    sides = [[plan["sides"][lab] for lab in g] for g in plan["groups"]]
    mats = [[torch.eye(n) for n in g] for g in sides]
    bufs = [torch.zeros(sum(triu_size(n) for n in g)) for g in sides]
    pack, unpack = [], []
    for _ in range(repeats + 1):  # the first builds the cached index tensors
        t0 = time.perf_counter()
        for m, b in zip(mats, bufs):
            pack_triu(m, out=b)
        t1 = time.perf_counter()
        for g, b in zip(sides, bufs):
            unpack_triu(b.div(2), g)
        t2 = time.perf_counter()
        pack.append(t1 - t0)
        unpack.append(t2 - t1)
    return pack[1:], unpack[1:]


def worker(rank: int, world: int, cfg: dict) -> dict:
    """All configurations, both inverse periods, on this rank; raw per-step records for the parent."""
    base = make_model(cfg["seed"])
    data = make_data(rank, cfg["batch"], cfg["n_batches"], cfg["seed"])
    group = dist.new_group()  # K-FAC's own collectives never interleave with DDP's
    out: dict = {"inv": {}}
    for inv in cfg["inv_update_steps"]:
        warmup = -(-max(cfg["warmup"], cfg["profile_steps"][1] + 2) // inv) * inv
        block = -(-cfg["steps"] // inv) * inv
        t0 = time.perf_counter()
        runners = {name: Runner(name, base, data, inv, cfg, group) for name in cfg["configs"]}
        t_built = time.perf_counter()
        for r in runners.values():
            for _ in range(warmup):
                r.step()
            # schedule="auto": warm up through its whole timing window (the same step on every rank), then to
            # the end of that inverse period; the timed blocks measure the schedule it chose.
            extra = 0
            while isinstance(r.distributor, AutoDistributor) and (r.distributor.chosen is None or extra % inv):
                r.step()
                extra += 1
        plans = {name: r.plan() for name, r in runners.items() if r.distributor is not None}
        still = [name for name, p in plans.items() if p["measuring"]]
        if still:
            raise RuntimeError(f"{still}: the SPD profiling window is not over after {warmup} warm-up steps "
                               f"(profile_steps={cfg['profile_steps']}); raise --warmup")
        t_warm = time.perf_counter()
        if rank == 0:
            print(f"[inv_update_steps={inv}] built {len(runners)} configurations in {t_built - t0:.1f} s "
                  f"(cost-model probes), warm-up {warmup} steps each in {t_warm - t_built:.1f} s; "
                  f"timing {cfg['blocks']} rounds x {block} steps", flush=True)
        records: dict[str, list[list[list[float]]]] = {name: [] for name in runners}

        def timed_block(r: Runner, into: list, steps: int):
            return lambda: into.append([r.step() for _ in range(steps)])

        # one block per configuration per round, the order rotating from round to round
        interleave({name: timed_block(r, records[name], block) for name, r in runners.items()}, cfg["blocks"],
                   label="  round", progress=rank == 0)
        comm = {name: standalone_comm(p, group, cfg["comm_repeats"]) for name, p in plans.items()}
        kfac = {name: r.pre for name, r in runners.items() if r.pre is not None}
        out["inv"][inv] = {
            "seconds": {"build": t_built - t0, "warmup": t_warm - t_built,
                        "timed": time.perf_counter() - t_warm},
            "standalone_comm": comm,
            "pack_unpack": {name: pack_unpack_cost(p, cfg["comm_repeats"]) for name, p in plans.items()},
            "warmup": warmup,
            "block": block,
            "records": records,
            "plans": plans if rank == 0 else None,
            "plans_agree_key": {name: (p["order"], p["groups"], p["owners"]) for name, p in plans.items()},
            "loss": {name: float(r.last_loss) for name, r in runners.items()},
            "state_bytes": {name: pre.state_bytes() for name, pre in kfac.items()},
            "skipped_factor_steps": {name: pre.skipped_factor_steps for name, pre in kfac.items()},
        }
        for r in runners.values():
            r.close()
        del runners
        gc.collect()
    return out


# ------------------------------------------------------------------------------ aggregation
def segments(v: dict[str, float], iter_max: float) -> dict[str, float]:
    """The paper's categories (seconds) from rank-aggregated FIELDS of one block."""
    in_step = sum(v[p] for p in ("factor_comm_wait", "factor_pack", "factor_update", "inverse_compute",
                                 "inverse_comm_wait", "precondition"))
    s = {
        "FF&BP": v["fwd_bwd"] - v["factor_compute"],
        "FactorComp": v["factor_compute"] + v["factor_update"],
        "FactorComm": v["factor_comm_wait"],
        "FactorPack": v["factor_pack"],
        "InvComp": v["inverse_compute"],
        "InvComm": v["inverse_comm_wait"],
        "Precond": v["precondition"],
        "Opt": v["opt"],
        "KFACOther": v["pre_step"] - in_step,
    }
    s["Skew"] = iter_max - sum(s.values())
    return s


def aggregate(per_rank: list[list[list[list[float]]]]) -> dict:
    """per_rank[rank][block][step][field] -> per-block values and medians (ms)."""
    n_blocks = len(per_rank[0])
    k = {f: i for i, f in enumerate(FIELDS)}
    blocks = []
    for b in range(n_blocks):
        steps = list(zip(*(r[b] for r in per_rank)))  # steps[s] = (rank0 record, rank1 record, ...)
        iter_max = fmean(max(rec[k["iter"]] for rec in st) for st in steps)
        mean = {f: fmean(fmean(rec[k[f]] for rec in st) for st in steps) for f in FIELDS}
        rmax = {f: fmean(max(rec[k[f]] for rec in st) for st in steps) for f in FIELDS}
        blocks.append({"iter_max": iter_max, "mean": mean, "max": rmax, "segments": segments(mean, iter_max)})
    iters = [1e3 * b["iter_max"] for b in blocks]
    s = summarize(iters)
    return {
        "iter_ms": s["median_s"],
        "iter_q1_ms": s["q1_s"],
        "iter_q3_ms": s["q3_s"],
        "iter_min_ms": s["min_s"],
        "drift": s["drift"],
        "iter_per_block_ms": iters,
        "segments_ms": {s: median([1e3 * b["segments"][s] for b in blocks]) for s in SEGMENTS},
        "phases_rank_mean_ms": {f: median([1e3 * b["mean"][f] for b in blocks]) for f in FIELDS},
        "phases_rank_max_ms": {f: median([1e3 * b["max"][f] for b in blocks]) for f in FIELDS},
    }


def analyse(results: list[dict], args) -> dict:
    out = {}
    for inv in args.inv_update_steps:
        rs = [r["inv"][inv] for r in results]
        keys = [r["plans_agree_key"] for r in rs]
        if any(kk != keys[0] for kk in keys[1:]):
            raise RuntimeError(f"inv_update_steps={inv}: the ranks made different SPD plans: {keys}")
        configs = {}
        for name in args.configs:
            a = aggregate([r["records"][name] for r in rs])
            a["final_loss"] = [r["loss"][name] for r in rs]
            a["skipped_factor_steps"] = [r["skipped_factor_steps"].get(name, 0) for r in rs]
            a["kfac_state_bytes"] = [r["state_bytes"].get(name, 0) for r in rs]  # per rank
            p = a["phases_rank_mean_ms"]
            a["factor_comm_exposed_ms"] = p["factor_comm_wait"]
            a["factor_comm_inflight_ms"] = p["factor_comm_inflight"]
            # FComm tot: rank-max per repeat, median over repeats
            alone = [max(t) for t in zip(*(r["standalone_comm"].get(name, ()) for r in rs))]
            a["factor_comm_standalone_ms"] = 1e3 * median(alone) if alone else None
            pu = [r["pack_unpack"].get(name) for r in rs]
            a["pack_ms"] = 1e3 * median([median(x[0]) for x in pu]) if pu[0] else None
            a["unpack_ms"] = 1e3 * median([median(x[1]) for x in pu]) if pu[0] else None
            configs[name] = a
        sgd = configs.get("sgd")
        for a in configs.values():
            a["x_sgd"] = a["iter_ms"] / sgd["iter_ms"] if sgd else None
        ratios = {}
        if "spd" in configs:
            spd = configs["spd"]
            for other in ("dkfac", "mpd"):
                if other in configs:
                    ratios[f"spd/{other}"] = spd["iter_ms"] / configs[other]["iter_ms"]
                    ratios[f"spd/{other} (min over rounds)"] = spd["iter_min_ms"] / configs[other]["iter_min_ms"]
            exposed = spd["factor_comm_exposed_ms"]
            if spd["factor_comm_standalone_ms"]:
                ratios["spd exposed/total factor comm"] = exposed / spd["factor_comm_standalone_ms"]
            if spd["factor_comm_inflight_ms"] > 0:
                ratios["spd exposed/inflight factor comm"] = exposed / spd["factor_comm_inflight_ms"]
            if "spd-no-pipe" in configs and configs["spd-no-pipe"]["factor_comm_exposed_ms"] > 0:
                ratios["spd exposed / spd-no-pipe exposed factor comm"] = (
                    exposed / configs["spd-no-pipe"]["factor_comm_exposed_ms"])
        fastest_fixed = {}
        for auto, fixed in AUTO_FIXED.items():  # schedule="auto" against the fastest fixed schedule it could pick
            present = [n for n in fixed if n in configs]
            if auto in configs and len(present) == len(fixed):
                fastest_fixed[auto] = min(present, key=lambda n: configs[n]["iter_ms"])
                ratios[f"{auto}/fastest fixed"] = configs[auto]["iter_ms"] / configs[fastest_fixed[auto]]["iter_ms"]
                quiet = min(present, key=lambda n: configs[n]["iter_min_ms"])  # by the least disturbed rounds
                ratios[f"{auto}/fastest fixed (min over rounds)"] = (
                    configs[auto]["iter_min_ms"] / configs[quiet]["iter_min_ms"])
        for stage in (0, 2):  # what K-FAC costs under ZeRO, against the same engine without K-FAC
            kfac, sgd_ds = configs.get(f"ds{stage}-spd"), configs.get(f"ds{stage}-sgd")
            if kfac and sgd_ds:
                ratios[f"ds{stage}-spd/ds{stage}-sgd"] = kfac["iter_ms"] / sgd_ds["iter_ms"]
            if kfac and "spd" in configs:
                ratios[f"ds{stage}-spd/spd"] = kfac["iter_ms"] / configs["spd"]["iter_ms"]
        # What a perfect schedule could reach on this model and world size: from D-KFAC, hide all
        # factor communication and split the inversions evenly with free broadcasts; from MPD-KFAC,
        # hide all factor communication and all inverse broadcasts.
        bounds = {}
        world = args.world_size
        if "dkfac" in configs:
            d = configs["dkfac"]
            bounds["spd/dkfac"] = 1 - (d["segments_ms"]["FactorComm"]
                                       + (1 - 1 / world) * d["segments_ms"]["InvComp"]) / d["iter_ms"]
        if "mpd" in configs:
            m = configs["mpd"]
            bounds["spd/mpd"] = 1 - (m["segments_ms"]["FactorComm"] + m["segments_ms"]["InvComm"]) / m["iter_ms"]
        targets = {name: {"value": ratios.get(name), "target": t,
                          "pass": None if ratios.get(name) is None else ratios[name] <= t,
                          "ideal_schedule_bound": bounds.get(name)} for name, t in TARGETS}
        out[inv] = {
            "warmup_steps": rs[0]["warmup"],
            "block_steps": rs[0]["block"],
            "phase_seconds_rank0": rs[0]["seconds"],
            "configs": configs,
            "ratios": ratios,
            "targets": targets,
            "fastest_fixed": fastest_fixed,
            "plans": rs[0]["plans"],
        }
    return out


# ------------------------------------------------------------------------------ output
def print_report(res: dict, args) -> None:
    for inv, r in res.items():
        print(f"\n== inv_update_steps={inv}, factor_update_steps=1: {args.world_size} ranks x {args.threads} "
              f"thread(s), batch {args.batch}/rank, {args.blocks} rounds x {r['block_steps']} steps, "
              f"warm-up {r['warmup_steps']} ==")
        rows = [{"config": name, "iter": a["iter_ms"], "iqr": f"{a['iter_q1_ms']:.1f}-{a['iter_q3_ms']:.1f}",
                 "min": a["iter_min_ms"], "x_sgd": a["x_sgd"], "inflight": a["factor_comm_inflight_ms"],
                 "alone": a["factor_comm_standalone_ms"], **a["segments_ms"]} for name, a in r["configs"].items()]
        print_table(rows, [
            ("config", "config", "s"), ("iter", "iter ms", ".1f"), ("iqr", "IQR", "s"), ("min", "min", ".1f"),
            ("x_sgd", "x sgd", ".2f"), ("FF&BP", "FF&BP", ".1f"), ("FactorComp", "FactorComp", ".1f"),
            ("FactorComm", "FComm exp", ".1f"), ("alone", "FComm tot", ".1f"), ("inflight", "FComm infl", ".1f"),
            ("FactorPack", "pack", ".1f"), ("InvComp", "InvComp", ".1f"), ("InvComm", "InvComm", ".1f"),
            ("Precond", "Precond", ".1f"), ("Opt", "Opt", ".1f"), ("KFACOther", "KFAC other", ".1f"),
            ("Skew", "skew", ".1f")])
        print("(iter: median over rounds of the block-mean rank-max iteration time; min: its fastest "
              "round, the least disturbed by other load on the machine; breakdown in ms: medians of "
              "rank-mean block means; FF&BP includes DDP's exposed gradient all-reduce (GradComm, not "
              "separable); FComm exp = exposed factor communication (factor_comm_wait); FComm tot = the "
              "plan's fused all-reduces timed alone, one after another (rank-max); FComm infl = "
              "factor_comm_inflight (union of launch->completion intervals, overlapping compute); neither "
              "is a segment; pack = factor_pack (triangles packed in step() and unpacked); skew = iter - "
              "sum of segments)")
        noisy = [n for n, a in r["configs"].items() if a["iter_q3_ms"] - a["iter_q1_ms"] > 0.1 * a["iter_ms"]]
        if noisy:
            print(f"WARNING: noisy timings for {', '.join(noisy)} (IQR > 10% of the median)")
        bad = [n for n, a in r["configs"].items()
               if not all(math.isfinite(v) for v in a["final_loss"]) or any(a["skipped_factor_steps"])]
        if bad:
            print(f"WARNING: non-finite losses or skipped factor steps in {', '.join(bad)}")
        abl = [n for n in ("spd", "spd-no-pipe", "spd-no-dtf", "spd-no-lbp") + EXTRA_CONFIGS if n in r["configs"]]
        if "spd" in abl and len(abl) > 1:
            spd, plans = r["configs"]["spd"]["iter_ms"], r["plans"]
            rows = [{"config": n, "iter": a["iter_ms"], "vs_spd": a["iter_ms"] / spd, "exp": s["FactorComm"],
                     "tot": a["factor_comm_standalone_ms"], "inv": s["InvComp"],
                     "invmax": a["phases_rank_max_ms"]["inverse_compute"], "invc": s["InvComm"], "pack": a["pack_ms"],
                     "unpack": a["unpack_ms"], "groups": len(plans[n]["groups"]) if plans else None,
                     "owned": sum(o >= 0 for o in plans[n]["owners"].values()) if plans else None}
                    for n in abl for a in [r["configs"][n]] for s in [a["segments_ms"]]]
            print_table(rows, [
                ("config", "config", "s"), ("iter", "iter ms", ".1f"), ("vs_spd", "vs spd", ".2f"),
                ("exp", "FComm exp", ".1f"), ("tot", "FComm tot", ".1f"), ("inv", "InvComp", ".1f"),
                ("invmax", "InvComp rank-max", ".1f"), ("pack", "pack", ".1f"), ("unpack", "unpack", ".1f"),
                ("invc", "InvComm", ".1f"), ("groups", "fused groups", "d"), ("owned", "broadcast inverses", "d")],
                title="ablations:")
        rt = r["ratios"]
        ds = {k: v for k, v in rt.items() if k.startswith("ds")}
        if ds:
            print("DeepSpeed: " + "; ".join(f"{k} {v:.3f}" for k, v in ds.items())
                  + "  (dsN-spd/dsN-sgd: what K-FAC costs on ZeRO stage N; dsN-spd/spd: against DDP)")
        extra = rt.get("spd exposed / spd-no-pipe exposed factor comm")
        if extra is not None:
            print(f"spd exposed factor comm / spd-no-pipe exposed factor comm: {extra:.2f}")
        for base, dp in (("spd", "dpkfac"), ("ds2-spd", "ds2-dpkfac")):
            if base in r["configs"] and dp in r["configs"] and max(r["configs"][base]["kfac_state_bytes"]):
                b, d = r["configs"][base], r["configs"][dp]
                print(f"{dp} / {base}: iteration {d['iter_ms'] / b['iter_ms']:.3f}; K-FAC state per rank "
                      f"{[round(x / 2**20, 2) for x in d['kfac_state_bytes']]} MiB vs {max(b['kfac_state_bytes']) / 2**20:.2f}"
                      f" MiB, most loaded rank {max(d['kfac_state_bytes']) / max(b['kfac_state_bytes']):.3f}")
        for auto in AUTO_FIXED:
            if f"{auto}/fastest fixed" in rt:
                choice = ((r["plans"] or {}).get(auto) or {}).get("auto") or {}
                decided = choice.get("decisions") or [{}]
                table = "; ".join(f"{k} {1e3 * v / inv:.1f}" for k, v in decided[-1].get("seconds_per_period", {}).items())
                value = rt[f"{auto}/fastest fixed"]
                print(f"{auto}: chose {choice.get('chosen')} (its timing, fastest slot, ms/step: {table}); iter / "
                      f"fastest fixed ({r['fastest_fixed'][auto]}) {value:.3f}  target <= {AUTO_TARGET:.2f}  "
                      f"{'PASS' if value <= AUTO_TARGET else 'MISS'}  (fastest rounds: "
                      f"{rt[f'{auto}/fastest fixed (min over rounds)']:.3f})")
        tag = " (the paper's timing setting)" if inv == 1 else ""
        print(f"targets, inv_update_steps={inv}{tag}:")
        for name, t in r["targets"].items():
            if t["value"] is None:
                print(f"  {name:32s} n/a (configurations missing)")
            else:
                note = NOTES.get(name, "")
                if t["ideal_schedule_bound"] is not None:
                    note = (f"  (ratio of the fastest rounds {rt[name + ' (min over rounds)']:.3f}; a perfect "
                            f"schedule would reach {t['ideal_schedule_bound']:.3f})")
                print(f"  {name:33s} {t['value']:.3f}  target <= {t['target']:.2f}  "
                      f"{'PASS' if t['pass'] else 'MISS'}{note}")
    for inv, r in res.items():
        p = (r["plans"] or {}).get("spd")
        if p:
            m = p["models"]
            owned = {}
            for lab, o in p["owners"].items():
                owned.setdefault(o, []).append(lab)
            print(f"\nspd plan (inv_update_steps={inv}): {len(p['groups'])} fused groups of "
                  f"{[len(g) for g in p['groups']]} factors ({p['group_elements']} elements); "
                  f"all-reduce alpha {1e3 * m.allreduce.alpha:.3f} ms beta {m.allreduce.beta * 1e9:.3f} ns/B; "
                  f"broadcast alpha {1e3 * m.broadcast.alpha:.3f} ms beta {m.broadcast.beta * 1e9:.3f} ns/B")
            for o in sorted(owned):
                who = "replicated" if o < 0 else f"rank {o}"
                print(f"  {who}: " + ", ".join(f"{lab}({p['sides'][lab]})" for lab in owned[o]))


def plot(res: dict, path: str) -> str:
    try:
        plt = pyplot()
    except ImportError:
        return "matplotlib is not installed: no PNG (pip install matplotlib)"
    fig, axes = plt.subplots(1, len(res), figsize=(6.5 * len(res), 4.8), squeeze=False)
    for ax, (inv, r) in zip(axes[0], res.items()):
        names = list(r["configs"])
        bottom = [0.0] * len(names)
        for seg, color in zip(SEGMENTS, COLORS):
            vals = [max(0.0, r["configs"][n]["segments_ms"][seg]) for n in names]
            ax.bar(names, vals, bottom=bottom, color=color, label=seg, width=0.7)
            bottom = [b + v for b, v in zip(bottom, vals)]
        for i, n in enumerate(names):
            ax.text(i, bottom[i], f"{r['configs'][n]['iter_ms']:.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_title(f"inv_update_steps={inv}, factor_update_steps=1")
        ax.set_ylabel("ms per iteration (rank-max)")
        ax.tick_params(axis="x", rotation=30)
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle("K-FAC iteration time breakdown (small ResNet, gloo, CPU)")
    fig.tight_layout()
    return f"wrote {save_png(fig, path, dpi=120)}"


# ------------------------------------------------------------------------------ main
def _int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse_args(argv=None):
    p = bench_parser(__doc__.split("\n\n")[0], threads=1, seed=0,
                     out="folder for iteration_time.json and .png (default: a fresh benchmarks/results/run-*/)",
                     refresh="write the committed benchmarks/results/iteration_time.{json,png} the README shows "
                             "(unless --json/--png say otherwise)")
    every = CONFIGS + DEEPSPEED_CONFIGS + EXTRA_CONFIGS
    default = CONFIGS + (DEEPSPEED_CONFIGS if find_spec("deepspeed") else ())
    p.add_argument("--configs", default=",".join(default),
                   help=f"comma-separated subset of {','.join(every)} (default: the first {len(CONFIGS)}, plus "
                        "the ds* ones when deepspeed is installed)")
    p.add_argument("--inv-update-steps", default="1,10", help="comma-separated inverse periods, each a table")
    p.add_argument("--blocks", type=int, default=8, help="timing rounds (each: one block per configuration)")
    p.add_argument("--steps", type=int, default=5, help="steps per block, rounded up to a multiple of inv_update_steps")
    p.add_argument("--warmup", type=int, default=10, help="warm-up steps per configuration (at least "
                   "profile_steps[1] + 2; rounded up to whole inverse periods)")
    p.add_argument("--profile-steps", default="2,6", help="SPD profiling window (factor steps start,end)")
    p.add_argument("--batch", type=int, default=32, help="batch per rank")
    p.add_argument("--n-batches", type=int, default=64,
                   help="distinct synthetic batches per rank, cycled (many: random labels are not memorized)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (momentum 0.9)")
    p.add_argument("--damping", type=float, default=0.03,
                   help="K-FAC damping (1e-3 and 1e-2 diverge on this model and data within ~60 steps, and "
                        "failed Cholesky factorizations fall back to slow eigendecompositions)")
    p.add_argument("--comm-repeats", type=int, default=5,
                   help="repeats of the standalone timing of each plan's fused all-reduces")
    p.add_argument("--timeout", type=float, default=1200.0, help="bound on the whole distributed run (s)")
    p.add_argument("--json", metavar="OUT", default=None,
                   help="write all numbers as JSON (default: iteration_time.json in a fresh benchmarks/results/run-*/)")
    p.add_argument("--png", metavar="OUT", default=None,
                   help="stacked-bar chart of the breakdown ('' for none; needs matplotlib; default: "
                        "iteration_time.png in a fresh benchmarks/results/run-*/)")
    args = parse(p, argv, quick={"configs": "sgd,spd", "inv_update_steps": "2", "blocks": 2, "steps": 2,
                                 "warmup": 0, "profile_steps": "0,1", "batch": 4, "n_batches": 2, "comm_repeats": 1})
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in args.configs if c not in every]
    if bad or not args.configs or len(set(args.configs)) != len(args.configs):
        p.error(f"--configs: unknown or repeated {bad or args.configs}; choose from {', '.join(every)}")
    try:
        args.inv_update_steps = _int_list(args.inv_update_steps)
        ps = _int_list(args.profile_steps)
    except ValueError as e:
        p.error(str(e))
    if not args.inv_update_steps or min(args.inv_update_steps) < 1:
        p.error("--inv-update-steps: positive integers")
    if len(ps) != 2 or not 0 <= ps[0] < ps[1]:
        p.error("--profile-steps: start,end with 0 <= start < end")
    args.profile_steps = (ps[0], ps[1])
    check_positive(p, args, "blocks", "steps", "batch", "n_batches", "world_size", "threads", "comm_repeats")
    check_positive(p, args, "warmup", least=0)
    output_paths(args, "iteration_time", COMMITTED_RESULTS, json="iteration_time.json",
                 png="iteration_time.png")
    return args


COMMITTED_RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")  # the README's charts


def main(argv=None) -> int:
    args = parse_args(argv)
    import iteration_time  # the workers need a function of an importable module, not of __main__

    cfg = {k: getattr(args, k) for k in ("configs", "inv_update_steps", "blocks", "steps", "warmup", "profile_steps",
                                         "batch", "n_batches", "lr", "damping", "seed", "comm_repeats")}
    results, env = run_gloo(iteration_time.worker, args, cfg, pg_timeout=300.0)
    if results is None:
        return 1
    res = analyse(results, args)
    print_report(res, args)
    print(f"\nwall time {env['wall_s']:.0f} s; load average after {loadavg(env['loadavg_after'])} "
          f"({env['cpu_count']} cpus; this run alone keeps ~{args.world_size * args.threads} busy)")
    if args.json:
        save_json(*os.path.split(os.path.abspath(args.json)),
                  {"env": env, "args": vars(args), "results": {str(k): v for k, v in res.items()}})
    if args.png:
        try:
            print(plot(res, args.png))
        except Exception:  # a plotting problem must not lose the numbers above
            print(f"PNG not written:\n{traceback.format_exc()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
