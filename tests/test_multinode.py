"""Two "nodes" on one machine: ``torchrun --nnodes=2 --node_rank=0|1 --master_addr=127.0.0.1``.

Each node is a separate torchrun (one process per node, ``Trainer(num_nodes=2, devices=1,
strategy="spdkfac")`` from configs/digits_spdkfac.yaml), exactly as on two hosts of a cluster.
Lightning sees torchelastic's environment and launches nothing itself. Each rank writes the K-FAC
plan it trained with; fusion groups, factor order and inverse placement must be identical on both
nodes (every rank plans from rank 0's broadcast measurements). Both torchrun process groups are
killed at the end, whatever happens.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers.processes import clean_env, kill_group, wait_group

from lightning_spdkfac.multiprocess import free_port

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "digits_spdkfac.yaml"
TORCHRUN = Path(sys.executable).with_name("torchrun")


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed next to this interpreter")
def every_step_config(tmp_path: Path) -> Path:
    """configs/digits_spdkfac.yaml with factors every step and inverses every 5 (the paper's setting,
    not the library's default 5 / 50): the SPD fusion plan is made after 8 factor steps, within the
    12 steps this test runs."""
    config = yaml.safe_load(CONFIG.read_text())
    config["kfac"].update(factor_update_steps=1, inv_update_steps=5)  # the config's kfac: group
    path = tmp_path / "digits_spdkfac_every_step.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.slow  # ~13 s: two torchrun "nodes"
def test_two_nodes_with_torchrun_train_and_plan_identically(tmp_path):
    config = every_step_config(tmp_path)
    port = free_port()
    env = clean_env()
    env["PYTHONPATH"] = f"{REPO / 'tests'}:{env.get('PYTHONPATH', '')}".rstrip(":")
    procs = []
    for node in (0, 1):
        cmd = [str(TORCHRUN), "--nnodes=2", "--nproc_per_node=1", f"--node_rank={node}",
               "--master_addr=127.0.0.1", f"--master_port={port}",
               "-m", "lightning_spdkfac.cli", "fit", "--config", str(config),
               "--trainer.num_nodes=2", "--trainer.devices=1", "--trainer.max_steps=12",
               "--trainer.limit_val_batches=0", f"--trainer.default_root_dir={tmp_path / 'run'}",
               "--trainer.callbacks+=multinode_probe.PlanDump", f"--trainer.callbacks.out_dir={tmp_path}"]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True))
    outputs = []
    try:
        deadline = time.monotonic() + 240
        for p in procs:
            try:
                outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                for q in procs:
                    kill_group(q.pid)
                pytest.fail("two-node torchrun run timed out after 240 s (process groups killed)")
    finally:
        for p in procs:
            wait_group(p.pid, 10)
            kill_group(p.pid)
    for node, (p, (_out, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"node {node} exited with {p.returncode}\n{err[-4000:]}"

    plans = [json.loads((tmp_path / f"plan_rank{r}.json").read_text()) for r in (0, 1)]
    assert [p["node_rank"] for p in plans] == [0, 1] and all(p["world_size"] == 2 for p in plans)
    assert all(p["env"]["TORCHELASTIC_RUN_ID"] for p in plans)  # launched by torchrun, not by Lightning
    assert all(p["kfac_steps"] == 12 and p["factor_steps"] == 12 for p in plans)
    keys = ("schedule", "pipelined", "measuring", "order", "groups", "owners")
    assert {k: plans[0][k] for k in keys} == {k: plans[1][k] for k in keys}
    assert plans[0]["pipelined"] and not plans[0]["measuring"]  # the SPD plan was made (profile_steps [3, 8))
