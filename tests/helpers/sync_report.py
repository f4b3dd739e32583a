"""Host reads per optimizer step of K-FAC, per configuration (issue 34): the sync budget, measured.

    .venv/bin/python tests/helpers/sync_report.py              # every configuration, 1 process and 2 gloo ranks
    .venv/bin/python tests/helpers/sync_report.py --only defaults spd_every_step --top 5
    .venv/bin/python tests/helpers/sync_report.py --json out.json

Prints, per configuration (and rank), the counted host reads per step, those inside hooks, the most on one
step, the collectives issued off the training thread, then the top source lines (file:line <- its caller, kind, thread,
inside a hook or not, count; "<-" names the package line that called it). The configurations and the runner are those of tests/test_sync_budget.py.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # the checkout's package and tests/ first (the script's own folder is sys.path[0])
    _TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:0] = [os.path.dirname(_TESTS), _TESTS]

import argparse
import functools
import json
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from helpers.sync_audit import SyncAudit

INV_DEFAULT = 50  # KFACOptions().inv_update_steps (checked by the test)
EVERY_STEP = dict(factor_update_steps=1, inv_update_steps=1)
SHORT = 8  # steps of the configurations at a short cadence
BATCH = 8


def cnn() -> nn.Module:
    """A 4-layer CNN (2 Conv2d + 2 Linear) on 2x8x8 inputs, 5 classes."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 8, 3, stride=2, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(8 * 4 * 4, 24), nn.Tanh(), nn.Linear(24, 5),
    )


def mlp() -> nn.Module:
    """A 3-layer MLP on 16 features, 5 classes."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 5))


class _Functional(nn.Module):
    """An MLP whose middle layer's weight goes through F.linear, not a module call (function capture)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x.flatten(1)))
        return self.out(torch.relu(F.linear(h, self.mid.weight, self.mid.bias)))


def functional() -> nn.Module:
    torch.manual_seed(0)
    return _Functional()


class _MoE(nn.Module):
    """transformers' Mixtral sparse block (4 experts, top 2, grouped_mm) between two Linears, on 16 features."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        cfg = MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
        cfg._experts_implementation = "grouped_mm"
        self.inp, self.moe, self.out = nn.Linear(16, 16), MixtralSparseMoeBlock(cfg), nn.Linear(16, 5)
        for p in self.moe.parameters():  # (the block allocates them with torch.empty: the model's init fills them)
            nn.init.normal_(p, std=0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x.flatten(1))).unsqueeze(1)
        return self.out(self.moe(h).squeeze(1))


def moe() -> nn.Module:
    torch.manual_seed(0)
    return _MoE()


MODELS = {"cnn": (cnn, (2, 8, 8)), "mlp": (mlp, (16,)), "functional": (functional, (16,)), "moe": (moe, (16,))}

_PROFILE = dict(profile_steps=(1, 3))  # SPD's plan measured on factor steps 1-2 and used from step 3

# One process: name -> (model, KFACPreconditioner keywords, steps, SPDOptions.from_schedule keywords of an
# SPDDistributor without a process group, or None: the preconditioner's own distributor).
LOCAL: dict[str, tuple[str, dict[str, Any], int, dict[str, Any] | None]] = {
    "defaults": ("cnn", {}, 2 * INV_DEFAULT, None),
    "defaults_mlp": ("mlp", {}, 2 * INV_DEFAULT, None),
    "every_step": ("cnn", EVERY_STEP, SHORT, None),
    "eigen": ("cnn", dict(inverse_method="eigen", factor_update_steps=1, inv_update_steps=2), SHORT, None),
    "async": ("cnn", dict(async_inverses=True, factor_update_steps=1, inv_update_steps=2), SHORT, None),
    "spd_1rank_every_step": ("cnn", EVERY_STEP, SHORT, dict(schedule="spd", **_PROFILE)),
    # fp16-style loss scaling (torch.amp.GradScaler on the CPU): the scale must stay on the device
    "grad_scaler": ("cnn", dict(grad_scaler=True, factor_update_steps=1, inv_update_steps=2), SHORT, None),
    # a weight used through F.linear (function capture) and a mixture-of-experts block (expert stacks, grouped_mm)
    "functional_every_step": ("functional", EVERY_STEP, SHORT, None),
    "moe_every_step": ("moe", EVERY_STEP, SHORT, None),
}

# 2 gloo ranks: name -> (SPDOptions.from_schedule keywords, KFACPreconditioner keywords, steps).
RANKED: dict[str, tuple[dict[str, Any], dict[str, Any], int]] = {}
for _s in ("spd", "mpd", "dkfac", "dpkfac"):
    _opts = dict(schedule=_s, **(_PROFILE if _s in ("spd", "dpkfac") else {}))
    RANKED[_s] = (dict(schedule=_s), {}, INV_DEFAULT + 1)  # the defaults' cadence: inverse steps 0 and 50
    RANKED[f"{_s}_every_step"] = (_opts, EVERY_STEP, SHORT)
    RANKED[f"{_s}_async"] = (_opts, dict(async_inverses=True, factor_update_steps=1, inv_update_steps=2), SHORT)

CONFIGS = [*LOCAL, *RANKED]


def batch(shape: tuple[int, ...], step: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(BATCH, *shape, generator=g), torch.randint(0, 5, (BATCH,), generator=g)


def train(model: nn.Module, shape: tuple[int, ...], steps: int, audit: SyncAudit, make_pre: Any,
          rank: int = 0, wrap: Any = None, scaler: torch.amp.GradScaler | None = None) -> None:
    """``steps`` steps of SGD + K-FAC (``pre.step(opt)``: the learning rate from the optimizer, as under
    Lightning), ``audit.step`` advanced at the start of each; the test code's own ``loss.item()`` included.
    With ``scaler``: the loss scaled, the gradients unscaled before ``pre.step``, ``scaler.step/update``."""
    pre = make_pre(model)
    net = wrap(model) if wrap is not None else model
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        audit.step = step
        x, y = batch(shape, step, rank)
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        if scaler is None:
            loss.backward()
            pre.step(opt)
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            pre.step(opt)
            scaler.step(opt)  # (torch's own found-inf read: user code, not counted)
            scaler.update()
        loss.item()  # user code: seen, not counted
    audit.step = steps  # what follows (settling async inverses) belongs to no step
    pre.state_dict()
    pre.remove_hooks()


def run_local(name: str) -> dict[str, Any]:
    """One configuration of :data:`LOCAL` in this process: :meth:`SyncAudit.summary`."""
    from lightning_spdkfac import KFACPreconditioner
    from lightning_spdkfac.comm.scheduler import SPDDistributor, SPDOptions

    model_name, kw, steps, schedule = LOCAL[name]
    factory, shape = MODELS[model_name]
    if schedule is not None:
        kw = dict(kw, distributor=SPDDistributor(SPDOptions.from_schedule(**schedule)))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if kw.get("grad_scaler") else None
    if scaler is not None:
        kw = dict(kw, grad_scaler=scaler)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with SyncAudit() as audit:
            train(factory(), shape, steps, audit, lambda m: KFACPreconditioner(m, **kw), scaler=scaler)
    finally:
        torch.set_num_threads(threads)
    return audit.summary(steps)


def _ranked_pre(model: nn.Module, cls: Any, options: Any, group: Any, kw: dict[str, Any]) -> Any:
    from lightning_spdkfac import KFACPreconditioner

    return KFACPreconditioner(model, distributor=cls(options, process_group=group), **kw)


def run_ranked(rank: int, world: int, names: list[str]) -> dict[str, dict[str, Any]]:
    """On each rank of a ``run_distributed`` job: the configurations ``names`` of :data:`RANKED` in turn."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_spdkfac.comm.dpkfac import DPKFACDistributor
    from lightning_spdkfac.comm.scheduler import SPDDistributor, SPDOptions

    torch.set_num_threads(1)
    out = {}
    for name in names:
        opts, kw, steps = RANKED[name]
        options = SPDOptions.from_schedule(**opts)
        with SyncAudit() as audit:
            group = dist.new_group()
            cls = DPKFACDistributor if options.schedule == "dpkfac" else SPDDistributor

            make = functools.partial(_ranked_pre, cls=cls, options=options, group=group, kw=kw)
            train(cnn(), MODELS["cnn"][1], steps, audit, make, rank, DDP)
        out[name] = audit.summary(steps)
        dist.barrier()
    return out


