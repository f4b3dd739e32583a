"""Issue 37 on the four small workloads: every K-FAC phase row's time and epochs to the target, from the results.json
files that ``run_all.sh`` (beside this file) wrote, one folder per workload.

    python benchmarks/results/tta_2026-11-28_issue37_six/summarize.py

Per row: how many of the 3 seeds reached the target, the median CPU seconds to it [min-max] (a seed that never
reaches it counts as infinite), the median epochs to it, the median CPU seconds per epoch (validation included) and
the ratio of the median time to the best tuned baseline's re-run beside it (the harness's ratio). The last column is
issue 37's item-3 check, in epochs: every seed reaches the target, and the median epochs are at most those of the
row's base optimizer re-run beside it ("-" where that optimizer was not re-run).
"""
import glob
import json
import os
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))
INF = float("inf")


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else INF


def fmt(x: float, nd: int = 2) -> str:
    return "-" if x == INF else f"{x:.{nd}f}"


def main() -> None:
    for path in sorted(glob.glob(os.path.join(HERE, "*", "results.json"))):
        w = json.load(open(path))["workloads"][0]
        rows: dict[str, list[dict]] = {}
        for r in w["runs"]:
            tag = r.get("tag", "")
            if tag.startswith("rerun") or tag.startswith("kfac"):
                rows.setdefault(f"{tag} ({r['optimizer']} {r['lr']:g})", []).append(r)
        best = w["best_overall"]
        ref_key = next(k for k in rows if k.startswith(f"rerun {best['optimizer']} "))
        ref = med([r["seconds_to_target"] if r["reached"] else INF for r in rows[ref_key]])
        ref_ep = med([r["epoch_to_target"] if r["reached"] else INF for r in rows[ref_key]])
        base_ep = {k.split()[1]: med([r["epoch_to_target"] if r["reached"] else INF for r in rs])
                   for k, rs in rows.items() if k.startswith("rerun ")}
        print(f"== {w['workload']}: {w['monitor']} {'>=' if w['mode'] == 'max' else '<='} {w['target']}, "
              f"best tuned baseline {best['optimizer']} lr {best['lr']:g} (re-run: {fmt(ref)} s, {fmt(ref_ep, 0)} epochs)")
        print(f"{'row':<40} reached  {'median s [min-max]':>22}  epochs  s/epoch  ratio  epochs <= base's")
        for key, rs in rows.items():
            secs = [r["seconds_to_target"] if r["reached"] else INF for r in rs]
            eps = [r["epoch_to_target"] if r["reached"] else INF for r in rs]
            ok = [s for s in secs if s != INF]
            per_epoch = med([r["history"][-1]["cpu_seconds"] / r["history"][-1]["epoch"] for r in rs if r["history"]])
            span = f"{fmt(med(secs))} [{fmt(min(ok))}-{fmt(max(ok))}]" if ok else "-"
            base = base_ep.get(rs[0]["optimizer"])
            verdict = "-" if base is None else "yes" if len(ok) == len(rs) and med(eps) <= base else "no"
            print(f"{key:<40} {len(ok)}/{len(rs):<5}  {span:>22}  {fmt(med(eps), 1):>6}  {per_epoch:>7.3f}  "
                  f"{med(secs) / ref:>5.2f}  {verdict}")
        print()


if __name__ == "__main__":
    main()
