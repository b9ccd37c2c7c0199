"""A real SLURM cluster on namespace hosts (``ds_lightning.testing.slurm``): Debian's slurmctld, slurmd and munge.

Every job is started by ``sbatch`` with the ready-made scripts in ``examples/slurm/`` (or by ``srun`` itself), and
every process is one of ``srun``'s tasks, placed by SLURM on the nodes it chose: Lightning's ``SLURMEnvironment``
(or ds_parameter_server's split of it) is what the runs see, and nothing here sets an address, a port or an interface.

Preemption, twice, both ending with the parameters of the same job uninterrupted:

- ``scancel --signal=USR1``, as ``#SBATCH --signal=USR1@120`` does before the time limit: BackupAndRestore, the one
  handler of SIGUSR1, backs up, rank 0 requeues the job with ``scontrol requeue`` (Lightning's auto-requeue), and
  the requeued job resumes. Control: the same resume from a backup without its optimizer state ends far away.
- a job of the higher-priority partition takes the nodes: SLURM sends SIGTERM, BackupAndRestore backs up within the
  partition's ``GraceTime`` and requeues the job (``PreemptMode=REQUEUE`` would requeue it only at the grace time's
  end: a job that ends inside it is failed, not requeued).

SLURM holds a requeued job for about two minutes before it may start again; the tests let it start at once
(:meth:`~ds_lightning.testing.slurm.SlurmCluster.release_requeued`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ds_lightning.testing import processes
from ds_lightning.testing.netns import Cluster
from ds_lightning.testing.slurm import SlurmCluster, missing_slurm
from tests.cluster.conftest import require_cluster, unavailable_action
from tests.helpers.controls import assert_far, distance, without_optimizer_state
from tests.helpers.runner import CONFIGS, REPO

pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("slurm")]

EXAMPLES = REPO / "examples" / "slurm"
JOB_TIMEOUT_S = 240.0
MAX_STEPS = 24
SIGNAL_AT_STEP = 6


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """Two SLURM nodes (namespace hosts), started once for the module."""
    require_cluster()
    reason = missing_slurm()
    if reason is not None:
        if unavailable_action(reason, os.environ) == "fail":
            pytest.fail(f"DS_LIGHTNING_REQUIRE_CLUSTER=1 (.ci/run), but {reason}", pytrace=False)
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("slurm")
    with Cluster(2) as hosts, SlurmCluster(hosts, root / "cluster") as cluster:
        yield cluster


def job_env() -> dict[str, str]:
    """What a user's shell would export to sbatch: ds-train on PATH, no address, port or interface of ours."""
    env = processes.worker_env(rendezvous=False, pythonpath=[REPO])
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(variable, None)
    return env


def submit(slurm: SlurmCluster, script: str, root: Path, *args: str, options: tuple[str, ...] = (), **env: str) -> str:
    """``sbatch`` an example script from the repository root, its log to ``root/job.out``."""
    root.mkdir(parents=True, exist_ok=True)
    sbatch = [f"--output={root / 'job.out'}", *options, str(EXAMPLES / script), *args]
    return slurm.sbatch(sbatch, env={**job_env(), **env}, cwd=REPO)


def quiet(root: Path) -> list[str]:
    return [
        "--trainer.accelerator=cpu",
        f"--trainer.default_root_dir={root}",
        "--trainer.enable_progress_bar=false",
        "--trainer.logger=false",
        f"--trainer.callbacks.output_json={root / 'report.json'}",
        "--trainer.callbacks+=tests.helpers.callbacks.RecordPlacement",
        f"--trainer.callbacks.path={root / 'placement'}",
    ]


def placements(root: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(root.glob("placement.rank*.json"))]


def assert_completed(slurm: SlurmCluster, job: str, root: Path, restarts: int = 0) -> dict[str, str]:
    fields = slurm.wait_for_end(job, JOB_TIMEOUT_S)
    log = (root / "job.out").read_text(errors="replace") if (root / "job.out").exists() else "(no log)"
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), f"{fields}\n{log[-6000:]}"
    assert int(fields["Restarts"]) == restarts, f"{fields}\n{log[-6000:]}"
    return fields


