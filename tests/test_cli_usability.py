"""The ``spdkfac`` command line as a new user meets it (issue 16 items 2, 3, 6).

K-FAC's settings one by one (``--kfac.<arg>``, the ``kfac:`` group) without losing the config's other
callbacks; a strategy argument from the command line; the outcome printed at the end of a run; one
versioned run folder per run; ``--help`` naming every subcommand; ``spdkfac test`` / ``validate`` on
every shipped single-process config; ``spdkfac plan --model mymodule:Class`` from the module's folder.
"""

from __future__ import annotations

import re
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml
from helpers.processes import finish_cli, start_cli

from lightning_spdkfac import KFAC
from lightning_spdkfac.cli import RunSummary, lightning_cli, main
from lightning_spdkfac.demo import TimeToAccuracy

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
DIGITS = CONFIGS / "digits.yaml"
SHORT = ["--trainer.max_epochs=1", "--trainer.limit_train_batches=3", "--trainer.limit_val_batches=1",
         "--trainer.num_sanity_val_steps=0"]


def spdkfac(*args: str, cwd: Path = REPO, timeout: float = 120) -> subprocess.CompletedProcess:
    """``spdkfac ARGS`` as a user runs it (a subprocess in its own session, killed with its group after)."""
    return finish_cli(start_cli(args, cwd), timeout)


def spdkfac_together(*calls: tuple[str, ...], cwd: Path = REPO, timeout: float = 120) -> list[subprocess.CompletedProcess]:
    """Several independent ``spdkfac`` runs at once (each mostly imports: they overlap on two cores)."""
    procs = [start_cli(args, cwd) for args in calls]
    return [finish_cli(proc, timeout) for proc in procs]


def _fit_digits(root: Path, *extra: str) -> subprocess.CompletedProcess:
    done = spdkfac("fit", "--config", str(DIGITS), f"--trainer.default_root_dir={root}", *SHORT, *extra)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


# ------------------------------------------------------------------------ K-FAC settings on the command line
@pytest.mark.slow  # a CLI fit in a subprocess, 14 s: in make test-slow (CI runs it) to keep make test under 10 minutes
def test_kfac_argument_from_the_command_line_keeps_the_other_callbacks(tmp_path):
    done = _fit_digits(tmp_path, "--kfac.damping=0.05")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())  # what the run was built from
    assert saved["kfac"]["init_args"]["damping"] == 0.05
    # the config's other K-FAC settings and its other callbacks are untouched
    assert saved["kfac"]["init_args"]["inv_update_steps"] == 50
    assert saved["kfac"]["init_args"]["factor_update_steps"] == 5
    callbacks = [c["class_path"] for c in saved["trainer"]["callbacks"]]
    assert callbacks == ["lightning_spdkfac.demo.TimeToAccuracy"]
    assert (tmp_path / "time_to_accuracy.json").is_file()
    assert "TimeToAccuracy: target 0.97" in done.stdout
    assert re.search(r"K-FAC: 3 steps, [\d.]+ ms per step", done.stdout), done.stdout


def test_kfac_arguments_reach_the_callback(isolated, tmp_path):
    cli = lightning_cli(["--config", str(DIGITS), f"--trainer.default_root_dir={tmp_path}",
                         "--kfac.damping=0.05", "--kfac.inv_update_steps=10"], run=False)
    (kfac,) = [c for c in cli.trainer.callbacks if isinstance(c, KFAC)]
    assert kfac.options.damping == 0.05 and kfac.options.inv_update_steps == 10
    assert kfac.options.factor_update_steps == 5  # from the config
    assert any(isinstance(c, TimeToAccuracy) for c in cli.trainer.callbacks)
    assert any(isinstance(c, RunSummary) for c in cli.trainer.callbacks)


def test_kfac_null_turns_it_off(isolated, tmp_path):
    cli = lightning_cli(["--config", str(CONFIGS / "digits_sgd.yaml"),
                         f"--trainer.default_root_dir={tmp_path}"], run=False)
    assert not any(isinstance(c, KFAC) for c in cli.trainer.callbacks)
    cli = lightning_cli(["--config", str(DIGITS), "--kfac=null", f"--trainer.default_root_dir={tmp_path}"],
                        run=False)
    assert not any(isinstance(c, KFAC) for c in cli.trainer.callbacks)


