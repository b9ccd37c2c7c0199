"""ds_parameter_server's split of a scheduler's world (torchrun's, SLURM's) into workers and servers."""

from __future__ import annotations

import signal

import pytest
from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment, TorchElasticEnvironment

from ds_lightning.environments.parameter_server_roles import SlurmPart, TorchrunPart, scheduler_part


@pytest.fixture
def slurm_task(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    for name, value in {
        "SLURM_NTASKS": "4",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_NODELIST": "node[0-1]",
        "SLURM_JOB_ID": "12",
    }.items():
        monkeypatch.setenv(name, value)


def test_slurms_last_tasks_serve_and_the_users_requeue_settings_stay(slurm_task: None) -> None:
    part = scheduler_part(SLURMEnvironment(auto_requeue=False, requeue_signal=signal.SIGHUP), num_servers=1)
    assert isinstance(part, SlurmPart)
    assert (part.world_size(), part.num_workers, part.global_rank(), part.server_index) == (3, 3, 3, 0)
    assert (part.auto_requeue, part.requeue_signal) == (False, signal.SIGHUP)
    assert part.main_address == "node0"
    assert scheduler_part(part, num_servers=1) is part  # safe to call again
    assert not part.restarts_whole_group  # srun leaves the others running: a server goes on with the survivors


def test_a_worker_task_is_no_server(slurm_task: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_PROCID", "2")
    part = scheduler_part(SLURMEnvironment(), num_servers=1)
    assert part is not None and part.server_index is None and part.global_rank() == 2


def test_a_job_without_room_for_a_worker_is_refused_naming_the_fix(slurm_task: None) -> None:
    with pytest.raises(ValueError, match=r"srun started SLURM_NTASKS=4 .* at least 5 tasks in all"):
        scheduler_part(SLURMEnvironment(), num_servers=4)


def test_torchrun_keeps_its_own_split(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"WORLD_SIZE": "3", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", "29500")
    part = scheduler_part(TorchElasticEnvironment(), num_servers=1)
    assert isinstance(part, TorchrunPart) and part.restarts_whole_group and part.world_size() == 2
    with pytest.raises(ValueError, match="torchrun started WORLD_SIZE=3"):
        scheduler_part(TorchElasticEnvironment(), num_servers=3)
    assert scheduler_part(LightningEnvironment(), num_servers=1) is None
