"""Every benchmark's ``--quick`` mode runs, as a user runs it, so that none breaks unseen (issue 28).

Each script in benchmarks/ runs in a subprocess of its own session (its ranks are killed with it, whatever
happens) with ``--quick --out <tmp>``, and must exit 0 and write its results into that folder. The quick
modes do the smallest meaningful thing: the same code paths, tiny models, one or two repeats. Not here:
gpu_check.py (tests/test_gpu_check.py and ``make gpu-check-dry``).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time

import pytest
from helpers.processes import REPO, clean_env, finish_cli

BENCHMARKS = REPO / "benchmarks"
NOT_HERE = {"gpu_check"}  # covered elsewhere (docstring)
# script -> (a file its quick run must write into --out, the module it needs or None)
QUICK = {
    "async_inverses": ("async_inverses.json", None),
    "async_placement": ("async_placement.json", None),
    "damping_conventions": ("damping_conventions.jsonl", None),
    "factor_approx": ("factor_approx.json", None),
    "fsdp2": ("fsdp2.json", "transformers"),
    "hf_models": ("results.json", "transformers"),
    "iteration_time": ("iteration_time.json", None),
    "overhead": ("overhead.json", None),
    "paper_table": ("paper_table.json", None),
    "schedules_64": ("schedules_64.json", None),
    "soak": ("soak.json", None),
    "telemetry_overhead": ("summary.json", None),
    "telemetry_plot": ("telemetry.png", None),
    "threads": ("threads.json", None),
    "time_to_accuracy": ("time_to_target.png", None),
    "timeline": ("timeline.png", None),
    "zero_gather": ("zero_gather.json", "deepspeed"),
}
TIMEOUT = 600  # s: a quick run takes seconds on an idle 2-core machine, a minute or two on a loaded one
# Every quick run is a subprocess that imports torch (most also Lightning), 5-35 s each on this 2-core machine and
# over 50 s for two gloo ranks (iteration_time, timeline), DeepSpeed's start (zero_gather) and the simulator's four
# calibrated cases (paper_table): together about 1.5-4 minutes, which `make test` (under 10 minutes) cannot take.
# So they all run in `make test-slow`, which CI runs after `make test`; the coverage check above stays in both.
SLOW = set(QUICK)


def test_every_benchmark_script_has_a_quick_run_here():
    scripts = {p.stem for p in BENCHMARKS.glob("*.py") if not p.stem.startswith("_")}
    assert scripts - NOT_HERE == set(QUICK)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in sorted(QUICK)])
def test_quick_mode_runs_and_writes_its_results(name, tmp_path):
    wrote, needs = QUICK[name]
    if needs and importlib.util.find_spec(needs) is None:
        pytest.skip(f"{needs} is not installed")
    out = tmp_path / "out"
    env = {**clean_env(), "PYTHONPATH": str(REPO)}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(BENCHMARKS / f"{name}.py"), "--quick", "--out", str(out)],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    done = finish_cli(proc, TIMEOUT)  # fails the test past TIMEOUT; no rank outlives it either way
    stdout, stderr = done.stdout, done.stderr
    assert proc.returncode == 0, f"{name} --quick exited {proc.returncode}:\n{stdout[-3000:]}\n{stderr[-3000:]}"
    assert (out / wrote).is_file(), f"{name} --quick wrote {sorted(p.name for p in out.iterdir())}, not {wrote}"
    print(f"{name} --quick: {time.perf_counter() - t0:.1f} s")
