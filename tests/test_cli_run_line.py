"""The ``spdkfac`` CLI and the callback's end-of-fit line (issue 38): the CLI prints it once, in its outcome,
from the callback's own record; after ``--ckpt_path`` it counts the K-FAC steps of this run and says that the
run resumed; a config naming the repository's ``examples/`` says where to run it when they are not importable."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from lightning_spdkfac import cli
from lightning_spdkfac.cli import main

REPO = Path(__file__).resolve().parents[1]
DIGITS = REPO / "configs" / "digits.yaml"


def _fit(root: Path, *extra: str) -> None:
    # accumulate_grad_batches=2: the resumed run's first micro-batch ends no optimizer step (the CLI used to count
    # the restored K-FAC step there as one of this run's: 51 K-FAC steps for 50 optimizer steps)
    assert main(["fit", "--config", str(DIGITS), f"--trainer.default_root_dir={root}", "--trainer.logger=false",
                 "--trainer.enable_model_summary=false", "--trainer.limit_val_batches=1",
                 "--trainer.accumulate_grad_batches=2", *extra]) == 0


def test_the_cli_prints_the_callbacks_line_once_and_counts_a_resumed_run(isolated, tmp_path, capsys, caplog):
    ckpt_dir = tmp_path / "ckpt"
    with caplog.at_level(logging.INFO):
        _fit(tmp_path, "--trainer.max_steps=6", "--trainer.enable_checkpointing=true",
             "--trainer.callbacks+=ModelCheckpoint", f"--trainer.callbacks.dirpath={ckpt_dir}",
             "--trainer.callbacks.save_last=true")
    out = capsys.readouterr().out
    logged = [r.getMessage() for r in caplog.records if "ms per step in K-FAC" in r.getMessage()]
    assert not logged  # the callback's own print is off under the CLI ...
    assert len(re.findall(r"K-FAC: 6 steps, [\d.]+ ms per step in K-FAC \(\d+% of a [\d.]+ ms step;", out)) == 1, out
    assert "6 optimizer steps" in out and "resumed" not in out
    last = ckpt_dir / "last.ckpt"
    assert last.is_file()
    caplog.clear()
    _fit(tmp_path, "--trainer.max_steps=10", f"--ckpt_path={last}")
    out = capsys.readouterr().out
    # 4 optimizer steps in this run, 4 K-FAC steps (not 5, not 10); inverse steps: none of 6..9 is a multiple of 50
    assert "10 optimizer steps (4 in this run, resumed at step 6)" in out, out
    assert re.search(r"K-FAC: 4 steps, [\d.]+ ms per step in K-FAC .*inverse steps 0 of 4", out), out


def test_a_config_of_the_repositorys_examples_says_where_to_run_it(isolated, tmp_path, monkeypatch, capsys):
    # the repository's packages, as an installed copy run from elsewhere sees them: not importable
    monkeypatch.setattr(cli, "_REPOSITORY_PACKAGES", ("spdkfac_no_such_examples",))
    config = tmp_path / "gpt.yaml"
    config.write_text("model:\n  class_path: spdkfac_no_such_examples.hf_gpt2.GPT2LM  # the model\n")
    with pytest.raises(SystemExit) as e:
        main(["fit", f"--config={config}"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "spdkfac_no_such_examples.hf_gpt2.GPT2LM, which lives in the repository's spdkfac_no_such_examples/" in err
    assert "run it from the root of a clone" in err


@pytest.mark.parametrize("name", ["hf_gpt2.yaml", "hf_gpt2_adamw.yaml"])
def test_the_configs_that_need_the_examples_say_so_first(name):
    text = (REPO / "configs" / name).read_text()
    assert "class_path: examples." in text
    assert text.startswith("# NEEDS A CLONE OF THE REPOSITORY")