OLD_STYLE = """\
trainer:
  logger: false
  callbacks:
    - class_path: lightning_spdkfac.KFAC
      init_args:
        damping: 0.02
        inv_update_steps: 10
model:
  class_path: lightning_spdkfac.demo.DigitsCNN
data:
  class_path: lightning_spdkfac.demo.DigitsDataModule
"""


def test_a_config_with_kfac_in_trainer_callbacks_keeps_working(isolated, tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text(OLD_STYLE)
    cli = lightning_cli(["--config", str(path), f"--trainer.default_root_dir={tmp_path}"], run=False)
    (kfac,) = [c for c in cli.trainer.callbacks if isinstance(c, KFAC)]  # one K-FAC, the config's
    assert kfac.options.damping == 0.02 and kfac.options.inv_update_steps == 10


def test_kfac_configured_twice_is_one_clear_error(isolated, tmp_path, capsys):
    path = tmp_path / "old.yaml"
    path.write_text(OLD_STYLE)
    with pytest.raises(SystemExit) as e:
        main(["fit", "--config", str(path), "--kfac.damping=0.05", f"--trainer.default_root_dir={tmp_path}"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "K-FAC is configured twice" in err and "move that entry's init_args under kfac:" in err
    assert "Traceback" not in err


def test_strategy_argument_from_the_command_line_reaches_the_strategy(isolated, tmp_path):
    from lightning_spdkfac import SPDKFACStrategy

    cli = lightning_cli(["--config", str(CONFIGS / "digits_spdkfac.yaml"), "--trainer.devices=1",
                         f"--trainer.default_root_dir={tmp_path}", "--trainer.strategy.schedule=mpd",
                         "--trainer.strategy.placement=round_robin",
                         "--trainer.strategy.init_args.comm_dtype=bfloat16"], run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, SPDKFACStrategy)
    assert strategy.spd_options.schedule == "mpd"
    assert strategy.spd_options.placement == "round_robin"
    assert strategy.spd_options.comm_dtype == "bfloat16"
    assert strategy.spd_options.profile_steps == (3, 8)  # the config's other strategy arguments stay


# ------------------------------------------------------------------------ results on screen, versioned runs
@pytest.mark.slow
def test_two_runs_print_their_outcome_into_two_version_folders(tmp_path):
    first = _fit_digits(tmp_path)
    second = _fit_digits(tmp_path)
    for n, done in enumerate((first, second)):
        out = done.stdout
        version = tmp_path / "lightning_logs" / f"version_{n}"
        assert "spdkfac fit: done after 1 epoch, 3 optimizer steps" in out, out
        assert re.search(r"metrics: .*val_acc [\d.]+", out), out
        assert re.search(r"K-FAC: 3 steps, [\d.]+ ms per step in K-FAC \(.*\); inverse steps 1 of 3 \(33%\); "
                         r"skipped factor steps 0, skipped precondition steps 0, inverse fallbacks 0", out), out
        assert f"logs: CSVLogger -> {version}" in out, out
        for name in ("config.yaml", "metrics.csv", "time_to_accuracy.json"):
            assert (version / name).is_file(), name
    assert sorted(p.name for p in (tmp_path / "lightning_logs").iterdir()) == ["version_0", "version_1"]


def test_help_lists_every_subcommand():
    done, plan_help = spdkfac_together(("--help",), ("plan", "--help"))
    assert done.returncode == 0, done.stderr
    listed = re.findall(r"^\s{4}(\w+)\s{2,}", done.stdout, re.M)
    assert {"fit", "validate", "test", "predict", "plan"} <= set(listed), done.stdout
    assert plan_help.returncode == 0 and "--model" in plan_help.stdout


# ------------------------------------------------------------------------ test / validate on every model
SINGLE_PROCESS = {
    "digits.yaml": [],
    "digits_sgd.yaml": [],
    "resnet_cifar.yaml": [],
    "resnet_cifar_sgd.yaml": [],
    "resnet_cifar_synthetic.yaml": ["--data.num_val=8"],
    "transformer_lm.yaml": ["--data.max_bytes=200000", "--data.val_windows=8"],
    "transformer_lm_adamw.yaml": ["--data.max_bytes=200000", "--data.val_windows=8"],
    "hf_gpt2.yaml": ["--data.max_bytes=200000", "--data.val_windows=4"],
    "hf_gpt2_adamw.yaml": ["--data.max_bytes=200000", "--data.val_windows=4"],
}


def test_every_single_process_config_is_listed():
    single = {p.name for p in CONFIGS.glob("*.yaml") if yaml.safe_load(p.read_text())["trainer"].get("devices") == 1}
    assert single == set(SINGLE_PROCESS)


@pytest.mark.parametrize("subcommand", ["validate", "test"])
@pytest.mark.parametrize("name", list(SINGLE_PROCESS))
def test_validate_and_test_run_on_every_shipped_model(name, subcommand, isolated, tmp_path, capsys):
    extra = SINGLE_PROCESS[name]
    if name == "resnet_cifar_synthetic.yaml":  # its logger names a folder of its own
        extra = [*extra, f"--trainer.logger.init_args.save_dir={tmp_path}"]
    code = main([subcommand, "--config", str(CONFIGS / name), f"--trainer.default_root_dir={tmp_path}",
                 f"--trainer.limit_{'val' if subcommand == 'validate' else 'test'}_batches=1", *extra])
    assert code == 0
    out = capsys.readouterr().out
    prefix = "val" if subcommand == "validate" else "test"
    assert f"spdkfac {subcommand}: done" in out, out
    assert re.search(rf"metrics: .*{prefix}_loss [\d.]+", out), out


# ------------------------------------------------------------------------ spdkfac plan --model module:Class
@pytest.mark.slow  # spdkfac plan in a subprocess, 12 s: in make test-slow (CI runs it) to keep make test under 10 minutes
def test_plan_model_from_the_modules_folder(tmp_path):
    (tmp_path / "mymodule.py").write_text(textwrap.dedent("""\
        from torch import nn

        class Net(nn.Sequential):
            def __init__(self):
                super().__init__(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        """))
    done, wrong = spdkfac_together(
        ("plan", "--model", "mymodule:Net", "--input-shape", "1,8,8", "--world-size", "4"),
        ("plan", "--model", "mymodul:Net", "--input-shape", "1,8,8", "--world-size", "4"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "init_args:" in done.stdout  # the recommended strategy arguments
    assert wrong.returncode == 2
    assert "--model: cannot import module 'mymodul'" in wrong.stderr
    assert f"looked in the working directory {tmp_path}" in wrong.stderr and "PYTHONPATH" in wrong.stderr


def test_a_second_config_with_kfac_settings_changes_only_those(isolated, tmp_path):
    """The old workaround, a second --config, now merges into the kfac group instead of replacing the
    callback list."""
    extra = tmp_path / "damping.yaml"
    extra.write_text("kfac:\n  damping: 0.07\n")
    cli = lightning_cli(["--config", str(DIGITS), "--config", str(extra), f"--trainer.default_root_dir={tmp_path}"],
                        run=False)
    (kfac,) = [c for c in cli.trainer.callbacks if isinstance(c, KFAC)]
    assert kfac.options.damping == 0.07
    assert (kfac.options.factor_update_steps, kfac.options.inv_update_steps) == (5, 50)
    assert any(isinstance(c, TimeToAccuracy) for c in cli.trainer.callbacks)


def test_a_run_without_kfac_says_so(isolated, tmp_path, capsys):
    assert main(["fit", "--config", str(CONFIGS / "digits_sgd.yaml"), f"--trainer.default_root_dir={tmp_path}",
                 *SHORT]) == 0
    out = capsys.readouterr().out
    assert "spdkfac fit: done after 1 epoch, 3 optimizer steps" in out, out
    assert "K-FAC: off" in out and "TimeToAccuracy: target 0.97" in out, out


def test_the_outcome_says_where_checkpoints_and_traces_went(isolated, tmp_path, capsys):
    traces = tmp_path / "traces"
    assert main(["fit", "--config", str(DIGITS), f"--trainer.default_root_dir={tmp_path}", *SHORT,
                 "--trainer.enable_checkpointing=true", "--kfac.trace_step=1", f"--kfac.trace_dir={traces}"]) == 0
    out = capsys.readouterr().out
    (ckpt,) = (tmp_path / "lightning_logs" / "version_0" / "checkpoints").glob("*.ckpt")
    assert f"checkpoint: {ckpt}" in out, out
    (trace,) = traces.glob("*.json")
    assert f"K-FAC trace: {trace}" in out, out
