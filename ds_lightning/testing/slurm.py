"""A real SLURM cluster on a :class:`~ds_lightning.testing.netns.Cluster`: munge, slurmctld and one slurmd per host.

Debian's daemons (``slurm-wlm``, ``munge``) run unmodified. Each host of the namespace cluster becomes one SLURM node,
``node<i>``: its ``slurmd`` runs in that host's network namespace, in a UTS namespace whose host name is the node name
(slurmd finds its node by host name) and a mount namespace whose ``/etc/hosts`` names every node (Lightning's
``SLURMEnvironment`` takes the main address from ``SLURM_NODELIST``, a list of node names). ``slurmctld`` runs on the
first host beside its slurmd. Everything lives in one folder: the configuration, munge's key and socket, the daemons'
state and logs. Jobs started by ``sbatch``/``srun`` run inside their node's namespaces, as on a real machine.

Two partitions share every node: ``batch`` (the default), whose jobs a job of ``urgent`` preempts. Preemption
requeues (``PreemptMode=REQUEUE``) after ``GraceTime``: SLURM sends the job's tasks SIGTERM at once and SIGKILL at
the end of the grace time, then queues the job again.

Example:
    >>> with Cluster(2) as hosts, SlurmCluster(hosts, Path("/tmp/slurm")) as slurm:  # doctest: +SKIP
    ...     job = slurm.sbatch(["examples/slurm/mirrored.sbatch"], env)
    ...     slurm.wait_for_end(job)

Needs root; :func:`missing_slurm` says what else is missing.

"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from ds_lightning.testing.netns import Cluster, Host

__all__ = ["SLURM_TOOLS", "SlurmCluster", "SlurmError", "missing_slurm"]

#: What the cluster runs: Debian's ``slurm-wlm`` (daemons and client commands) and ``munge``, plus util-linux.
SLURM_TOOLS = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "sinfo", "munged", "nsenter", "unshare")
#: Job states after which a job runs no more (unless requeued).
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
START_TIMEOUT_S = 60.0


class SlurmError(RuntimeError):
    """A SLURM command failed, or the cluster did not come up; the message carries the daemons' last log lines."""


def missing_slurm(search_path: str | None = None) -> str | None:
    """Why no SLURM cluster can run here (``None``: one can), naming the package to install."""
    missing = [tool for tool in SLURM_TOOLS if shutil.which(tool, path=search_path) is None]
    if missing:
        return f"needs SLURM and munge ({', '.join(missing)} not found): apt-get install slurm-wlm munge"
    return None


