"""The ZeRO 1/2 gradient gather of the K-FAC layers: the old zero-padded all-reduce against the all-gather.

On 2 gloo CPU ranks (``lightning_spdkfac.multiprocess.run_distributed``), for a few MLP sizes, a real
DeepSpeed ZeRO-2 engine (fp32) runs one backward; then, interleaved in one invocation (the order of
the variants alternates from repeat to repeat, a barrier before each call), each variant assembles
the full gradients of every linear layer:

- ``allreduce``: the previous fused gather, one all-reduce of a full-size buffer in which each rank
  filled in its fragments (zeros elsewhere);
- ``allgather``: ``DeepSpeedGradAccess``'s gather now, each rank's partition (padded to the largest)
  sent once, on gloo as one broadcast per rank; its layout exchanged once beforehand and reused;
- ``gloo_allgather``: the same with gloo's ``all_gather_single`` in place of the broadcasts;
- ``each``: ``deepspeed.utils.safe_get_full_grad`` per parameter (the fallback path).

Every variant's result is checked bitwise against ``safe_get_full_grad`` before timing. Prints per
size the bytes each rank sends (computed: a ring all-reduce sends 2(W-1)/W of the buffer, an
all-gather (W-1) chunks), the median ms of a call on rank 0 with its spread (q1-q3), and the ratios
allgather/allreduce.

    python benchmarks/zero_gather.py                   # writes benchmarks/results/run-<stamp>-zero_gather/
    python benchmarks/zero_gather.py --out DIR         # writes DIR/zero_gather.json
    python benchmarks/zero_gather.py --quick           # width 64, 2 repeats (seconds, after DeepSpeed's start)
"""

from __future__ import annotations

import functools
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
from _common import bench_parser, env_info, interleave, mlp, out_dir, parse, print_table, save_json, spread
from torch import nn

from lightning_spdkfac.lightning import deepspeed_grads as ds_module  # where the fused gather lives
from lightning_spdkfac.lightning.deepspeed import DeepSpeedGradAccess
from lightning_spdkfac.multiprocess import run_distributed

VARIANTS = ("allreduce", "allgather", "gloo_allgather", "each")


def _gloo_allgather(output: torch.Tensor, group: dist.ProcessGroup) -> None:
    rank, size = dist.get_rank(group), output.numel() // dist.get_world_size(group)
    dist.all_gather_single(output, output.narrow(0, rank * size, size), group=group)


def with_gloo_allgather(access: DeepSpeedGradAccess, params: list) -> dict | None:
    """The library's gather with gloo's own all-gather in place of its broadcasts (why it broadcasts)."""
    saved = ds_module._all_gather
    ds_module._all_gather = _gloo_allgather
    try:
        return access._gather_fused(params)
    finally:
        ds_module._all_gather = saved


def allreduce_gather(params: list) -> dict:
    """The gather before the all-gather: a zero-padded full buffer, each rank's fragments, one all-reduce."""
    numels = [p.numel() for p in params]
    buf = torch.zeros(sum(numels), dtype=torch.float32, device=params[0].device)
    views = buf.split(numels)
    for p, view in zip(params, views):
        mapping = p._hp_mapping
        if mapping is None:
            continue
        fragment = mapping.get_lp_grad_fragment(p._index_in_param_group).to(torch.float32).flatten()
        address = mapping.lp_fragment_address
        if fragment.numel() == p.numel():
            fragment = fragment.narrow(0, address.start, address.numel)
        view.narrow(0, address.start, address.numel).copy_(fragment)
    dist.all_reduce(buf, group=params[0]._dp_group)
    return {p: view.view(p.shape) for p, view in zip(params, views)}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().view(torch.int32)


