"""Every YAML under configs/ parses, and every one is run by some test.

The schedule fragments (configs/schedules/*.yaml) are composed after configs/digits_spdkfac.yaml and
run for 10 optimizer steps on 2 processes (past the SPD profiling window of steps 3..7), and the
multi-node template runs on one CPU process. The other configs have end-to-end tests of their own,
listed in COVERED; this file checks those tests exist, so a new config cannot go untested.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml
from helpers.processes import finish_cli, kill_group, start_cli

from lightning_spdkfac.cli import main
from lightning_spdkfac.multiprocess import free_port

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
BASE = CONFIGS / "digits_spdkfac.yaml"
FRAGMENTS = sorted((CONFIGS / "schedules").glob("*.yaml"))

# config (relative to configs/) -> the test that runs it end to end ("file::function").
COVERED = {
    "digits.yaml": "test_demo.py::test_kfac_gets_ahead_of_sgd_in_epochs",
    "digits_sgd.yaml": "test_demo.py::test_kfac_gets_ahead_of_sgd_in_epochs",
    "digits_spdkfac.yaml": "test_strategy_digits.py::test_two_processes_match_the_single_process_accuracy",
    "digits_deepspeed.yaml": "test_deepspeed_digits.py::test_bf16_zero2_trains_digits_to_95_percent",
    "digits_fsdp2.yaml": "test_fsdp2_lightning.py::test_fsdp2_config_two_processes",
    "multinode.yaml": "test_configs.py::test_multinode_template_runs_on_one_cpu_process",
    **{f"schedules/{p.name}": "test_configs.py::test_schedule_fragments_run_on_two_processes" for p in FRAGMENTS},
}
# Configs added by the examples (their smoke tests live with them).
EXAMPLE_TESTS = {
    "resnet_cifar": "test_example_resnet.py",
    "transformer_lm": "test_example_lm.py",
    "hf_gpt2": "test_example_hf_gpt2.py",
}


def all_configs() -> list[str]:
    return sorted(str(p.relative_to(CONFIGS)) for p in CONFIGS.rglob("*.yaml"))


def test_every_config_is_run_by_a_test():
    missing = []
    for name in all_configs():
        test = COVERED.get(name)
        if test is None:
            prefix = next((k for k in EXAMPLE_TESTS if name.startswith(k)), None)
            if prefix is None:
                missing.append(name)
                continue
            path = REPO / "tests" / EXAMPLE_TESTS[prefix]
            assert path.is_file() and name.split("/")[-1] in path.read_text(), f"{name}: not run by {path.name}"
            continue
        file, func = test.split("::")
        assert f"def {func}(" in (REPO / "tests" / file).read_text(), f"{name}: {test} does not exist"
    assert not missing, f"configs without a test: {missing} (add a test and list it in COVERED)"


@pytest.mark.parametrize("name", all_configs())
def test_config_parses(name, isolated, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))  # configs/hf_gpt2*.yaml: class_path examples.hf_gpt2.GPT2LM
    path = CONFIGS / name
    args = ["--config", str(BASE), "--config", str(path)] if name.startswith("schedules/") else ["--config", str(path)]
    with pytest.raises(SystemExit) as e:
        main(["fit", "--print_config", *args])
    assert e.value.code == 0
    out = capsys.readouterr().out
    # (DeepSpeed's import logs a line to stdout before the YAML)
    printed = yaml.safe_load("\n".join(line for line in out.splitlines() if not line.startswith("[20")))
    assert printed["model"]["class_path"] and printed["trainer"]
    if name.startswith("schedules/"):
        own = yaml.safe_load(path.read_text())["trainer"]["strategy"]["init_args"]
        got = printed["trainer"]["strategy"]["init_args"]
        assert {k: got[k] for k in own} == own
        assert got["profile_steps"] == [3, 8]  # the base config's other arguments survive the composition


@pytest.mark.slow
def test_schedule_fragments_run_on_two_processes(tmp_path):
    """Every fragment of configs/schedules composed with the base config, trained on 2 processes. The runs
    start together (each on its own MASTER_PORT) and are waited for in turn: their start-ups, most of each
    run, overlap (about 30 s of the suite)."""
    ports: set[int] = set()
    while len(ports) < len(FRAGMENTS):
        ports.add(free_port())
    deadline = time.monotonic() + 300
    runs = [(start_cli(["fit", "--config", str(BASE), "--config", str(fragment), "--trainer.max_steps=10",
                        "--trainer.limit_val_batches=0", f"--trainer.default_root_dir={tmp_path / fragment.stem}"],
                       env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}), fragment)
            for fragment, port in zip(FRAGMENTS, sorted(ports))]
    try:
        for proc, fragment in runs:
            done = finish_cli(proc, max(1.0, deadline - time.monotonic()))
            assert done.returncode == 0, f"{fragment.stem}: exited with {done.returncode}\n{done.stderr[-4000:]}"
    finally:
        for proc, _ in runs:
            kill_group(proc.pid)
    for _, fragment in runs:
        saved = yaml.safe_load((tmp_path / fragment.stem / "config.yaml").read_text())  # what rank 0 ran with
        ran = saved["trainer"]["strategy"]["init_args"]
        for key, value in yaml.safe_load(fragment.read_text())["trainer"]["strategy"]["init_args"].items():
            assert ran[key] == value, (fragment.stem, key, ran[key], value)
        assert saved["trainer"]["devices"] == 2


def test_multinode_template_runs_on_one_cpu_process(tmp_path, isolated):
    root = tmp_path / "run"
    code = main(["fit", "--config", str(CONFIGS / "multinode.yaml"), "--trainer.accelerator=cpu",
                 "--trainer.devices=1", "--trainer.num_nodes=1", "--trainer.precision=32-true",
                 "--trainer.max_steps=3", "--trainer.limit_val_batches=0", "--trainer.logger=false",
                 f"--trainer.default_root_dir={root}"])
    assert code == 0
    ckpts = list(root.rglob("*.ckpt"))
    assert ckpts, "the template checkpoints"
    import torch

    state = torch.load(ckpts[0], weights_only=False)["callbacks"]["KFAC"]
    assert state["steps"] == 3 and state["layers"]
