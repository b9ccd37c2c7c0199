"""SLURM's auto-requeue, done by ``BackupAndRestore`` in place of Lightning's own handler.

Under ``SLURMEnvironment(auto_requeue=True)`` (Lightning's default on SLURM) Lightning would catch the requeue signal
(SIGUSR1) itself, save a checkpoint inside the signal handler and run ``scontrol requeue``. ``BackupAndRestore``
installs its handler first, so Lightning's is never registered: the callback backs up at a step every rank agrees on,
and then rank 0 requeues the job the same way Lightning does. Exactly one handler runs, and the log says which.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
from dataclasses import dataclass

from lightning.fabric.plugins.environments import SLURMEnvironment

__all__ = ["SlurmRequeue", "slurm_job_id"]

log = logging.getLogger(__name__)

#: How long ``scontrol requeue`` may take before the run gives up on it (the backup is written already).
SCONTROL_TIMEOUT_S = 60.0
_JOB_ID = re.compile(r"[0-9]+(_[0-9]+)?")


def slurm_job_id() -> str | None:
    """The job to requeue: ``<array job>_<task>`` inside a job array, else ``SLURM_JOB_ID`` (``None`` outside SLURM)."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}" if array_job else os.environ.get("SLURM_JOB_ID")
    return job if job is not None and _JOB_ID.fullmatch(job) else None


@dataclass(frozen=True)
class SlurmRequeue:
    """Requeue SLURM job ``job_id`` after the backup its ``signal`` asked for."""

    job_id: str
    signal: signal.Signals

    @classmethod
    def of(cls, environment: object) -> SlurmRequeue | None:
        """The requeue Lightning's ``environment`` asks for, or ``None`` (not SLURM, or ``auto_requeue=False``)."""
        if not isinstance(environment, SLURMEnvironment) or not environment.auto_requeue:
            return None
        job, sig = slurm_job_id(), environment.requeue_signal
        return cls(job, signal.Signals(sig)) if job is not None and sig is not None else None

    def describe(self) -> str:
        """Which handler runs and what it does: the line the run logs at setup."""
        return (
            f"SLURM auto-requeue is on: BackupAndRestore handles {self.signal.name} in place of Lightning's handler."
            f" On it every rank backs up, then rank 0 requeues job {self.job_id} (scontrol requeue) and the processes"
            " exit."
        )

    def preempted(self) -> bool:
        """Whether SLURM is preempting the job (``scontrol show job`` gives it a ``PreemptTime``).

        A preempted job that exits inside its partition's ``GraceTime`` ends as failed instead of being requeued by
        ``PreemptMode=REQUEUE``: after its backup it must requeue itself, as on the requeue signal.
        """
        done = self._scontrol(["show", "job", "--oneliner", self.job_id])
        if done is None:
            return False
        fields = dict(field.split("=", 1) for field in done.split() if "=" in field)
        return fields.get("PreemptTime", "None") not in ("None", "Unknown", "")

    def requeue(self) -> bool:
        """Run ``scontrol requeue`` for the job; whether SLURM accepted it (a failure is logged with its output)."""
        return self._scontrol(["requeue", self.job_id]) is not None

    def _scontrol(self, arguments: list[str]) -> str | None:
        """``scontrol arguments``'s output, or ``None`` after logging why it failed."""
        command = ["scontrol", *arguments]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as error:
            log.error("BackupAndRestore: %s failed (%s); the job ends, its backup stands.", " ".join(command), error)
            return None
        if done.returncode != 0:
            log.error(
                "BackupAndRestore: %s exited with %d: %s; the job ends, its backup stands.",
                " ".join(command),
                done.returncode,
                (done.stderr or done.stdout).strip(),
            )
            return None
        return done.stdout