class SlurmCluster:
    """SLURM on ``cluster``'s hosts, every file under ``root``; a context manager that stops every daemon it started.

    Args:
        cluster: an entered namespace cluster; host ``i`` becomes node ``node<i>``, host 0 also runs the controller.
        root: a folder of its own for the configuration, state and logs.
        cpus: CPUs each node offers.
        grace_time_s: how long a preempted ``batch`` job may run after its SIGTERM.

    """

    def __init__(self, cluster: Cluster, root: Path, cpus: int = 2, grace_time_s: int = 30) -> None:
        self.cluster = cluster
        self.root = root
        self.cpus = cpus
        self.grace_time_s = grace_time_s
        self.nodes = [f"node{i}" for i in range(len(cluster.hosts))]
        self.conf = root / "slurm.conf"
        self._daemons: list[subprocess.Popen[Any]] = []

    @property
    def submit_host(self) -> Host:
        """Where client commands run (the controller's host)."""
        return self.cluster.hosts[0]

    def environment(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with ``SLURM_CONF`` pointing at this cluster."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        return env

    # --- lifecycle ----------------------------------------------------------------------------------------------

    def __enter__(self) -> SlurmCluster:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _start(self) -> None:
        reason = missing_slurm()
        if reason is not None:
            raise SlurmError(reason)
        for folder in ("munge", "state", *(f"spool.{n}" for n in self.nodes)):
            (self.root / folder).mkdir(parents=True, exist_ok=True)
        (self.root / "munge").chmod(0o711)  # munged wants others to reach its socket, not to list the folder
        key = self.root / "munge" / "key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{host.address} {node}\n" for host, node in zip(self.cluster.hosts, self.nodes, strict=True)
        )
        (self.root / "hosts").write_text(hosts)
        self.conf.write_text(self._configuration())
        munge = self.root / "munge"
        self._spawn(
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={munge / 'socket'}",
                f"--key-file={key}",
                f"--pid-file={munge / 'pid'}",
                f"--seed-file={munge / 'seed'}",
                f"--log-file={munge / 'log'}",
            ],
            self.root / "munged.out",
        )
        self._wait_for(lambda: (munge / "socket").exists(), "munged to create its socket")
        self._on_node(0, ["slurmctld", "-D", "-i"], self.root / "slurmctld.out")
        for index in range(len(self.nodes)):
            self._on_node(index, ["slurmd", "-D"], self.root / f"slurmd.{self.nodes[index]}.out")
        self._wait_for(self._nodes_idle, "every node to be idle (sinfo)")

    def _configuration(self) -> str:
        controller, root = self.cluster.hosts[0], self.root
        lines = [
            "ClusterName=dslightning",
            f"SlurmctldHost={self.nodes[0]}({controller.address})",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={root / 'munge' / 'socket'}",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root}/spool.%n",
            f"SlurmctldPidFile={root}/slurmctld.pid",
            f"SlurmdPidFile={root}/slurmd.%n.pid",
            f"SlurmctldLogFile={root}/slurmctld.log",
            f"SlurmdLogFile={root}/slurmd.%n.log",
            # No cgroups: slurmd shares this machine's; process groups track a job's processes.
            "ProctrackType=proctrack/pgid",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerParameters=sched_interval=2",
            "ReturnToService=2",
            "KillWait=10",
            "MinJobAge=3600",  # finished jobs stay visible to scontrol for the tests' checks
            "JobRequeue=1",
            "PreemptType=preempt/partition_prio",
            "PreemptMode=REQUEUE",
        ]
        lines += [
            f"NodeName={node} NodeAddr={host.address} CPUs={self.cpus} State=UNKNOWN"
            for node, host in zip(self.nodes, self.cluster.hosts, strict=True)
        ]
        nodes = ",".join(self.nodes)
        lines += [
            f"PartitionName=batch Nodes={nodes} Default=YES MaxTime=INFINITE State=UP PriorityTier=1"
            f" GraceTime={self.grace_time_s}",
            f"PartitionName=urgent Nodes={nodes} MaxTime=INFINITE State=UP PriorityTier=2",
        ]
        return "\n".join(lines) + "\n"

    def _spawn(self, command: Sequence[str], log: Path) -> subprocess.Popen[Any]:
        with log.open("w") as out:
            proc = subprocess.Popen(
                list(command), env=self.environment(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self._daemons.append(proc)
        return proc

    def _on_node(self, index: int, command: Sequence[str], log: Path) -> None:
        """``command`` in host ``index``'s network namespace, with the node's host name and ``/etc/hosts``."""
        host, node = self.cluster.hosts[index], self.nodes[index]
        inner = f"mount --bind {self.root / 'hosts'} /etc/hosts && hostname {node} && exec {' '.join(command)}"
        self._spawn(["nsenter", f"--net=/run/netns/{host.name}", "unshare", "--uts", "--mount", "sh", "-c", inner], log)

    def _wait_for(self, ready: Any, what: str, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [p for p in self._daemons if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise SlurmError(f"SLURM did not come up: waited for {what}. {self.logs()}")
            time.sleep(0.5)

    def _nodes_idle(self) -> bool:
        done = self.run(["sinfo", "--noheader", "--Node", "--format=%N %T"], check=False)
        states = dict(line.split()[:2] for line in done.stdout.splitlines() if line.strip())
        return all(states.get(node, "").rstrip("*") == "idle" for node in self.nodes)

    def logs(self, lines: int = 30) -> str:
        """The last ``lines`` of every daemon's log, for error messages."""
        parts = []
        for log in sorted(self.root.glob("*.out")) + sorted(self.root.glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log.name}:\n" + "\n".join(tail))
        return "\n".join(parts)

    def close(self) -> None:
        """Cancel every job, stop the daemons (SIGTERM, then SIGKILL); never raises."""
        if self._daemons and all(p.poll() is None for p in self._daemons):
            with contextlib.suppress(Exception):
                self.run(["scancel", "--full", "--user=root"], check=False, timeout=10)
        for proc in reversed(self._daemons):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self._daemons:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
        self._daemons.clear()

    # --- clients ------------------------------------------------------------------------------------------------

    def run(
        self,
        command: Sequence[str],
        env: Mapping[str, str] | None = None,
        check: bool = True,
        timeout: float = 60.0,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """A client command (``sbatch``, ``srun``, ``scontrol``...) on the submit host, with ``env`` and ``SLURM_CONF``.

        Raises:
            SlurmError: with ``check``, on a non-zero exit, with its output.

        """
        full = ["nsenter", f"--net=/run/netns/{self.submit_host.name}", *command]
        done = subprocess.run(
            full, env=self.environment(env), capture_output=True, text=True, timeout=timeout, cwd=cwd, check=False
        )
        if check and done.returncode != 0:
            raise SlurmError(f"{' '.join(command)} exited with {done.returncode}: {done.stderr or done.stdout}")
        return done

    def sbatch(self, arguments: Sequence[str], env: Mapping[str, str] | None = None, cwd: Path | None = None) -> str:
        """Submit a batch job (``sbatch --parsable arguments...``); returns its job id."""
        return self.run(["sbatch", "--parsable", *arguments], env=env, cwd=cwd).stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields for the job (``JobState``, ``ExitCode``, ``Restarts``, ``NodeList``...)."""
        text = self.run(["scontrol", "show", "job", "--oneliner", job_id]).stdout
        return dict(field.split("=", 1) for field in text.split() if "=" in field)

    def wait_for_state(self, job_id: str, states: Sequence[str], timeout: float) -> dict[str, str]:
        """Wait until the job's state is one of ``states``; returns its fields.

        Raises:
            SlurmError: on timeout, with the job's fields and the daemons' logs.

        """
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") in states:
                return fields
            if time.monotonic() > deadline:
                raise SlurmError(f"job {job_id} not {'/'.join(states)} after {timeout} s: {fields}\n{self.logs()}")
            time.sleep(0.5)

    def release_requeued(self, job_id: str, timeout: float) -> dict[str, str]:
        """Wait until the job is back in the queue after a requeue, then let it start now; returns its fields.

        SLURM holds a requeued batch job for about two minutes (its ``BeginTime``) to let the old run's epilog
        finish; with nothing to clean up, the tests start it at once, as an administrator may.
        """
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") == "PENDING" and int(fields.get("Restarts", "0")) > 0:
                self.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"])
                return fields
            if fields.get("JobState") in ENDED or time.monotonic() > deadline:
                raise SlurmError(f"job {job_id} was not requeued: {fields}\n{self.logs()}")
            time.sleep(0.5)

    def wait_for_end(self, job_id: str, timeout: float) -> dict[str, str]:
        """Wait until the job has ended (and is not about to be requeued); returns its fields."""
        return self.wait_for_state(job_id, ENDED, timeout)
