"""Every schedule of issue 19 on the paper's four models, in the cluster simulator: total, lower bound, their
ratio, memory per GPU, and the two targets (best within 10% of its bound; >= 1.4x faster than spd-paper).

Run ``python benchmarks/schedules_64.py`` (about a minute; ``--worlds 64`` or ``--models resnet50`` for less).
The cluster is the paper's network scaled to P (:meth:`~lightning_spdkfac.simulate.paper.PaperCase.at_world`),
so every schedule, spd-paper included, runs under the same network model. Prints tables; ``--out DIR`` also
writes DIR/schedules_64.json; ``--quick``: ResNet-50 at 8 GPUs.

* ``best`` is over the schedules with the numerics the runtime runs or will run (spd-paper, spd, spd-async
  with its period placement, dpkfac, and dpkfac-turns: dpkfac with its broadcasts issued with owners taking
  turns); ``best*`` over all, with spd-dear (factors one step old) and dpkfac-local (factors from the owner's
  data only, an approximation).
* ``vs paper``: spd-paper's total over the schedule's; ``/bound``: total over the schedule's own lower bound.
* DeAR gains where ``spd-dear`` is below ``spd``: the ``dear`` column is spd's total over spd-dear's.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from _common import bench_parser, parse, print_table, save_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from lightning_spdkfac.simulate import simulate  # noqa: E402
from lightning_spdkfac.simulate.dpkfac import memory_per_gpu  # noqa: E402
from lightning_spdkfac.simulate.paper import PAPER_WORLD, paper_case  # noqa: E402

MODELS = ("resnet50", "resnet152", "densenet201", "inception_v4")
SCHEDULES = ("spd-paper", "spd", "spd-async", "spd-dear", "dpkfac", "dpkfac-turns", "dpkfac-local")
EXACT = ("spd-paper", "spd", "spd-async", "dpkfac", "dpkfac-turns")


def run(model: str, world: int) -> dict[str, tuple[float, float, float]]:
    """``schedule -> (total s, lower bound s, GiB per GPU)``."""
    case = paper_case(model)
    work, cluster = (case.workload, case.cluster) if world == PAPER_WORLD else case.at_world(world)
    out = {}
    for s in SCHEDULES:
        tl = simulate(work, cluster, s, rank_events=0)
        out[s] = (tl.total, tl.lower_bound, memory_per_gpu(work, tl)["total"] / 2**30)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = bench_parser(__doc__, out="folder for schedules_64.json (default: print only)")
    ap.add_argument("--worlds", default="8,16,64,256", help="comma-separated GPU counts (default 8,16,64,256)")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    args = parse(ap, argv, quick={"worlds": "8", "models": "resnet50"})
    rows, summary = [], []
    for model in args.models.split(","):
        for p in (int(w) for w in args.worlds.split(",")):
            res = run(model, p)
            paper = res["spd-paper"][0]
            rows += [{"model": model, "P": p, "schedule": s, "total": total, "bound": bound, "/bound": total / bound,
                      "vs paper": f"{paper / total:.2f}x", "GiB/GPU": gib} for s, (total, bound, gib) in res.items()]
            best = min(EXACT, key=lambda s: res[s][0])
            best_all = min(SCHEDULES, key=lambda s: res[s][0])
            summary.append({"model": model, "P": p, "best": best, "best/bound": res[best][0] / res[best][1],
                            "best vs paper": f"{paper / res[best][0]:.2f}x", "best*": best_all,
                            "best*/bound": res[best_all][0] / res[best_all][1],
                            "best* vs paper": f"{paper / res[best_all][0]:.2f}x",
                            "dear": f"{res['spd'][0] / res['spd-dear'][0]:.3f}x"})
    print_table(rows, [("model", "model", "s"), ("P", "P", "d"), ("schedule", "schedule", "s"), ("total", "total", ".3f"),
                       ("bound", "bound", ".3f"), ("/bound", "/bound", ".3f"), ("vs paper", "vs paper", "s"),
                       ("GiB/GPU", "GiB/GPU", ".2f")])
    print()
    print_table(summary, [("model", "model", "s"), ("P", "P", "d"), ("best", "best", "s"),
                          ("best/bound", "/bound", ".3f"), ("best vs paper", "vs paper", "s"), ("best*", "best*", "s"),
                          ("best*/bound", "/bound", ".3f"), ("best* vs paper", "vs paper", "s"), ("dear", "dear", "s")])
    print("targets at 64 GPUs: /bound <= 1.10 and vs paper >= 1.40; dear > 1 means spd-dear is faster than spd")
    if args.out:
        save_json(args.out, "schedules_64.json", {"args": vars(args), "rows": rows, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
