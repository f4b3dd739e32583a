"""What a placement planned for asynchronous inverses could give, in the cluster simulator (issue 17).

Run ``python benchmarks/async_placement.py`` (about 30 s; ``--worlds 8,64``). ``spd``'s placement
(``lbp_channel``) chooses how many of the largest factors to own by the end of a *synchronous* inversion
phase, where inversions and broadcasts start together after the gradient all-reduce. With async inverses
(``spd-async``) the inversions come before the next forward and their broadcasts use the channel while it
is idle during forward/backward, so that choice is no longer the best one. This script keeps
``lbp_channel``'s candidates (``owned_prefix_candidates``: the ``k`` largest factors by owner cost owned,
assigned by LPT, the rest replicated; ``k = 0 .. F``) and picks ``k`` by the simulated async period instead. Since issue 19 this is
``spd-async``'s own placement in the simulator (``simulate.schedules.async_plan``); the ``spd-async`` column here is
``spd-async-sync-placement``, the runtime's lbp_channel placement. The runtime has no such planner.
Prints a table; ``--out DIR`` also writes DIR/async_placement.json; ``--quick``: ResNet-50 at 8 GPUs.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from _common import bench_parser, parse, print_table, save_json

from lightning_spdkfac.schedule.placement import owned_prefix_candidates
from lightning_spdkfac.simulate import Cluster, Workload, simulate
from lightning_spdkfac.simulate.paper import PAPER_WORLD, paper_case

MODELS = ("resnet50", "resnet152", "densenet201", "inception_v4")


def best_async(work: Workload, cluster: Cluster) -> tuple[float, int]:
    """The shortest spd-async period over the candidates, and its k."""
    sides = simulate(work, cluster, "spd", rank_events=0).extra["sides"]
    runs = [(simulate(work, cluster, "spd-async", rank_events=0, placement=p).total, k)
            for k, p in enumerate(owned_prefix_candidates(sides, cluster.world_size, cluster.inverse, cluster.broadcast))]
    return min(runs)


def main(argv: Sequence[str] | None = None) -> int:
    ap = bench_parser(__doc__, out="folder for async_placement.json (default: print only)")
    ap.add_argument("--worlds", default=str(PAPER_WORLD), help="comma-separated GPU counts (default 64)")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    args = parse(ap, argv, quick={"worlds": "8", "models": "resnet50"})
    rows = []
    for name in args.models.split(","):
        case = paper_case(name)
        for p in (int(w) for w in args.worlds.split(",")):
            work, cluster = (case.workload, case.cluster) if p == PAPER_WORLD else case.at_world(p)
            spd, spd_async = (simulate(work, cluster, s, rank_events=0) for s in ("spd", "spd-async-sync-placement"))
            period, k = best_async(work, cluster)
            rows.append({"model": name, "P": p, "spd": spd.total, "spd-async": spd_async.total, "planned": period,
                         "k/F": f"{k}/{len(spd.order)}", "bound": spd_async.lower_bound})
    print_table(rows, [("model", "model", "s"), ("P", "P", "d"), ("spd", "spd", ".3f"),
                       ("spd-async", "spd-async", ".3f"), ("planned", "planned", ".3f"), ("k/F", "k/F", "s"),
                       ("bound", "bound", ".3f")])
    print("planned: spd-async with the lbp_channel candidate of shortest async period (k factors owned of F); "
          "bound: Timeline.lower_bound of spd-async")
    if args.out:
        save_json(args.out, "async_placement.json", {"args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
