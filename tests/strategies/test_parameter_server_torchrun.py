"""ds_parameter_server under torchrun: the last rank serves, the others train, and a restarted group resumes exactly.

``torchrun --standalone --nproc-per-node=3`` runs 2 workers and 1 server (rank 2). Bulk synchronous
(``max_staleness=0``) training is deterministic, so the run must end with the parameters of the same config run by
``ds-train`` (2 workers, the chief starting the server), 1e-5; also when worker 1 is SIGKILLed at a step and torchrun
(``--max-restarts=1``) restarts every process, the server included, and ``BackupAndRestore`` resumes. Its control
resumes the same backup without the servers' momentum and ends far away.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ds_lightning.testing.processes import worker_env
from tests.helpers.controls import assert_far, without_optimizer_state
from tests.helpers.runner import REPO, ds_train

pytestmark = pytest.mark.multiprocess

MAX_STEPS = 12
BACKUP_EVERY = 2
KILL_AT = 7
RUN_TIMEOUT = 240.0


def _config(root: Path, kill: bool = False) -> Path:
    """A digits run of MAX_STEPS bulk-synchronous steps on 1 server, backed up every BACKUP_EVERY steps."""
    killer = f"""
    - class_path: tests.helpers.callbacks.KillAt
      init_args: {{step: {KILL_AT}, rank: 1}}"""
    text = f"""seed_everything: 0
trainer:
  accelerator: cpu
  devices: 2
  strategy:
    class_path: ds_lightning.strategies.ParameterServerStrategy
    init_args:
      num_servers: 1
      max_staleness: 0
      timeout: 60
  max_steps: {MAX_STEPS}
  limit_val_batches: 0
  num_sanity_val_steps: 0
  enable_progress_bar: false
  enable_model_summary: false
  enable_checkpointing: false
  logger: false
  default_root_dir: {root}
  callbacks:{killer if kill else ""}
    - class_path: ds_lightning.callbacks.BackupAndRestore
      init_args:
        backup_dir: {root / "backups"}
        every_n_train_steps: {BACKUP_EVERY}
        async_save: false
        keep: {MAX_STEPS // BACKUP_EVERY}
    - class_path: tests.helpers.callbacks.SaveParams
      init_args:
        path: {root / "final"}
model:
  class_path: ds_lightning.demos.DigitsClassifier
  init_args:
    hidden_sizes: [16]
    lr: 0.05
data:
  class_path: ds_lightning.demos.DigitsDataModule
  init_args:
    batch_size: 8
"""
    root.mkdir(parents=True, exist_ok=True)
    path = root / "config.yaml"
    path.write_text(text)
    return path


def _torchrun(config: Path, *options: str) -> str:
    env = worker_env(rendezvous=False, pythonpath=[REPO])
    for variable in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(variable, None)
    # As docs/fault-tolerance.md says to launch: a fresh store each round. With torchrun's shared agent store, a
    # restarted round once timed out forming the servers' channel under load (not reproduced alone; issue 14's note).
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=3",
        "--monitor-interval=0.1",
        *options,
        "-m",
        "ds_lightning.cli",
        "fit",
        f"--config={config}",
        "--trainer.devices=3",  # = --nproc-per-node; the last rank serves
    ]
    proc = subprocess.run(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=RUN_TIMEOUT
    )
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-8000:]}"
    return proc.stdout


def _final(root: Path) -> dict:
    assert not (root / "final.rank2.pt").exists(), "rank 2 trained; it should have served"
    return torch.load(root / "final.rank0.pt", weights_only=True)


@pytest.fixture(scope="module")
def expected(tmp_path_factory) -> dict:
    """The same config run by ds-train: 2 workers, the chief starts the server; no torchrun, no fault."""
    root = tmp_path_factory.mktemp("ds_train")
    ds_train(["fit", f"--config={_config(root)}"], timeout=RUN_TIMEOUT)
    return _final(root)


def test_under_torchrun_the_last_rank_serves_and_the_run_ends_as_under_ds_train(tmp_path, expected):
    output = _torchrun(_config(tmp_path))
    final = _final(tmp_path)
    assert "parameter server 0 serving" in output
    assert final["world_size"] == 2
    assert final["global_step"] == MAX_STEPS
    assert expected["global_step"] == MAX_STEPS
    torch.testing.assert_close(final["state_dict"], expected["state_dict"], rtol=1e-5, atol=1e-5)


def test_a_killed_worker_restarts_the_group_and_backup_and_restore_resumes_exactly(tmp_path, expected):
    output = _torchrun(_config(tmp_path, kill=True), "--max-restarts=1")
    final = _final(tmp_path)
    assert "BackupAndRestore: resumed at step" in output, output[-6000:]
    assert final["global_step"] == MAX_STEPS
    assert final["batches_this_run"] < MAX_STEPS, "the restarted group trained from scratch"
    torch.testing.assert_close(final["state_dict"], expected["state_dict"], rtol=1e-5, atol=1e-5)

    # The control: the backup the restarted group resumed from, with the servers' momentum dropped, resumed by
    # ds-train, ends far from the run; so the comparison above sees whether the servers got their state back.
    step = int(re.search(r"BackupAndRestore: resumed at step (\d+)", output)[1])
    assert step == KILL_AT // BACKUP_EVERY * BACKUP_EVERY  # the last backup before the kill
    resumed_from = tmp_path / "backups" / f"backup-step{step:09d}.ckpt"
    dropped = without_optimizer_state(resumed_from, tmp_path / "no_momentum.ckpt")
    control_root = tmp_path / "control"
    ds_train(["fit", f"--config={_config(control_root)}", f"--ckpt_path={dropped}"], timeout=RUN_TIMEOUT)
    control = _final(control_root)
    assert control["global_step"] == MAX_STEPS
    assert control["batches_this_run"] == MAX_STEPS - step  # it resumed the backup
    assert_far(expected["state_dict"], control["state_dict"], 1e-3, "the resume without the servers' momentum")
