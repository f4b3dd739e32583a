"""``spdkfac plan`` (lightning_spdkfac.simulate.plan, .plan_cli): the recommendation equals the simulator's own
result, user models / configs / the paper's models as input, clear exit-2 errors naming the flag, the
``--measure`` path on 2 gloo processes, and the ``--json`` content."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_spdkfac import cli
from lightning_spdkfac.comm.scheduler import SPDOptions
from lightning_spdkfac.demo.digits import DigitsCNN
from lightning_spdkfac.multiprocess import run_distributed
from lightning_spdkfac.schedule import InverseCost
from lightning_spdkfac.simulate import SIM_SCHEDULES, Cluster, Workload, profile_layers, simulate
from lightning_spdkfac.simulate.paper import PAPER_ALLREDUCE, paper_case
from lightning_spdkfac.simulate.plan import (
    DEFAULT_SCHEDULES,
    STRATEGY_CLASS,
    PlanInputs,
    plan,
    recommend,
    runtime_config,
    sim_schedule_from_options,
)
from lightning_spdkfac.simulate.plan_cli import main
from lightning_spdkfac.simulate.plan_sources import _config_strategy
from lightning_spdkfac.vocabulary import DDP_STRATEGY_NAMES, DEEPSPEED_STRATEGY_NAMES

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DIGITS = "lightning_spdkfac.demo.digits:DigitsCNN"
INVERSE = "3e-4,1e-9,1.4e-13"  # keeps the tests off the paper's calibration where it is not the subject


class Tiny(nn.Module):
    """A conv and a linear layer for 1x8x8 inputs (built by path: ``test_plan_cli:Tiny``)."""

    def __init__(self, width: int = 4, classes: int = 10):
        super().__init__()
        self.conv = nn.Conv2d(1, width, 3, padding=1)
        self.norm = nn.BatchNorm2d(width)
        self.fc = nn.Linear(width * 64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.norm(self.conv(x))).flatten(1))


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_help_and_registration(capsys):
    assert "plan" in cli.COMMANDS
    assert cli.main(["plan", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--config", "--paper", "--input-shape", "--measure", "--schedules", "--json"):
        assert flag in out


def test_paper_resnet50_recommendation_is_the_simulators(tmp_path, capsys):
    path = tmp_path / "plan.json"
    rc, out, err = _run(["--paper", "resnet50", "--json", str(path)], capsys)
    assert rc == 0, err
    case = paper_case("resnet50")  # the reference, independently of the CLI
    totals = {s: simulate(case.workload, case.cluster, s).total for s in DEFAULT_SCHEDULES}
    best = min(totals, key=totals.get)
    data = json.loads(path.read_text())
    assert data["recommended"] == best
    assert data["schedules"][0]["name"] == best
    assert data["schedules"][0]["total_s"] == totals[best]
    assert [r["name"] for r in data["schedules"]] == sorted(totals, key=totals.get)
    for row in data["schedules"]:
        assert row["total_s"] == totals[row["name"]]
        assert row["speedup_vs_dkfac"] == pytest.approx(totals["dkfac"] / totals[row["name"]])
        assert sum(row["breakdown_s"].values()) == pytest.approx(row["total_s"])
    # the table: summary, the recommended row marked with its total, the plans and the strategy snippet
    assert "64 GPUs" in out and "54 K-FAC layers, 108 factors" in out and "per-GPU batch 32" in out
    marked = [line for line in out.splitlines() if line.startswith("*")]
    assert len(marked) == 1 and best in marked[0] and f"{totals[best] * 1e3:.1f}" in marked[0]
    assert f"== Fusion groups of {best}" in out and f"== Inversion placement of {best}" in out
    assert "class_path: lightning_spdkfac.SPDKFACStrategy" in out
    if data["schedules"][0]["bytes_per_element"] == 2:  # a bf16 winner names the fastest fp32 schedule
        fp32 = min((s for s in totals if s != "spd-bf16"), key=totals.get)
        assert data["fastest_fp32"] == fp32 and f"fastest fp32 schedule is {fp32}" in out
        assert "comm_dtype: bfloat16" in out
    # JSON: plans of the recommended schedule, covering every factor once; runnable runtime arguments
    n_factors = 2 * len(case.workload.layers)
    grouped = [f for g in data["fusion_groups"] for f in g["factors"]]
    assert len(grouped) == len(set(grouped)) == n_factors
    placed = data["placement"]["replicated"] + [f for r in data["placement"]["ranks"] for f in r["factors"]]
    assert len(placed) == len(set(placed)) == n_factors and len(data["placement"]["ranks"]) == 64
    args = dict(data["runtime"]["strategy"]["init_args"])
    assert args.get("async_inverses", True) is True  # emitted for an async schedule only
    assert isinstance(SPDOptions.from_schedule(args.pop("schedule"), **args), SPDOptions)
    assert data["cluster"]["world_size"] == 64 and data["workload"]["batch_size"] == 32


def test_runtime_mapping():
    args, notes = runtime_config(SIM_SCHEDULES["spd"])
    assert args["schedule"] == "spd" and args["placement"] == "lbp_channel" and args["comm_dtype"] == "float32"
    assert not notes
    args, notes = runtime_config(SIM_SCHEDULES["spd-bf16"])
    assert args["comm_dtype"] == "bfloat16" and not notes
    assert runtime_config(SIM_SCHEDULES["dkfac"])[0]["schedule"] == "dkfac"
    assert runtime_config(SIM_SCHEDULES["mpd"])[0]["schedule"] == "mpd"
    args, notes = runtime_config(SIM_SCHEDULES["spd-paper"])
    assert any("fuse_g=False" in n for n in notes)  # no strategy argument runs it exactly


def test_api_arguments_follow_the_package_rule():
    """Wrong type: TypeError; wrong value: ValueError; the message names the argument."""
    case = paper_case("resnet50")
    with pytest.raises(TypeError, match=r"schedules\[1\] must be a SimSchedule or one of"):
        recommend(case.workload, case.cluster, ["spd", 3])
    with pytest.raises(ValueError, match=r"schedules\[0\] must be one of .*got 'warp'"):
        recommend(case.workload, case.cluster, ["warp"])
    with pytest.raises(TypeError, match="schedules must be a sequence"):
        recommend(case.workload, case.cluster, "spd")
    with pytest.raises(ValueError, match="schedules is empty"):
        recommend(case.workload, case.cluster, [])
    with pytest.raises(TypeError, match="schedule must be a SimSchedule"):
        runtime_config("spd")
    with pytest.raises(TypeError, match="options must be a SPDOptions"):
        sim_schedule_from_options({"schedule": "spd"})
    with pytest.raises(TypeError, match="inputs must be a PlanInputs"):
        plan({"workload": case.workload})
    with pytest.raises(TypeError, match=r"schedules\[0\] must be a SimSchedule"):
        PlanInputs(case.workload, case.cluster, ["spd"])


def test_registered_strategy_names_are_the_vocabulary():
    """A config naming a registered strategy is compared with the arguments the name fixes; a name that is
    not registered is not an SPD-KFAC strategy."""
    for name, fixed in {**DDP_STRATEGY_NAMES, **DEEPSPEED_STRATEGY_NAMES}.items():
        notes: list[str] = []
        options, args, cls = _config_strategy({"trainer": {"strategy": name}}, notes)
        assert options.schedule == fixed.get("schedule", "spd") == args["schedule"], name
        assert cls.endswith("DeepSpeedStrategy") == (name in DEEPSPEED_STRATEGY_NAMES), name
    for name in ("ddp", "spdkfac_bogus", "spdkfac_deepspeed_stage_9"):
        notes = []
        assert _config_strategy({"trainer": {"strategy": name}}, notes) == (None, None, STRATEGY_CLASS)
        assert "not an SPD-KFAC strategy" in notes[0]


def test_user_model_by_path(tmp_path, capsys):
    path = tmp_path / "tiny.json"
    argv = ["--model", f"{__name__}:Tiny", "--input-shape", "1,8,8", "--init-args", '{"width": 6}',
            "--world-size", "4", "--batch-size", "16", "--tflops", "10", "--inverse", INVERSE,
            "--schedules", "dkfac,spd,mpd", "--json", str(path)]
    rc, out, err = _run(argv, capsys)
    assert rc == 0, err
    data = json.loads(path.read_text())
    # the same numbers, built here without the CLI
    with torch.device("meta"):
        model = Tiny(width=6)
    specs = profile_layers(model, (1, 8, 8))
    other = sum(p.numel() for p in model.parameters()) - sum(s.params for s in specs)
    workload = Workload.from_rates("tiny", specs, 16, flops_per_s=10e12, other_params=other)
    # the paper's network at 4 GPUs: ring all-reduce from the 64-GPU fit, broadcasts costed like it
    ring = Cluster.from_fit(PAPER_ALLREDUCE, 64, 4, InverseCost(3e-4, 1e-9, 1.4e-13))
    cluster = Cluster(4, ring.allreduce, ring.allreduce, ring.allreduce, ring.inverse)
    ranked = recommend(workload, cluster, ["dkfac", "spd", "mpd"])
    assert [r["name"] for r in data["schedules"]] == [n for n, _ in ranked]
    assert [r["total_s"] for r in data["schedules"]] == [t.total for _, t in ranked]
    assert data["workload"]["layers"] == 2 and data["workload"]["params"] == workload.params
    assert data["workload"]["other_params"] == 12 and data["workload"]["input_shape"] == [1, 8, 8]
    assert data["cluster"]["world_size"] == 4
    assert "conv:A" in out and "fc:G" in out and "per-GPU batch 16" in out
    assert "meta device" not in out  # built on meta, no fallback needed


def test_dotted_model_path_and_meta_fallback(capsys):
    rc, out, err = _run(["--model", "lightning_spdkfac.demo.digits.DigitsCNN", "--input-shape", "1,8,8",
                         "--init-args", '{"hidden": 32}', "--world-size", "2", "--inverse", INVERSE], capsys)
    assert rc == 0, err
    assert "4 K-FAC layers" in out
    # a builder that refuses the meta device is built on the CPU, with a note
    rc, out, err = _run(["--model", f"{__name__}:no_meta", "--input-shape", "1,8,8", "--world-size", "2",
                         "--inverse", INVERSE], capsys)
    assert rc == 0, err
    assert "could not be built or run on the meta device" in out and "2 K-FAC layers" in out


def no_meta() -> nn.Module:
    if torch.empty(0).device.type == "meta":
        raise RuntimeError("this model needs real tensors")
    return Tiny()


@pytest.mark.parametrize("configs, schedule, batch", [
    (["digits_spdkfac.yaml"], "spd", 32),
    (["digits.yaml"], None, 64),  # no strategy: nothing to add to the comparison
    (["digits_spdkfac.yaml", "schedules/mpd.yaml"], "mpd", 32),  # layered, as LightningCLI does
])
def test_config(configs, schedule, batch, tmp_path, capsys):
    path = tmp_path / "plan.json"
    argv = [a for c in configs for a in ("--config", str(CONFIGS / c))]
    rc, out, err = _run([*argv, "--input-shape", "1,8,8", "--world-size", "8", "--inverse", INVERSE,
                         "--json", str(path)], capsys)
    assert rc == 0, err
    data = json.loads(path.read_text())
    rows = {r["name"]: r for r in data["schedules"]}
    assert data["workload"]["layers"] == 4 and data["workload"]["name"] == "DigitsCNN"
    assert data["workload"]["batch_size"] == batch  # the config's data.init_args.batch_size
    assert set(DEFAULT_SCHEDULES) <= set(rows)
    assert ("config" in rows) == (schedule is not None)
    if schedule is not None:  # the config's strategy, simulated as the runtime would run it
        options = SPDOptions.from_schedule(schedule)
        with torch.device("meta"):
            specs = profile_layers(DigitsCNN(), (1, 8, 8))
        workload = Workload.from_rates("digits", specs, batch, flops_per_s=20e12)
        ring = Cluster.from_fit(PAPER_ALLREDUCE, 64, 8, InverseCost(3e-4, 1e-9, 1.4e-13))
        cluster = Cluster(8, ring.allreduce, ring.allreduce, ring.allreduce, ring.inverse)
        ref = simulate(workload, cluster, sim_schedule_from_options(options))
        assert rows["config"]["total_s"] == ref.total
        assert f"config: the config's strategy: schedule {schedule}" in out


def test_token_model_config(capsys):
    argv = ["--config", str(CONFIGS / "transformer_lm.yaml"), "--input-shape", "64", "--world-size", "8",
            "--inverse", INVERSE]
    rc, out, err = _run(argv, capsys)
    assert rc == 2 and "--input-dtype int64" in err  # float token ids: a hint, not a traceback
    rc, out, err = _run([*argv, "--input-dtype", "int64"], capsys)
    assert rc == 0, err
    assert "input 64 (int64)" in out and "K-FAC layers" in out


BAD = [
    (["--model", "no_such_module_xyz:Net", "--input-shape", "1,8,8"], "--model", "cannot import"),
    (["--model", "lightning_spdkfac.demo.digits:Nope", "--input-shape", "1,8,8"], "--model", "no attribute"),
    (["--model", "justaname", "--input-shape", "1,8,8"], "--model", "pkg.module"),
    (["--model", DIGITS], "--input-shape", "required"),
    (["--model", DIGITS, "--input-shape", "1,x,8"], "--input-shape", "positive integers"),
    (["--model", DIGITS, "--input-shape", "3,32,32"], "--input-shape", "forward pass"),
    (["--model", DIGITS, "--input-shape", "1,8,8", "--init-args", "{bad"], "--init-args", "JSON"),
    (["--model", DIGITS, "--input-shape", "1,8,8", "--init-args", '{"nope": 1}'], "--init-args", "nope"),
    (["--config", str(CONFIGS / "digits.yaml")], "--input-shape", "required"),
    (["--config", "/nonexistent/plan.yaml", "--input-shape", "1,8,8"], "--config", "cannot read"),
    (["--paper", "resnet9"], "--paper", "resnet50"),
    ([], "--model/--config/--paper", "exactly one"),
    (["--paper", "resnet50", "--model", DIGITS], "--model/--config/--paper", "exactly one"),
    (["--paper", "resnet50", "--schedules", "spd,warp"], "--schedules", "valid: dkfac"),
    (["--paper", "resnet50", "--alpha", "1e-4"], "--beta", "give both"),
    (["--paper", "resnet50", "--world-size", "0"], "--world-size", "positive"),
    (["--paper", "resnet50", "--inverse", "1,2"], "--inverse", "c0,c2,c3"),
    (["--paper", "resnet50", "--tflops", "fast"], "--tflops", "invalid float"),
    (["--paper", "resnet50", "--measure"], "--measure", "torchrun"),
]


@pytest.mark.parametrize("argv, flag, words", BAD, ids=[" ".join(a[0:2]) + f" -> {f}" for a, f, _ in BAD])
def test_bad_arguments_exit_2(argv, flag, words, capsys, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    rc, out, err = _run(argv, capsys)
    assert rc == 2
    assert flag in err and words in err
    assert "Traceback" not in err and out == ""


def _measure_rank(rank: int, world: int, argv: list[str]) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(argv)
    return rc, buf.getvalue()


def test_measure_on_two_gloo_ranks(tmp_path):
    path = tmp_path / "measured.json"
    argv = ["--model", DIGITS, "--input-shape", "1,8,8", "--measure", "--measure-repeats", "2",
            "--json", str(path)]
    (rc0, out0), (rc1, out1) = run_distributed(_measure_rank, 2, argv, timeout=120)
    assert rc0 == 0 and rc1 == 0
    assert out1 == ""  # rank 0 prints
    data = json.loads(path.read_text())
    m = data["measured"]
    assert m["group_world_size"] == 2 and m["backend"] == "gloo" and len(m["sizes_bytes"]) >= 2
    ar = m["allreduce_fit"]
    assert data["cluster"]["world_size"] == 2 and data["cluster"]["allreduce"] == ar
    assert ar["alpha"] > 0 or ar["beta"] > 0
    assert "measured on this process group (gloo)" in out0
    assert f"alpha {ar['alpha'] * 1e6:.1f} us, beta {ar['beta']:.4g} s/B" in out0
    assert "inversions measured on cpu" in out0 and len(m["inverse_ns"]) >= 2


# ---------------------------------------------------------------- issue 19: dpkfac, DeAR, memory, --gpu-memory
def test_gpu_memory_units_and_errors(capsys):
    from lightning_spdkfac.simulate.plan_cli import gpu_memory_bytes

    assert gpu_memory_bytes("16GB") == 16e9 and gpu_memory_bytes("16") == 16e9
    assert gpu_memory_bytes("15.5 GiB") == 15.5 * 2**30 and gpu_memory_bytes("512MB") == 512e6
    assert gpu_memory_bytes("1tib") == 2**40 and gpu_memory_bytes(None) is None
    for bad in ("16 parsecs", "-1GB", "0GB", "GB", "sixteen"):
        rc, out, err = _run(["--paper", "resnet50", f"--gpu-memory={bad}"], capsys)
        assert rc == 2 and "--gpu-memory" in err and repr(bad) in err and not out


def test_gpu_memory_recommends_the_fastest_that_fits(tmp_path, capsys):
    """dpkfac holds only its owned layers' K-FAC state: under a limit only it meets, it is recommended although
    slower; with a limit nothing meets, the smallest is recommended and the output says so."""
    path = tmp_path / "plan.json"
    free = json.loads((lambda: (main(["--paper", "resnet50", "--json", str(path)]), path.read_text())[1])())
    capsys.readouterr()
    mem = {r["name"]: r["memory_bytes"] for r in free["schedules"]}
    for m in mem.values():
        assert m["total"] == m["model"] + m["kfac_state"] + m["buffers"]
        assert m["model"] == 3 * 4 * free["workload"]["params"]
    assert mem["dpkfac"]["kfac_state"] < mem["spd"]["kfac_state"] < mem["spd-async"]["kfac_state"]
    assert free["recommended"] != "dpkfac" and free["memory"]["limit_bytes"] is None
    limit = (mem["dpkfac"]["total"] + min(m["total"] for n, m in mem.items() if n != "dpkfac")) / 2
    rc, out, err = _run(["--paper", "resnet50", "--gpu-memory", f"{limit / 1e6:.3f}MB", "--json", str(path)], capsys)
    data = json.loads(path.read_text())
    assert rc == 0, err
    assert data["recommended"] == "dpkfac" and [r["name"] for r in data["schedules"] if r["fits"]] == ["dpkfac"]
    assert data["runtime"]["strategy"]["init_args"]["schedule"] == "dpkfac"
    marked = [line for line in out.splitlines() if line.startswith("*")]
    assert len(marked) == 1 and "dpkfac" in marked[0] and "(over)" in out and "1 of 8 schedules fit" in out
    assert "== Inversion placement of dpkfac (layers" in out
    rc, out, err = _run(["--paper", "resnet50", "--gpu-memory", "1MB", "--json", str(path)], capsys)
    data = json.loads(path.read_text())
    assert rc == 0 and data["recommended"] == "dpkfac" and "no compared schedule fits" in out


def test_runtime_config_of_dpkfac_and_dear():
    args, notes = runtime_config(SIM_SCHEDULES["dpkfac"])
    assert args == {"schedule": "dpkfac", "pipelining": True, "fusion": "dtf", "comm_dtype": "float32"}
    assert notes == []  # the runtime runs it exactly
    args, notes = runtime_config(SIM_SCHEDULES["dpkfac-local"])
    assert args["schedule"] == "dpkfac" and any("approximation" in n for n in notes)
    args, notes = runtime_config(SIM_SCHEDULES["spd-dear"])
    assert args["schedule"] == "spd" and any("DeAR" in n for n in notes)


def test_dpkfac_config_validates_against_spdoptions():
    args = dict(runtime_config(SIM_SCHEDULES["dpkfac"])[0])
    options = SPDOptions.from_schedule(args.pop("schedule"), **args)
    assert options.schedule == "dpkfac"
    assert sim_schedule_from_options(options).dpkfac == "reduce"