# --- every ds strategy as a SLURM job --------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["ds_mirrored", "ds_pipeline"])
def test_sbatch_trains_across_both_nodes_through_lightnings_slurm_environment(
    slurm: SlurmCluster, tmp_path: Path, strategy: str
) -> None:
    script = {"ds_mirrored": "mirrored.sbatch", "ds_pipeline": "pipeline.sbatch"}[strategy]
    job = submit(slurm, script, tmp_path, *quiet(tmp_path), "--trainer.max_steps=12", "--trainer.limit_val_batches=2")
    fields = assert_completed(slurm, job, tmp_path)
    assert fields["NodeList"] == "node[0-1]"
    ranks = placements(tmp_path)
    assert [(r["global_rank"], r["host"]) for r in ranks] == [(0, "node0"), (1, "node1")], ranks
    assert {(r["environment"], r["world_size"], r["num_nodes"]) for r in ranks} == {("SLURMEnvironment", 2, 2)}
    report = json.loads((tmp_path / "report.json").read_text())  # rank 0's TrainingReport, reduced over both ranks
    assert report["world_size"] == 2 and report["steps_timed"] > 0, report


def test_srun_alone_starts_the_same_run(slurm: SlurmCluster, tmp_path: Path) -> None:
    """``srun`` from a login shell, no batch script: the processes are its tasks all the same."""
    command = ["srun", "--nodes=2", "--ntasks-per-node=1", "ds-train", "fit", f"--config={CONFIGS / 'mirrored.yaml'}"]
    args = [*quiet(tmp_path), "--trainer.num_nodes=2", "--trainer.devices=1", "--trainer.max_steps=8"]
    done = slurm.run([*command, *args], env=job_env(), timeout=JOB_TIMEOUT_S, check=False, cwd=REPO)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    ranks = placements(tmp_path)
    assert [(r["host"], r["environment"]) for r in ranks] == [
        ("node0", "SLURMEnvironment"),
        ("node1", "SLURMEnvironment"),
    ]


def test_parameter_server_serves_from_the_tasks_slurm_places_last(slurm: SlurmCluster, tmp_path: Path) -> None:
    """2 nodes x 2 tasks: tasks 0-2 train (two on node0, one on node1), task 3 serves (on node1, SLURM's block
    distribution), every one of them started by srun."""
    job = submit(slurm, "parameter_server.sbatch", tmp_path, *quiet(tmp_path), "--trainer.max_steps=10")
    assert_completed(slurm, job, tmp_path)
    ranks = placements(tmp_path)
    assert [(r["global_rank"], r["host"]) for r in ranks] == [(0, "node0"), (1, "node0"), (2, "node1")], ranks
    assert {(r["environment"], r["num_workers"], r["num_servers"]) for r in ranks} == {("SlurmPart", 3, 1)}
    assert all("SLURMEnvironment" in r["environment_bases"] for r in ranks)
    log = (tmp_path / "job.out").read_text()
    assert "3 worker(s), 1 server(s)" in log, log[-4000:]


def test_model_parallel_runs_as_one_task_and_refuses_a_job_of_two(slurm: SlurmCluster, tmp_path: Path) -> None:
    """ds_model_parallel splits the model inside one process: its script asks for one task. Two tasks would train
    two copies apart; that job fails at start, naming the fix."""
    one, two = tmp_path / "one", tmp_path / "two"
    job = submit(slurm, "model_parallel.sbatch", one, *quiet(one), "--trainer.max_steps=6")
    assert_completed(slurm, job, one)
    assert [r["host"] for r in placements(one)] == ["node0"]
    job = submit(slurm, "model_parallel.sbatch", two, *quiet(two), options=("--nodes=2",))
    fields = slurm.wait_for_end(job, JOB_TIMEOUT_S)
    log = (two / "job.out").read_text()
    assert fields["JobState"] == "FAILED", fields
    assert "ds_model_parallel trains in one process, but srun started SLURM_NTASKS=2" in log, log[-4000:]
    assert "ds_pipeline" in log


# --- preemption: back up, requeue, resume exactly --------------------------------------------------------------------


def exact_config(root: Path, backups: Path) -> Path:
    """A digits run of MAX_STEPS steps under ds_mirrored, backed up only when preempted, its parameters saved."""
    path = root / "config.yaml"
    root.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"""seed_everything: 0
trainer:
  accelerator: cpu
  strategy:
    class_path: ds_lightning.strategies.MirroredStrategy
    init_args:
      timeout: 60
  max_steps: {MAX_STEPS}
  limit_val_batches: 0
  num_sanity_val_steps: 0
  enable_progress_bar: false
  enable_model_summary: false
  enable_checkpointing: false
  logger: false
  default_root_dir: {root}
  callbacks:
    - class_path: ds_lightning.callbacks.BackupAndRestore
      init_args:
        backup_dir: {backups}
        every_n_train_steps: null
        grace_seconds: 60
    - class_path: tests.helpers.callbacks.SaveParams
      init_args:
        path: {root / "final"}
    - class_path: tests.helpers.callbacks.Heartbeat
      init_args:
        path: {root / "heartbeat"}
        delay_s: 0.25
model:
  class_path: ds_lightning.demos.DigitsClassifier
  init_args:
    hidden_sizes: [16]
    lr: 0.05
data:
  class_path: ds_lightning.demos.DigitsDataModule
  init_args:
    batch_size: 16
"""
    )
    return path