def rank_main(rank: int, world: int, widths: list[int], depth: int, repeats: int) -> dict:
    import argparse as ap

    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    warnings.filterwarnings("ignore")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    deepspeed.init_distributed("gloo")
    out = []
    for width in widths:
        torch.manual_seed(0)
        model = mlp(*[width] * (depth + 1), 10, act=nn.Tanh)
        engine, *_ = deepspeed.initialize(
            args=ap.Namespace(device_rank=-1), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            config=dict(train_micro_batch_size_per_gpu=16, zero_optimization=dict(stage=2),
                        zero_allow_untested_optimizer=True),
        )
        x = torch.randn(16, width, generator=torch.Generator().manual_seed(rank))
        engine.backward(engine(x).square().mean())
        params = list(model.parameters())
        access = DeepSpeedGradAccess(functools.partial(lambda e: e, engine))
        calls = {
            "allreduce": functools.partial(allreduce_gather, params),
            "allgather": functools.partial(access._gather_fused, params),
            "gloo_allgather": functools.partial(with_gloo_allgather, access, params),
            "each": functools.partial(DeepSpeedGradAccess._gather_each, params),
        }
        reference = {p: safe_get_full_grad(p) for p in params}
        for name, call in calls.items():
            got = call()
            assert got is not None and all(torch.equal(_bits(got[p]), _bits(reference[p])) for p in params), name
        plan = access._cached_plan(params)
        assert plan is not None

        def after_barrier(call):
            def timed() -> float:
                dist.barrier()
                t0 = time.perf_counter()
                call()
                return time.perf_counter() - t0
            return timed

        times = interleave({name: after_barrier(calls[name]) for name in VARIANTS}, repeats, order="alternate",
                           progress=rank == 0)
        n = sum(p.numel() for p in params)
        out.append(dict(width=width, depth=depth, params=n, layers=len(params) // 2, chunk=plan.chunk, runs=len(plan.runs),
                        times=times))
        engine.step()
        engine.destroy()
    return dict(sizes=out)


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser(__doc__, reps=30, reps_flags=("--repeats", "--reps"),
                          out="folder for zero_gather.json (default: a fresh benchmarks/results/run-* folder)")
    parser.add_argument("--widths", type=int, nargs="+", default=[128, 512, 1536])
    parser.add_argument("--depth", type=int, default=4)
    args = parse(parser, argv, quick={"widths": [64], "reps": 2, "depth": 2})
    world = 2
    load_before = os.getloadavg()
    t0 = time.time()
    import zero_gather  # run_distributed pickles the ranks' function by reference: not from __main__

    results = run_distributed(zero_gather.rank_main, world, args.widths, args.depth, args.reps, timeout=3600)
    load_after = os.getloadavg()
    rows = []
    for size in results[0]["sizes"]:
        n, chunk = size["params"], size["chunk"]
        sent = {"allreduce": 2 * (world - 1) / world * n * 4, "allgather": (world - 1) * chunk * 4,
                "gloo_allgather": (world - 1) * chunk * 4, "each": 2 * (world - 1) / world * n * 4}
        row = dict(width=size["width"], params=n, layers=size["layers"], runs=size["runs"])
        for name in VARIANTS:
            ms = spread(size["times"][name], 1e3)
            row.update({f"{name}_ms": ms["median"], f"{name}_q1": ms["q1"], f"{name}_q3": ms["q3"],
                        f"{name}_MB": sent[name] / 1e6, f"{name}_spread": f"{ms['q1']:.3f}-{ms['q3']:.3f}"})
        row["ratio_ms"] = row["allgather_ms"] / row["allreduce_ms"]
        row["ratio_bytes"] = sent["allgather"] / sent["allreduce"]
        rows.append(row)
    print(f"ZeRO-2 fp32, {world} gloo CPU ranks, {args.depth + 1} linear layers, {args.reps} interleaved repeats; "
          f"median ms of one gather on rank 0 [q1-q3]; MB each rank sends (computed, ring)")
    print_table(rows, [
        ("params", "params", "d"), ("allreduce_MB", "allreduce MB", ".3f"), ("allgather_MB", "allgather MB", ".3f"),
        ("ratio_bytes", "bytes ratio", ".2f"), ("allreduce_ms", "allreduce ms", ".3f"),
        ("allreduce_spread", "[q1-q3]", "s"), ("allgather_ms", "allgather ms", ".3f"),
        ("allgather_spread", "[q1-q3]", "s"), ("ratio_ms", "time ratio", ".2f"),
        ("gloo_allgather_ms", "gloo all_gather ms", ".3f"), ("each_ms", "per-param ms", ".3f"),
    ])
    print(f"load average (1, 5, 15 min) before {load_before}, after {load_after}; {time.time() - t0:.0f} s")
    save_json(out_dir(args, "zero_gather"), "zero_gather.json",
              dict(command=" ".join(sys.argv), env=env_info(), world=world, load_before=load_before,
                   load_after=load_after, rows=rows, raw=results[0]["sizes"]))


if __name__ == "__main__":
    main()
