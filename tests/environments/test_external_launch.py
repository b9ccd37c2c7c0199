"""A strategy that trains in one process refuses a scheduler's launch of several (the SLURM job: test_slurm.py)."""

from __future__ import annotations

import pytest

from ds_lightning.environments.external_launch import refuse_several_launched

TORCHRUN = {
    "WORLD_SIZE": "2",
    "RANK": "0",
    "GROUP_RANK": "0",
    "LOCAL_RANK": "0",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "run1",
}


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*TORCHRUN, "SLURM_NTASKS", "SLURM_JOB_NAME"):
        monkeypatch.delenv(name, raising=False)


def test_torchruns_two_ranks_are_refused_naming_the_count_and_the_fix(
    no_launcher: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"torchrun started WORLD_SIZE=2 processes.*--nproc-per-node=1.*or use X"):
        refuse_several_launched("ds_model_parallel", "use X")
    monkeypatch.setenv("WORLD_SIZE", "1")
    refuse_several_launched("ds_model_parallel", "use X")  # one process: nothing to refuse


def test_one_srun_task_or_an_interactive_allocation_is_fine(no_launcher: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_NTASKS", "1")
    refuse_several_launched("ds_model_parallel", "use X")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_JOB_NAME", "interactive")  # Lightning's sign that srun did not start this process
    refuse_several_launched("ds_model_parallel", "use X")
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    with pytest.raises(ValueError, match="srun started SLURM_NTASKS=2"):
        refuse_several_launched("ds_model_parallel", "use X")
