"""benchmarks/gpu_check.py without a GPU: its dry mode (every benchmark section builds its models at tiny size, steps
each configuration once on the CPU, probes two of them and writes the report), the refusal of a real run without
CUDA, the pieces a GPU run relies on that run on a CPU too (the sync counter, the phase table of a profile, the
wheels folder, the Makefile's no-install command), so the GPU check cannot rot between the runs on a GPU.
(`make gpu-check-dry`, which CI runs, adds the collection of the cuda tests.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
import zipfile

import pytest
import torch
from helpers.processes import REPO

from lightning_spdkfac.multiprocess import RanksFailed, free_port, run_distributed


@pytest.fixture
def gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import gpu_check

    return gpu_check


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a CPU machine, even on a GPU one


def test_dry_mode_builds_every_model_steps_every_config_and_writes_the_report(gpu_check, tmp_path, no_cuda):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = gpu_check.main(["--dry", "--out", str(tmp_path), "--sections", "cnn,transformer,overhead"])
    finally:
        torch.set_num_threads(threads)
    report = json.loads((tmp_path / "report.json").read_text())
    assert code == 0, report
    assert report["dry"] is True and report["device"] == "cpu (dry run)"
    assert list(report["sections"]) == ["smoke", "cnn", "transformer", "overhead"]  # smoke first, always
    smoke = report["sections"]["smoke"]
    assert smoke["status"] == "passed"
    info = smoke["info"]
    assert info["torch"] == torch.__version__ and info["cuda_available"] is False
    assert set(info["tf32_as_found"]) >= {"cuda.matmul.allow_tf32", "cudnn.allow_tf32", "float32_matmul_precision"}
    assert "nccl" in info and "pytorch-lightning" in info["packages"]
    assert info["lightning_spdkfac"] == str(REPO / "lightning_spdkfac")  # the checkout's package
    for name in ("cnn", "transformer"):
        sec = report["sections"][name]
        assert sec["status"] == "passed"
        assert set(sec["configs"]) == set(gpu_check.CONFIGS)
        assert sec["tf32"]["set"] == "off" and sec["tf32"]["cuda.matmul.allow_tf32"] is False
        assert sec["tf32"]["cudnn.allow_tf32"] is False and sec["tf32"]["float32_matmul_precision"] == "highest"
        for config, facts in sec["configs"].items():
            assert facts["blocks"] == 1 and facts["final_loss"] > 0, (name, config)
            if config.startswith("kfac"):
                assert facts["kfac_layers"] > 0 and facts["state_mb"] > 0, (name, config)
        probes = sec["probes"]
        assert set(probes) == set(gpu_check.CONFIGS)
        for config in gpu_check.DRY_PROBES:  # the probes degrade to "not available on CPU" entries
            p = probes[config]
            assert p["syncs"]["status"].startswith("not available on CPU") and p["syncs"]["counted"] == 0
            assert p["memory"]["status"].startswith("not available on CPU")
            assert p["built"]["status"] == "not available on CPU"
        phases = probes["kfac-every-async"]["phases"]  # a CPU profile of one step: the kfac/* ranges, host times
        assert phases["ranges"] and all(r.startswith("kfac/") for r in phases["ranges"])
        assert {"kfac/factor_compute", "kfac/precondition"} <= set(phases["ranges"])
        assert all(t["calls"] > 0 and t["cuda_ms"] == 0 for t in phases["ranges"].values())
        assert "phases" not in probes["sgd"]
    skipped = report["sections"]["transformer"]["configs"]["kfac"]["skipped_layers"]
    assert "head" not in skipped and "tok" not in skipped  # the vocabulary-sized layers get K-FAC (diagonal sides)
    assert any("diagonal" in n for n in report["sections"]["transformer"]["notes"])
    assert report["sections"]["overhead"]["status"] == "passed"
    assert report["sections"]["overhead"]["tf32"]["set"] == "off"
    assert [t["verdict"] for t in report["targets"]] == ["dry (not a measurement)"] * len(gpu_check.TARGETS)
    md = (tmp_path / "report.md").read_text()
    assert "dry run" in md and "kfac-every-async" in md
    assert gpu_check.NCCL_LINE in md.splitlines()  # the literal line
    assert "Host syncs" in md and "Memory" in md and "K-FAC phases" in md and "kfac/precondition" in md
    # The report: at most 8 files, no deeper than 2 folders (here: all at the top of OUT).
    files = [os.path.relpath(os.path.join(d, f), tmp_path) for d, _, fs in os.walk(tmp_path) for f in fs]
    assert len(files) <= 8 and all(f.count(os.sep) <= 2 for f in files), files
    # The TF32 flags of this process are as they were (the dry sections run here; torch >= 2.9's fp32_precision
    # reads "ieee" for "none" once the flags were set, which means the same).
    legacy = ("cuda.matmul.allow_tf32", "cudnn.allow_tf32", "float32_matmul_precision")
    now, found = gpu_check.tf32_state(), report["sections"]["smoke"]["info"]["tf32_as_found"]
    assert {k: now[k] for k in legacy} == {k: found[k] for k in legacy}


def test_time_a_section_leaves_unspent_goes_to_the_later_ones_within_the_budget(gpu_check):
    order = ["smoke", "tests", "cnn", "transformer", "overhead"]
    shares = {n: gpu_check.BUDGETS[n] for n in order}
    for spent_share in (1.0, 0.4, 0.0):  # each section spends all, 40% or none of what it was given
        left, given = gpu_check.DEFAULT_BUDGET, {}
        for i, name in enumerate(order):
            given[name] = gpu_check.section_budget(name, order[i + 1:], left, 1.0)
            assert given[name] >= min(shares[name], left - 5) - 1e-9  # never less than its own share
            left -= given[name] * spent_share
        assert left >= 5 - 1e-9  # the run ends within --budget, with its margin
        if spent_share == 1.0:
            assert sum(given.values()) <= gpu_check.DEFAULT_BUDGET - 5 + 1e-9
        else:  # what the earlier sections left went to the later ones, in proportion to their shares
            assert given["cnn"] > shares["cnn"] and given["transformer"] > shares["transformer"]
            assert given["transformer"] / given["cnn"] > 1.0
    # a late start: the budget is cut to what is left, later sections keep their shares where they can
    assert gpu_check.section_budget("cnn", ["transformer", "overhead"], 60, 1.0) <= 55


def test_a_run_without_cuda_that_is_not_dry_fails_after_the_smoke_section(gpu_check, tmp_path, no_cuda, capsys):
    code = gpu_check.main(["--out", str(tmp_path)])
    assert code == 2
    report = json.loads((tmp_path / "report.json").read_text())
    assert list(report["sections"]) == ["smoke"]
    assert report["sections"]["smoke"]["status"].startswith("failed: no CUDA device")
    assert "no CUDA device" in capsys.readouterr().err


def test_a_failing_section_is_recorded_and_the_report_still_written(gpu_check, tmp_path, no_cuda, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("simulated section failure")

    monkeypatch.setattr(gpu_check, "section_overhead", boom)
    code = gpu_check.main(["--dry", "--out", str(tmp_path), "--sections", "overhead"])
    report = json.loads((tmp_path / "report.json").read_text())
    assert code == 1
    sec = report["sections"]["overhead"]
    assert sec["status"] == "failed" and "simulated section failure" in sec["error"]
    assert "simulated section failure" in (tmp_path / "report.md").read_text()


def test_a_section_whose_dependency_is_missing_is_skipped_with_the_reason(gpu_check, tmp_path, no_cuda, monkeypatch):
    monkeypatch.setitem(gpu_check.NEEDS, "overhead", ("surely_not_installed_here",))
    code = gpu_check.main(["--dry", "--out", str(tmp_path), "--sections", "overhead"])
    report = json.loads((tmp_path / "report.json").read_text())
    assert code == 0  # a skipped section is reported, not failed
    assert report["sections"]["overhead"]["status"] == (
        "skipped: needs surely_not_installed_here, not installed here (add its wheel: --wheels DIR)")


def test_the_sync_counter_counts_by_source_line_package_line_part_and_thread(gpu_check):
    counter = gpu_check.SyncCounter()
    package_code = compile(f"import warnings\nwarnings.warn({gpu_check.SYNC_MESSAGE!r})\n",
                           os.path.join(os.sep, "x", "lightning_spdkfac", "fake.py"), "exec")
    with counter.capture(debug_mode=False):  # the machinery without the CUDA debug mode (absent here)
        counter.set_part("forward/backward")
        for _ in range(2):
            warnings.warn(gpu_check.SYNC_MESSAGE, stacklevel=1)  # as a C++ sync converted to a Python warning
        warnings.warn("an unrelated warning", stacklevel=1)  # not counted
        counter.set_part("kfac.step")
        exec(package_code, {})  # a line inside lightning_spdkfac
        os.write(2, f"[W] Warning: {gpu_check.SYNC_MESSAGE} (function warn_or_error_on_sync)\n".encode())
    s = counter.summary(steps=2)
    assert s["total"] == 4 and s["per_step"] == 2 and s["in_forward_backward"] == 2
    assert s["by_part"] == {"forward/backward": 2, "kfac.step": 1} and s["cxx_without_python_frame"] == 1
    assert s["from_package"] == 1
    here, pkg = s["lines"]
    assert here["count"] == 2 and here["line"].startswith("tests/test_gpu_check.py:") and not here["in_package"]
    assert here["package_line"] is None and here["thread"] == "MainThread"
    assert pkg == {"line": os.path.join(os.sep, "x", "lightning_spdkfac", "fake.py") + ":2", "in_package": True,
                   "package_line": os.path.join(os.sep, "x", "lightning_spdkfac", "fake.py") + ":2",
                   "part": "kfac.step", "thread": "MainThread", "count": 1}


def test_the_phase_table_of_a_profile(gpu_check):
    from torch.profiler import ProfilerActivity, profile, record_function

    x = torch.randn(16, 16)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            with record_function("kfac/outer"), record_function("kfac/inner"):
                x = x @ x
        with record_function("other"):
            x = x + 1
    ranges = gpu_check.kfac_phase_times(prof.events())
    assert list(ranges) == ["kfac/inner", "kfac/outer"]
    assert all(r["calls"] == 2 and r["cuda_ms"] == 0 and r["cpu_ms"] > 0 for r in ranges.values())


def _wheel(folder, name: str, version: str = "0.1") -> None:
    """A minimal pure-Python wheel: ``import <name>`` gives VALUE = 42."""
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{name}/__init__.py", "VALUE = 42\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", f"{name}/__init__.py,,\n{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n")


def test_wheels_are_installed_for_the_run_only(gpu_check, tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "gpucheck_demo_pkg")
    target, rows = gpu_check.install_wheels(str(wheels))
    try:
        assert rows == [{"wheel": "gpucheck_demo_pkg-0.1-py3-none-any.whl", "result": rows[0]["result"]}]
        assert rows[0]["result"].startswith("installed"), rows
        assert os.path.isfile(os.path.join(target, "gpucheck_demo_pkg", "__init__.py"))
    finally:
        import shutil

        shutil.rmtree(target, ignore_errors=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    target, rows = gpu_check.install_wheels(str(empty))
    os.rmdir(target)
    assert rows == [{"wheel": "(none)", "result": f"no *.whl in {empty}"}]


def test_a_run_with_wheels_records_them_and_removes_their_folder(gpu_check, tmp_path, no_cuda, monkeypatch):
    wheels, temp, out = tmp_path / "wheels", tmp_path / "temp", tmp_path / "out"
    wheels.mkdir()
    temp.mkdir()
    _wheel(wheels, "gpucheck_demo_pkg")
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # where mkdtemp puts the run's folder
    seen = {}

    def overhead(args, out, budget):  # stands for a section: what does the run see?
        import gpucheck_demo_pkg

        seen.update(value=gpucheck_demo_pkg.VALUE, path=gpu_check._pythonpath(args).split(os.pathsep))
        return {"status": "passed"}

    monkeypatch.setattr(gpu_check, "section_overhead", overhead)
    monkeypatch.setattr(sys, "path", list(sys.path))
    code = gpu_check.main(["--dry", "--out", str(out), "--sections", "overhead", "--wheels", str(wheels)])
    assert code == 0
    assert seen["value"] == 42 and seen["path"][0] == str(REPO) and seen["path"][1].startswith(str(temp))
    smoke = json.loads((out / "report.json").read_text())["sections"]["smoke"]
    assert smoke["info"]["wheels"][0]["wheel"] == "gpucheck_demo_pkg-0.1-py3-none-any.whl"
    assert smoke["info"]["wheels"][0]["result"].startswith("installed")
    assert "wheel gpucheck_demo_pkg-0.1-py3-none-any.whl: installed" in (out / "report.md").read_text()
    assert list(temp.iterdir()) == []  # removed at the end
    sys.modules.pop("gpucheck_demo_pkg", None)


def test_make_gpu_check_without_install_runs_the_given_python_from_the_checkout():
    # (Under `make test` the parent make's MAKEFLAGS/MAKELEVEL would add "Entering directory" lines: not passed on.)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    out = subprocess.run(["make", "--no-print-directory", "-n", "gpu-check", "NO_INSTALL=1", "PYTHON=python3",
                          "WHEELS=.whl", "OUT=rep"], cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    (line,) = out.stdout.strip().splitlines()  # one command: no venv, no pip
    assert line == (f'PYTHONPATH="{REPO}${{PYTHONPATH:+:$PYTHONPATH}}" python3 benchmarks/gpu_check.py '
                    "--out rep --wheels .whl")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_run_distributed_with_nccl_needs_a_gpu_per_rank():
    with pytest.raises(RanksFailed, match="backend='nccl' needs one CUDA device per rank: rank 0"):
        run_distributed(free_port, 1, backend="nccl", timeout=60)


def test_the_budgets_fit_six_minutes(gpu_check):
    """330 s of sections in the default 360 s run (start-ups and the report in the rest): the whole check fits in
    6 minutes, so it can be rerun within 15 minutes of machine time."""
    assert sum(gpu_check.BUDGETS.values()) <= 330 and gpu_check.DEFAULT_BUDGET == 360
    assert gpu_check.parse_args([]).budget == 360
    assert all(gpu_check.PROBE_RESERVE[n] + gpu_check.GRACE_S < gpu_check.BUDGETS[n] for n in gpu_check.PROBE_RESERVE)


def test_the_sections_children_and_what_the_parent_reads_of_them(gpu_check, tmp_path, no_cuda, monkeypatch):
    """A GPU run's benchmark sections run ``gpu_check.py --child NAME`` in a fresh process; here the child runs in
    this process, in its dry form (the CPU), and the parent reads what it wrote as on a GPU."""
    calls = []

    def run_child(cmd, timeout, args):
        assert cmd[1] == os.path.abspath(gpu_check.__file__) and cmd[2] == "--child"
        calls.append(cmd[3])
        code = gpu_check.main([*cmd[2:], "--dry"])
        return subprocess.CompletedProcess(cmd, code, "", "")

    monkeypatch.setattr(gpu_check, "_run_child", run_child)
    precision = torch.get_float32_matmul_precision()
    args = gpu_check.parse_args(["--out", str(tmp_path), "--tf32", "on"])
    assert args.dry is False
    sec = gpu_check.section_bench("cnn", args, str(tmp_path), budget=300)
    assert sec["status"] == "passed" and set(sec["probes"]) == set(gpu_check.CONFIGS)
    assert sec["tf32"]["set"] == "on" and sec["tf32"]["float32_matmul_precision"] == "high"
    assert sec["tf32"]["cuda.matmul.allow_tf32"] is True and sec["tf32"]["cudnn.allow_tf32"] is True
    sec = gpu_check.section_overhead(args, str(tmp_path), budget=300)
    assert sec["status"] == "passed" and sec["tf32"]["set"] == "on" and sec["results"]
    assert calls == ["cnn", "overhead"]
    assert torch.get_float32_matmul_precision() == precision  # restored


def test_a_child_is_bounded_and_leaves_nothing_behind(gpu_check):
    args = gpu_check.parse_args(["--dry"])
    leave = "import subprocess, sys; print(subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']).pid)"
    done = gpu_check._run_child([sys.executable, "-c", leave], 60, args)
    assert done.returncode == 0  # returned when the child ended, though its own child still held its output
    pid = int(done.stdout)

    def gone() -> bool:  # killed with its group: no such process, or a zombie its new parent has not reaped yet
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except FileNotFoundError:
            return True

    for _ in range(200):  # (SIGKILL was sent before _run_child returned; its delivery is not instantaneous)
        if gone():
            break
        time.sleep(0.05)
    assert gone()
    with pytest.raises(subprocess.TimeoutExpired) as e:
        gpu_check._run_child([sys.executable, "-c", "import time; time.sleep(120)"], 2, args)
    assert e.value.timeout == 2


def test_a_probe_that_raises_is_recorded_and_the_others_still_run(gpu_check, tmp_path, no_cuda, monkeypatch):
    probe = gpu_check.probe

    def flaky(r, dry):
        if r.pre is not None:
            raise RuntimeError("simulated probe failure")
        return probe(r, dry)

    monkeypatch.setattr(gpu_check, "probe", flaky)
    code = gpu_check.main(["--dry", "--out", str(tmp_path), "--sections", "transformer"])
    assert code == 1
    sec = json.loads((tmp_path / "report.json").read_text())["sections"]["transformer"]
    assert sec["status"] == "failed: the probes of kfac-every-async raised"
    assert "simulated probe failure" in sec["probes"]["kfac-every-async"]["error"]
    assert sec["probes"]["sgd"]["syncs"]["status"].startswith("not available on CPU")
    assert sec["configs"]["kfac"]["blocks"] == 1  # the timings are kept
    assert "simulated probe failure" in (tmp_path / "report.md").read_text()
