"""Which SLURM job BackupAndRestore requeues, and when it leaves requeueing to others (no SLURM needed here).

The requeue itself, on a real SLURM cluster, is in tests/cluster/test_slurm.py.
"""

from __future__ import annotations

import signal
import subprocess
from typing import Any

import pytest
from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment

from ds_lightning.backup.requeue import SlurmRequeue, slurm_job_id
from ds_lightning.callbacks import BackupAndRestore


@pytest.fixture
def in_a_job(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "1234")
    monkeypatch.setenv("SLURM_NTASKS", "1")


def test_the_job_is_slurms_job_id_or_the_array_task(in_a_job: None, monkeypatch: pytest.MonkeyPatch) -> None:
    assert slurm_job_id() == "1234"
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "77")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert slurm_job_id() == "77_3"
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3; rm -rf /")  # never handed to scontrol
    assert slurm_job_id() is None


def test_lightnings_auto_requeue_setting_decides(in_a_job: None) -> None:
    assert SlurmRequeue.of(SLURMEnvironment()) == SlurmRequeue("1234", signal.SIGUSR1)
    assert SlurmRequeue.of(SLURMEnvironment(requeue_signal=signal.SIGHUP)) == SlurmRequeue("1234", signal.SIGHUP)
    assert SlurmRequeue.of(SLURMEnvironment(auto_requeue=False)) is None  # the job script decides on the exit code
    assert SlurmRequeue.of(LightningEnvironment()) is None


def test_the_requeue_signal_is_watched_and_the_handler_is_named(in_a_job: None) -> None:
    requeue = SlurmRequeue.of(SLURMEnvironment(requeue_signal=signal.SIGHUP))
    assert requeue is not None
    assert "BackupAndRestore handles SIGHUP in place of Lightning's handler" in requeue.describe()
    assert "requeues job 1234" in requeue.describe()
    BackupAndRestore("backups", signals=("SIGTERM",))  # SIGHUP need not be listed: setup adds the requeue signal


def test_scontrol_is_called_for_the_job_and_its_failure_is_reported(
    in_a_job: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[list[str]] = []
    answers = {
        "requeue": subprocess.CompletedProcess([], 0, "", ""),
        "show": subprocess.CompletedProcess([], 0, "JobId=1234 JobState=RUNNING PreemptTime=2026-12-05T11:25:15", ""),
    }

    def run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        calls.append(command)
        assert kwargs["timeout"] > 0  # a hung scontrol must not hold the job past its grace time
        return answers[command[1]]

    monkeypatch.setattr(subprocess, "run", run)
    requeue = SlurmRequeue("1234", signal.SIGUSR1)
    assert requeue.requeue() and requeue.preempted()
    assert calls == [["scontrol", "requeue", "1234"], ["scontrol", "show", "job", "--oneliner", "1234"]]
    answers["show"] = subprocess.CompletedProcess([], 0, "JobId=1234 JobState=RUNNING PreemptTime=None", "")
    assert not requeue.preempted()  # scancel's SIGTERM: the job ends
    answers["requeue"] = subprocess.CompletedProcess([], 1, "", "Requested operation is presently disabled")
    assert not requeue.requeue()
    assert "presently disabled" in caplog.text
