"""A stale torch-extension build lock (issue 38): a killed first DeepSpeed run leaves ``<folder>/lock``, and
torch's extension loader then waits on it forever, silently. ``check_build_lock`` refuses such a lock with an
error naming the folder and the fix, lets a live build be waited for, and watches a young lock a bounded time.

No test here depends on timing: ages are planted with ``os.utime``, and the watch runs on an injected clock
whose ``sleep`` advances it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from lightning_spdkfac.lightning.deepspeed_config import STALE_LOCK_SECONDS, check_build_lock


def _plant(folder, age_seconds: float) -> str:
    """A build folder with an interrupted build's leftovers and its lock, all ``age_seconds`` old."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "build.ninja").write_text("# an interrupted build\n")
    lock = folder / "lock"
    lock.write_bytes(b"")
    then = time.time() - age_seconds
    for path in (folder / "build.ninja", lock, folder):
        os.utime(path, (then, then))
    return str(lock)


def _no_sleep(seconds):
    raise AssertionError(f"check_build_lock slept ({seconds} s) on a lock it could judge at once")


def test_a_stale_lock_is_refused_at_once_naming_the_folder_and_the_fix(tmp_path):
    folder = tmp_path / "py311_cpu" / "deepspeed_shm_comm"
    lock = _plant(folder, age_seconds=600)
    with pytest.raises(RuntimeError) as e:
        check_build_lock(str(folder), sleep=_no_sleep)
    text = str(e.value)
    assert f"DeepSpeed's op build folder {folder} holds a stale lock file ({lock}, " in text
    assert f"rm {lock}" in text and f"rm -r {folder}" in text and "TORCH_EXTENSIONS_DIR" in text
    assert "no process is building there" in text
    assert os.path.exists(lock)  # reported, not removed behind the user's back


def test_no_lock_or_a_finished_build_returns(tmp_path):
    folder = tmp_path / "op"
    folder.mkdir()
    check_build_lock(str(folder), sleep=_no_sleep)
    (folder / "op.so").write_bytes(b"")
    check_build_lock(str(folder), sleep=_no_sleep)


def test_a_live_build_is_waited_for_not_refused(tmp_path):
    folder = tmp_path / "op"
    _plant(folder, age_seconds=600)  # old, but a process works in the folder (as ninja and the compiler do)
    builder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=folder)
    try:
        check_build_lock(str(folder), sleep=_no_sleep)
    finally:
        builder.kill()
        builder.wait(timeout=30)


class FakeClock:
    def __init__(self, start: float, on_sleep=None):
        self.now, self.slept, self.on_sleep = start, [], on_sleep

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds > 0
        self.slept.append(seconds)
        self.now += seconds
        if self.on_sleep is not None:
            self.on_sleep(len(self.slept))


def test_a_young_lock_without_a_builder_is_watched_a_bounded_time_then_refused(tmp_path):
    folder = tmp_path / "op"
    _plant(folder, age_seconds=0)
    written = os.stat(folder / "lock").st_mtime
    clock = FakeClock(written + 1.0)
    with pytest.raises(RuntimeError, match="stale lock file"):
        check_build_lock(str(folder), stale_after=10.0, poll=0.5, clock=clock, sleep=clock.sleep)
    assert sum(clock.slept) == pytest.approx(9.0)  # from 1 s idle to 10 s: never longer than stale_after
    assert STALE_LOCK_SECONDS <= 60  # the bound: a clear error within a minute


def test_a_young_lock_whose_build_ends_while_watched_returns(tmp_path):
    folder = tmp_path / "op"
    _plant(folder, age_seconds=0)
    clock = FakeClock(os.stat(folder / "lock").st_mtime, on_sleep=lambda n: n == 3 and os.remove(folder / "lock"))
    check_build_lock(str(folder), stale_after=10.0, poll=0.5, clock=clock, sleep=clock.sleep)
    assert len(clock.slept) == 3


FIT_WITH_A_STALE_LOCK = """
import os, sys, warnings
warnings.filterwarnings("ignore")
import torch
import pytorch_lightning as pl
from torch.utils.cpp_extension import _get_build_directory
sys.path.insert(0, {tests!r})
from helpers.lightning_models import Tiny
import lightning_spdkfac
from lightning_spdkfac import KFAC

folder = _get_build_directory("deepspeed_shm_comm", verbose=False)
os.makedirs(folder, exist_ok=True)
lock = os.path.join(folder, "lock")
open(lock, "w").close()
import time
then = time.time() - 3600
os.utime(lock, (then, then)); os.utime(folder, (then, then))   # left by a build killed an hour ago
print("planted", lock, flush=True)
trainer = pl.Trainer(strategy="spdkfac_deepspeed_stage_2", accelerator="cpu", devices=1, max_steps=1, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=[KFAC()])
trainer.fit(Tiny())
"""


def test_a_deepspeed_fit_on_a_stale_lock_stops_with_the_error_not_a_hang(tmp_path):
    """The issue's case end to end: a DeepSpeed fit on CPU (its first use builds DeepSpeed's shared-memory op)
    over an extensions folder holding a killed build's lock. Bounded by the subprocess timeout, never a hang."""
    pytest.importorskip("deepspeed")
    tests = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(tests)  # this checkout's package, not another installed copy
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), OMP_NUM_THREADS="1",
               MASTER_ADDR="127.0.0.1", PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
    for var in ("LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT"):
        env.pop(var, None)
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(FIT_WITH_A_STALE_LOCK.format(tests=tests))],
                       capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    if "planted" not in p.stdout:
        pytest.fail(p.stderr[-3000:])
    if p.returncode == 0:
        pytest.skip("DeepSpeed did not need to build its shared-memory op here (prebuilt or incompatible)")
    assert "holds a stale lock file" in p.stderr and str(tmp_path / "ext") in p.stderr, p.stderr[-3000:]
    assert re.search(r"stale lock file \(\S+/lock, 36\d\d s old;", p.stderr), p.stderr[-3000:]
