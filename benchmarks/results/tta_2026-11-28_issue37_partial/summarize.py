"""Print the reduced issue-37 runs of this folder: per run, the CPU seconds a step (the last validation's CPU seconds
over its step count, validation included), the final metric, and the CPU seconds and step at which the target was
first reached. gpt2_long's target is AdamW's final val loss (the only AdamW lr run: the sweep's tuned AdamW).

    python benchmarks/results/tta_2026-11-28_issue37_partial/summarize.py
"""
import glob
import json
import math
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def runs(pattern: str) -> list[dict]:
    out = []
    for path in sorted(glob.glob(os.path.join(HERE, pattern))):
        with open(path) as f:
            out += [json.loads(line) for line in f if line.strip()]
    return out


def show(name: str, rs: list[dict], monitor: str, target: float, mode: str) -> None:
    print(f"== {name}: target {monitor} {'>=' if mode == 'max' else '<='} {target:.4f}")
    for r in rs:
        h = r["history"]
        hit = next((x for x in h if (x[monitor] >= target if mode == "max" else x[monitor] <= target)), None)
        per_step = h[-1]["cpu_seconds"] / h[-1]["step"] if h else math.nan
        print(f"  {r['tag']:<22} {r['optimizer']:<6} lr {r['lr']:<7g} steps {h[-1]['step'] if h else 0:>4}  "
              f"CPU s/step {per_step:.3f}  final {r['final_metric']:.4f}  "
              + (f"target at step {hit['step']}, {hit['cpu_seconds']:.1f} CPU s" if hit else "target not reached"))


if __name__ == "__main__":
    g = runs("gpt2_long_baselines/runs.jsonl") + runs("gpt2_long_kfac_runs.jsonl")
    adamw = [r for r in g if r["tag"] == "sweep adamw"]
    if adamw:
        show("gpt2_long", g, "val_loss", min(r["final_metric"] for r in adamw), "min")
    rn = runs("resnet18w/runs.jsonl")
    if rn:
        show("resnet18w", rn, "val_acc", 0.97, "max")