def measure(names: list[str] | None = None, timeout: float = 240) -> dict[str, list[dict[str, Any]]]:
    """name -> the summaries (one per rank) of the configurations ``names`` (default: all)."""
    from lightning_spdkfac.multiprocess import run_distributed

    names = list(CONFIGS) if names is None else names
    results = {n: [run_local(n)] for n in names if n in LOCAL}
    ranked = [n for n in names if n in RANKED]
    if ranked:
        per_rank = run_distributed(run_ranked, 2, ranked, timeout=timeout)
        for n in ranked:
            results[n] = [r[n] for r in per_rank]
    return results


def table(results: dict[str, list[dict[str, Any]]], top: int = 6) -> str:
    lines = [f"{'configuration':<20} {'rank':>4} {'steps':>5} {'reads/step':>10} {'in hooks':>8} {'max/step':>8} "
             f"{'at step':>7} {'off-thread coll.':>16} {'collectives':>11}"]
    for name, summaries in results.items():
        for rank, s in enumerate(summaries):
            lines.append(f"{name:<20} {rank:>4} {s['steps']:>5} {s['reads_per_step']:>10.2f} {s['in_hook']:>8} "
                         f"{s['max_per_step']:>8} {s['worst_step']!s:>7} {s['off_thread_collectives']:>16} "
                         f"{s['collectives']:>11}")
    lines.append("")
    for name, summaries in results.items():
        for rank, s in enumerate(summaries):
            lines.append(f"{name} (rank {rank}): {s['reads']} reads in {s['steps']} steps, by kind {s['by_kind']}")
            for where, via, kind, thread, in_hook, count in s["top"][:top]:
                lines.append(f"    {count:>5}  {where:<44} <- {via:<44} {kind:<22} {thread:<14} "
                             f"{'IN HOOK' if in_hook else ''}".rstrip())
            for (op, where, thread), count in s["off_thread_top"]:
                lines.append(f"    {count:>5}  {where:<44}    {'':<44} collective {op:<11} {thread:<14} "
                             "OFF THE TRAINING THREAD")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=CONFIGS, metavar="NAME",
                        help=f"configurations to run (default: all): {', '.join(CONFIGS)}")
    parser.add_argument("--top", type=int, default=6, help="source lines shown per configuration and rank")
    parser.add_argument("--json", metavar="PATH", help="also write the summaries as JSON")
    parser.add_argument("--timeout", type=float, default=240, help="bound on the 2-rank job (seconds)")
    args = parser.parse_args(argv)
    results = measure(args.only, args.timeout)
    print(table(results, args.top))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    from helpers import sync_report  # the rank processes import the runner by this module's importable name

    sys.exit(sync_report.main())
