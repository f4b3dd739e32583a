"""benchmarks/gpu_check.py in its dry mode (what it does without CUDA): every benchmark section builds its
models (at tiny size), steps each configuration once on the CPU and writes the report, so the GPU check cannot
rot between the runs on a GPU. (`make gpu-check-dry`, which CI runs, adds the collection of the cuda tests.)"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.processes import REPO


@pytest.fixture
def gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import gpu_check

    return gpu_check


def test_dry_mode_builds_every_model_steps_every_config_and_writes_the_report(gpu_check, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the dry mode, even on a GPU machine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = gpu_check.main(["--out", str(tmp_path), "--sections", "cnn,transformer,overhead"])
    finally:
        torch.set_num_threads(threads)
    report = json.loads((tmp_path / "report.json").read_text())
    assert code == 0, report
    assert report["dry"] is True and report["device"] == "cpu (dry run)"
    for name in ("cnn", "transformer"):
        sec = report["sections"][name]
        assert sec["status"] == "passed"
        assert set(sec["configs"]) == set(gpu_check.CONFIGS)
        for config, facts in sec["configs"].items():
            assert facts["blocks"] == 1 and facts["final_loss"] > 0, (name, config)
            if config.startswith("kfac"):
                assert facts["kfac_layers"] > 0 and facts["state_mb"] > 0, (name, config)
    skipped = report["sections"]["transformer"]["configs"]["kfac"]["skipped_layers"]
    assert "head" not in skipped and "tok" not in skipped  # the vocabulary-sized layers get K-FAC (diagonal sides)
    assert any("diagonal" in n for n in report["sections"]["transformer"]["notes"])
    assert report["sections"]["overhead"]["status"] == "passed"
    assert [t["verdict"] for t in report["targets"]] == ["dry (not a measurement)"] * len(gpu_check.TARGETS)
    md = (tmp_path / "report.md").read_text()
    assert "dry run" in md and "kfac-every-async" in md


def test_a_failing_section_is_recorded_and_the_report_still_written(gpu_check, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def boom(*args, **kwargs):
        raise RuntimeError("simulated section failure")

    monkeypatch.setattr(gpu_check, "section_overhead", boom)
    code = gpu_check.main(["--out", str(tmp_path), "--sections", "overhead"])
    report = json.loads((tmp_path / "report.json").read_text())
    assert code == 1
    sec = report["sections"]["overhead"]
    assert sec["status"] == "failed" and "simulated section failure" in sec["error"]
    assert "simulated section failure" in (tmp_path / "report.md").read_text()