def run_exact(slurm: SlurmCluster, root: Path, backups: Path | None = None) -> str:
    config = exact_config(root, backups or root / "backups")
    return submit(slurm, "mirrored.sbatch", root, DS_CONFIG=str(config))


def final_params(root: Path) -> dict[str, torch.Tensor]:
    saved = torch.load(root / "final.rank0.pt", weights_only=False)
    assert saved["global_step"] == MAX_STEPS, saved["global_step"]
    return saved["state_dict"]


def wait_for_step(root: Path, step: int, slurm: SlurmCluster, job: str) -> None:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    beat = root / "heartbeat.rank0"
    while not (beat.exists() and int(beat.read_text() or -1) >= step):
        assert time.monotonic() < deadline, f"step {step} not reached: {slurm.job(job)}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def uninterrupted(slurm: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    root = tmp_path_factory.mktemp("uninterrupted")
    job = run_exact(slurm, root)
    assert_completed(slurm, job, root)
    return final_params(root)


def test_sigusr1_backs_up_requeues_with_scontrol_and_the_requeued_job_ends_exact(
    slurm: SlurmCluster, tmp_path: Path, uninterrupted: dict[str, torch.Tensor]
) -> None:
    job = run_exact(slurm, tmp_path)
    wait_for_step(tmp_path, SIGNAL_AT_STEP, slurm, job)
    slurm.run(["scancel", "--signal=USR1", job])
    slurm.release_requeued(job, JOB_TIMEOUT_S)
    assert_completed(slurm, job, tmp_path, restarts=1)
    log = (tmp_path / "job.out").read_text()
    # One handler, ours, and the log says so; Lightning's would have saved an hpc checkpoint inside its handler.
    assert "BackupAndRestore handles SIGUSR1 in place of Lightning's handler" in log, log[-6000:]
    assert f"BackupAndRestore: requeueing SLURM job {job} (scontrol requeue)" in log, log[-6000:]
    assert "Handling auto-requeue signal" not in log
    assert not list(tmp_path.rglob("hpc_ckpt_*.ckpt"))
    backups = sorted((tmp_path / "backups").glob("backup-step*.ckpt"))
    assert len(backups) == 1 and SIGNAL_AT_STEP < int(backups[0].stem[len("backup-step") :]) < MAX_STEPS, backups
    assert "BackupAndRestore: resuming from" in log
    result = final_params(tmp_path)
    print(f"requeued by SIGUSR1 vs uninterrupted: max |diff| = {distance(result, uninterrupted):.3g}")
    torch.testing.assert_close(result, uninterrupted, rtol=0, atol=1e-6)

    # Control: the requeued job resumed from that backup without its momentum ends far from the uninterrupted one.
    control = tmp_path / "control"
    (control / "backups").mkdir(parents=True)
    without_optimizer_state(backups[0], control / "backups" / backups[0].name)
    job = run_exact(slurm, control)
    assert_completed(slurm, job, control)
    assert_far(final_params(control), uninterrupted, 1e-3, "the resume without optimizer state")


def test_preemption_by_a_higher_priority_job_backs_up_in_the_grace_time_and_slurm_requeues_it(
    slurm: SlurmCluster, tmp_path: Path, uninterrupted: dict[str, torch.Tensor]
) -> None:
    job = run_exact(slurm, tmp_path)
    wait_for_step(tmp_path, SIGNAL_AT_STEP, slurm, job)
    urgent = slurm.sbatch(
        ["--partition=urgent", "--nodes=2", "--exclusive", f"--output={tmp_path / 'urgent.out'}", "--wrap=sleep 1"],
        env=job_env(),
    )
    slurm.release_requeued(job, JOB_TIMEOUT_S)
    assert_completed(slurm, job, tmp_path, restarts=1)
    assert slurm.job(urgent)["JobState"] == "COMPLETED"
    log = (tmp_path / "job.out").read_text()
    assert "BackupAndRestore: preempted; backed up at step" in log, log[-6000:]
    # A job that exits inside its GraceTime is not requeued by SLURM: rank 0 saw the PreemptTime and requeued it.
    assert f"BackupAndRestore: requeueing SLURM job {job} (scontrol requeue)" in log, log[-6000:]
    result = final_params(tmp_path)
    print(f"preempted (SIGTERM, GraceTime) vs uninterrupted: max |diff| = {distance(result, uninterrupted):.3g}")
    torch.testing.assert_close(result, uninterrupted, rtol=0, atol=1e-6)
    shutil.rmtree(tmp_path / "backups", ignore_errors=True)
