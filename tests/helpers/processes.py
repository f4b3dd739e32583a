"""Subprocesses of the tests: the ``spdkfac`` command, a launcher-free environment, and process groups
that are waited for and killed, so that no rank outlives a test (pass, fail or timeout).

Used by the tests that run ``spdkfac fit`` or ``torchrun`` as a user does (test_strategy_digits,
test_deepspeed_digits, test_configs, test_multinode, test_cli_usability).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SPDKFAC = REPO / ".venv" / "bin" / "spdkfac"
# Variables that would make Lightning believe it runs under torchrun / SLURM / MPI, or that pin its
# rank, port or seed: the subprocesses must see a plain shell.
_LAUNCH_VARS = ("LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "MASTER_ADDR", "MASTER_PORT")
_LAUNCH_PREFIXES = ("SLURM_", "TORCHELASTIC_", "PET_", "OMPI_", "PMI_", "PMIX_", "LSB_", "PL_")


def spdkfac_cmd() -> list[str]:
    """The console script when it is installed next to this interpreter, else the same entry point."""
    script = Path(sys.executable).with_name("spdkfac")
    if script.exists():
        return [sys.executable, str(script)]
    if SPDKFAC.exists():
        return [sys.executable, str(SPDKFAC)]
    return [sys.executable, "-m", "lightning_spdkfac.cli"]


def clean_env() -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items()
        if k not in _LAUNCH_VARS and not k.startswith(_LAUNCH_PREFIXES)
    }
    env["OMP_NUM_THREADS"] = "1"  # one thread per process: 2 ranks on 2 cores, and the reference run likewise
    env["PYTHONWARNINGS"] = "ignore"
    return env


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``."""
    if not Path("/proc").is_dir():  # not Linux: ask the kernel whether the group has anybody left
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:  # state, ppid, pgrp
            members.append(int(stat.parent.name))
    return members


def wait_group(pgid: int, seconds: float) -> list[int]:
    """Wait up to ``seconds`` for the group to empty; its live members then."""
    deadline = time.monotonic() + seconds
    while (members := _group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return members


def _describe(pids: list[int]) -> str:
    def cmdline(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:
            return "?"

    return "; ".join(f"{pid}: {cmdline(pid)}" for pid in pids)


def kill_group(pgid: int) -> None:
    """SIGKILL every process of the group and wait (briefly) until none is left."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return
    wait_group(pgid, 10)


def start_cli(args: Sequence[str], cwd: Path = REPO, env: Mapping[str, str] | None = None) -> subprocess.Popen:
    """``spdkfac ARGS`` as a subprocess in its own session, in :func:`clean_env` plus ``env``; end it with
    :func:`finish_cli`, which kills its process group."""
    return subprocess.Popen([*spdkfac_cmd(), *args], cwd=cwd, env={**clean_env(), **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish_cli(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """Wait for a :func:`start_cli` run (the test fails past ``timeout`` seconds); its whole process group is
    killed after, whatever happened."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(proc.args)} timed out after {timeout:.0f} s\n{err[-3000:]}")
    finally:
        wait_group(proc.pid, 10)
        kill_group(proc.pid)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_cli(config: Path, root: Path, *overrides: str, timeout: float) -> tuple[dict, float, str]:
    """``spdkfac fit --config CONFIG --trainer.default_root_dir=ROOT ...`` in a new session.

    Returns TimeToAccuracy's JSON, the wall time and stderr. The process group (rank 0 and the ranks
    Lightning started) is killed on timeout and, in any case, before returning.
    """
    cmd = [*spdkfac_cmd(), "fit", "--config", str(config), f"--trainer.default_root_dir={root}", *overrides]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    pgid = proc.pid  # start_new_session: the child leads a new process group, which its own children join
    try:
        # The ranks Lightning starts inherit the pipes: communicate() returns once ALL of them closed
        # them, i.e. when rank 1 exited too, not just rank 0.
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(pgid)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} timed out after {timeout} s (process group killed)\n"
                    f"stdout:\n{out[-3000:]}\nstderr:\n{err[-5000:]}")
    finally:
        if proc.poll() is None:  # an exception other than the timeout (e.g. KeyboardInterrupt)
            kill_group(pgid)
            proc.wait()
    wall = time.monotonic() - t0
    # A rank that closed its pipes may still be exiting for a moment: give the group a few seconds to
    # empty by itself; whatever is left then is a leak (reported, and killed all the same).
    left = wait_group(pgid, 10)
    left_desc = _describe(left)
    kill_group(pgid)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited with {proc.returncode}\nstderr:\n{err[-5000:]}"
    assert not left, f"processes of {' '.join(cmd)} still alive 10 s after it finished (killed): {left_desc}"
    return json.loads((root / "time_to_accuracy.json").read_text()), wall, err

