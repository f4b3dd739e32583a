"""Every schedule of issue 19 on the paper's four models, in the cluster simulator: total, lower bound, their
ratio, memory per GPU, and the two targets (best within 10% of its bound; >= 1.4x faster than spd-paper).

Run ``python benchmarks/schedules_64.py`` (about a minute; ``--worlds 64`` or ``--models resnet50`` for less).
The cluster is the paper's network scaled to P (:meth:`~lightning_spdkfac.simulate.paper.PaperCase.at_world`),
so every schedule, spd-paper included, runs under the same network model. Prints tables and writes nothing.

* ``best`` is over the schedules with the numerics the runtime runs or will run (spd-paper, spd, spd-async
  with its period placement, dpkfac, and dpkfac-turns: dpkfac with its broadcasts issued with owners taking
  turns); ``best*`` over all, with spd-dear (factors one step old) and dpkfac-local (factors from the owner's
  data only, an approximation).
* ``vs paper``: spd-paper's total over the schedule's; ``/bound``: total over the schedule's own lower bound.
* DeAR gains where ``spd-dear`` is below ``spd``: the ``dear`` column is spd's total over spd-dear's.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

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
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="8,16,64,256", help="comma-separated GPU counts (default 8,16,64,256)")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    args = ap.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    print(f"{'model':>12s} {'P':>4s} {'schedule':>19s} {'total':>7s} {'bound':>7s} {'/bound':>6s} "
          f"{'vs paper':>8s} {'GiB/GPU':>7s}")
    summary = []
    for model in args.models.split(","):
        for p in worlds:
            res = run(model, p)
            paper = res["spd-paper"][0]
            for s, (total, bound, gib) in res.items():
                print(f"{model:>12s} {p:4d} {s:>19s} {total:7.3f} {bound:7.3f} {total / bound:6.3f} "
                      f"{paper / total:7.2f}x {gib:7.2f}")
            best = min(EXACT, key=lambda s: res[s][0])
            best_all = min(SCHEDULES, key=lambda s: res[s][0])
            summary.append((model, p, best, res[best], best_all, res[best_all], paper, res["spd"][0] / res["spd-dear"][0]))
    print(f"\n{'model':>12s} {'P':>4s} {'best':>13s} {'/bound':>6s} {'vs paper':>8s} {'best*':>19s} {'/bound':>6s} "
          f"{'vs paper':>8s} {'dear':>6s}")
    for model, p, best, (t, b, _), best_all, (ta, ba, _), paper, dear in summary:
        print(f"{model:>12s} {p:4d} {best:>13s} {t / b:6.3f} {paper / t:7.2f}x {best_all:>19s} {ta / ba:6.3f} "
              f"{paper / ta:7.2f}x {dear:5.3f}x")
    print("targets at 64 GPUs: /bound <= 1.10 and vs paper >= 1.40; dear > 1 means spd-dear is faster than spd")
    return 0


if __name__ == "__main__":
    sys.exit(main())
