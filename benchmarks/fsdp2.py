"""K-FAC under FSDP2 (``fully_shard``, owner-based) against K-FAC under DDP (the default schedule, ``spd``): the K-FAC
state each rank holds, and the training step's time.

On 2 gloo CPU ranks (``lightning_spdkfac.multiprocess.run_distributed``, 1 thread each), a GPT-2 of width 768 (12
heads, ``--blocks`` blocks, a ``--vocab``-token vocabulary, tied head: ``transformers`` builds it offline from its
config, random weights) trains with SGD and K-FAC at the library defaults (factors every 5 steps, inverses every 50),
each rank on its own ``--batch`` x ``--tokens`` random tokens per step, in two copies from the same weights:

- ``ddp``: ``DistributedDataParallel`` and ``KFACPreconditioner(distributor=SPDDistributor(spd))``, every rank
  holding every layer's factors and inverses;
- ``fsdp2``: ``fully_shard`` on every block and the root, ``KFACPreconditioner`` built after it (owner-based: each
  layer's factors reduced to and inverted by one rank, its gradient rows gathered there).

Memory: after the run, the summary's K-FAC bytes per rank between steps (``summary().total_bytes``) and the bytes
the layers' tensors hold (accumulators, factors, inverses: they must agree), and the ratio fsdp2/ddp (target <= 0.6).

Time: a training step (forward, backward, ``pre.step``, ``opt.step``, after a barrier) of each kind -- plain
(precondition only), factor (+ the factors, every 5th) and inverse (+ factors and inverses, every 50th), set by the
step index as benchmarks/hf_models.py does -- timed on rank 0 in ``--reps`` interleaved repeats of all six
(variant, kind) pairs, after the first inverse step and ``--warmup`` factor steps each; the step at the defaults
amortized as (40 plain + 9 factor + 1 inverse) / 50 from the medians, and the ratio fsdp2/ddp (target <= 1.25). A
full inverse period per repeat would take minutes per step kind on a shared 2-core machine. The spread across seeds
(each a fresh model and data) and across repeats (min-max of each kind) is printed and saved.

    python benchmarks/fsdp2.py                    # writes benchmarks/results/run-<stamp>-fsdp2/fsdp2.json
    python benchmarks/fsdp2.py --out DIR          # writes DIR/fsdp2.json
    python benchmarks/fsdp2.py --quick            # width 64, 1 repeat: seconds
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings
from typing import Any

import torch
from _common import bench_parser, env_info, interleave, out_dir, parse, print_table, save_json, spread

from lightning_spdkfac.multiprocess import run_distributed

VARIANTS = ("ddp", "fsdp2")


def held_bytes(pre: Any) -> int:
    """The K-FAC bytes the layers hold, from their tensors: accumulators, running factors, inverses."""
    total = 0
    for layer in pre.layers.values():
        for name in ("xx", "x_sum", "dd", "group_rows", "A", "G", "A_inv", "G_inv"):
            t = getattr(layer, name)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def _gpt2(cfg: dict, seed: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=cfg["blocks"], n_embd=cfg["width"], n_head=max(1, cfg["width"] // 64),
                                     n_positions=max(cfg["tokens"], 64), vocab_size=cfg["vocab"], resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def _step(runs: dict[str, Any], opts_by: dict[str, Any], ids: list[torch.Tensor], name: str, k: int) -> Any:
    """One training step of ``name`` at cadence position ``k`` (k % 5 == 0 collects factors, k % 50 == 0 inverts too:
    the library defaults), timed on this rank after a barrier."""
    import torch.distributed as dist

    model, net, pre = runs[name]
    opt = opts_by[name]

    def run() -> float:
        batch = ids[k % len(ids)]
        dist.barrier()
        t0 = time.perf_counter()
        pre.steps = k  # (the step index only sets the cadence; the schedules count their own factor steps)
        opt.zero_grad(set_to_none=True)
        net(input_ids=batch, labels=batch).loss.backward()
        pre.step(opt)
        opt.step()
        return time.perf_counter() - t0
    return run


def rank_main(rank: int, world: int, cfg: dict) -> dict:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_spdkfac.comm.scheduler import SPDDistributor
    from lightning_spdkfac.comm.spd_options import SPDOptions
    from lightning_spdkfac.kfac import KFACPreconditioner

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    out: dict[str, Any] = {"seeds": []}
    for seed in cfg["seeds"]:
        ddp_model = _gpt2(cfg, seed)
        sharded = _gpt2(cfg, seed)
        for block in sharded.transformer.h:
            fully_shard(block)
        fully_shard(sharded)
        runs = {
            "ddp": (ddp_model, DDP(ddp_model), KFACPreconditioner(ddp_model, distributor=SPDDistributor(
                SPDOptions.from_schedule("spd"), process_group=dist.new_group()))),
            "fsdp2": (sharded, sharded, KFACPreconditioner(sharded)),
        }
        g = torch.Generator().manual_seed(1000 * seed + rank)
        ids = [torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["tokens"]), generator=g) for _ in range(4)]
        opts = runs["ddp"][2].options

        opts_by = {name: torch.optim.SGD(runs[name][0].parameters(), lr=1e-3) for name in VARIANTS}
        period, every = opts.inv_update_steps, opts.factor_update_steps
        kinds = {"plain": 1, "factor": every, "inverse": period}
        for name in VARIANTS:  # warm-up: the first factors and inverses, then past spd's profiling window
            _step(runs, opts_by, ids, name, 0)()
            for _ in range(cfg["warmup"]):
                _step(runs, opts_by, ids, name, every)()
        calls = {f"{name}_{kind}": _step(runs, opts_by, ids, name, k) for kind, k in kinds.items() for name in VARIANTS}
        times = interleave(calls, cfg["reps"], order="rotate", label=f"  seed {seed} rep", progress=rank == 0)
        n_factor = period // every
        amortized = {name: ((period - n_factor) * statistics.median(times[f"{name}_plain"])
                            + (n_factor - 1) * statistics.median(times[f"{name}_factor"])
                            + statistics.median(times[f"{name}_inverse"])) / period for name in VARIANTS}
        entry: dict[str, Any] = {"seed": seed, "times": times, "amortized_s": amortized}
        for name, (_, _, pre) in runs.items():
            summary = pre.summary()
            entry[f"{name}_summary_bytes"] = summary.total_bytes
            entry[f"{name}_held_bytes"] = held_bytes(pre)
            entry[f"{name}_steps"] = pre.steps
            pre.remove_hooks()
        entry["fsdp2_summary_line"] = str(summary).splitlines()[-1] if summary.sharding else ""
        entry["fsdp2_memory_line"] = next(x for x in str(summary).splitlines() if x.startswith("K-FAC memory"))
        entry["params"] = sum(p.numel() for p in ddp_model.parameters())
        out["seeds"].append(entry)
        del runs, calls
    return out


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser(__doc__, reps=3, reps_flags=("--reps",),
                          out="folder for fsdp2.json (default: a fresh benchmarks/results/run-* folder)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--blocks", type=int, default=2, help="GPT-2 blocks (default 2)")
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank per step (default 2)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per sequence (default 64)")
    parser.add_argument("--warmup", type=int, default=8,
                        help="factor steps before timing (default 8: past spd's profiling window, factor steps 3-7)")
    args = parse(parser, argv, quick={"width": 64, "reps": 1, "seeds": [0], "warmup": 1, "vocab": 100})
    world = 2
    cfg = dict(seeds=args.seeds, width=args.width, blocks=args.blocks, vocab=args.vocab, batch=args.batch,
               tokens=args.tokens, warmup=args.warmup, reps=args.reps)
    load_before = os.getloadavg()
    t0 = time.time()
    import fsdp2  # run_distributed pickles the ranks' function by reference: not from __main__

    results = run_distributed(fsdp2.rank_main, world, cfg, timeout=3600)
    load_after = os.getloadavg()
    rows = []
    for entry in results[0]["seeds"]:
        seed = entry["seed"]
        row: dict[str, Any] = dict(seed=seed)
        for rank, got in enumerate(results):
            e = next(x for x in got["seeds"] if x["seed"] == seed)
            for name in VARIANTS:
                assert e[f"{name}_summary_bytes"] == e[f"{name}_held_bytes"], (rank, name, e)
            row[f"ddp_MB_{rank}"] = e["ddp_summary_bytes"] / 1e6
            row[f"fsdp2_MB_{rank}"] = e["fsdp2_summary_bytes"] / 1e6
        row["mem_ratio"] = max(row[f"fsdp2_MB_{r}"] for r in range(world)) / row["ddp_MB_0"]
        for name in VARIANTS:
            row[f"{name}_ms"] = 1e3 * entry["amortized_s"][name]
            for kind in ("plain", "factor", "inverse"):
                ms = spread(entry["times"][f"{name}_{kind}"], 1e3)
                row[f"{name}_{kind}_ms"] = ms["median"]
                row[f"{name}_{kind}_spread"] = f"{ms['min']:.0f}-{ms['max']:.0f}"
        row["time_ratio"] = row["fsdp2_ms"] / row["ddp_ms"]
        rows.append(row)
    e0 = results[0]["seeds"][0]
    print(f"GPT-2 width {args.width}, {args.blocks} blocks, vocabulary {args.vocab} ({e0['params'] / 1e6:.1f} M "
          f"parameters), {world} gloo CPU ranks x 1 thread, {args.batch} x {args.tokens} tokens per rank per step; "
          f"K-FAC at the defaults; per seed {args.reps} interleaved repeats of each kind of step (after {args.warmup} "
          "factor steps); ms per step on rank 0, amortized (40 plain + 9 factor + 1 inverse) / 50 from the "
          "medians, each kind's median [min-max] beside; K-FAC MB per rank from the summary (= the layers' tensors)")
    print_table(rows, [
        ("seed", "seed", "d"), ("ddp_MB_0", "DDP MB r0", ".1f"), ("ddp_MB_1", "DDP MB r1", ".1f"),
        ("fsdp2_MB_0", "FSDP2 MB r0", ".1f"), ("fsdp2_MB_1", "FSDP2 MB r1", ".1f"),
        ("mem_ratio", "memory ratio (max rank)", ".2f"), ("ddp_ms", "DDP ms", ".0f"), ("fsdp2_ms", "FSDP2 ms", ".0f"),
        ("time_ratio", "time ratio", ".2f"),
    ])
    print_table(rows, [("seed", "seed", "d")] + [
        (f"{name}_{kind}_{col}", f"{label} {kind} {'ms' if col == 'ms' else '[min-max]'}", ".0f" if col == "ms" else "s")
        for name, label in (("ddp", "DDP"), ("fsdp2", "FSDP2")) for kind in ("plain", "factor", "inverse")
        for col in ("ms", "spread")])
    ratios = [r["time_ratio"] for r in rows]
    mems = [r["mem_ratio"] for r in rows]
    print(f"time ratio FSDP2/DDP over seeds: median {statistics.median(ratios):.2f} (range {min(ratios):.2f}-"
          f"{max(ratios):.2f}); memory ratio {min(mems):.2f}-{max(mems):.2f} (targets <= 1.25 and <= 0.6)")
    print(f"rank 0's summary: {e0['fsdp2_memory_line']}")
    print(f"load average (1, 5, 15 min) before {load_before}, after {load_after}; {time.time() - t0:.0f} s")
    save_json(out_dir(args, "fsdp2"), "fsdp2.json",
              dict(command=" ".join(sys.argv), env=env_info(), world=world, config=cfg, load_before=load_before,
                   load_after=load_after, rows=rows, raw=[r["seeds"] for r in results]))


if __name__ == "__main__":
    main()
