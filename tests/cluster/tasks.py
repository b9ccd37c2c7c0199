"""Cluster tasks for the multi-host tests: one ``ds-train`` per TF_CONFIG task, each inside its own namespace host.

Nothing here sets ``GLOO_SOCKET_IFNAME``, ``MASTER_ADDR`` or ``MASTER_PORT``: inside a namespace gloo would otherwise
bind to 127.0.0.1 and the other hosts' connections would be refused, so a run passes only if the pack picks the
interface holding the task's address from TF_CONFIG.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ds_lightning.testing.netns import Cluster, Host
from tests.helpers.runner import REPO, example_config, free_port, quiet_trainer_args, worker_env

RUN_TIMEOUT = 240.0


@dataclass
class Task:
    """One started TF_CONFIG task."""

    role: str
    index: int
    host: Host
    proc: subprocess.Popen[Any]
    log: Path

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def __str__(self) -> str:
        return f"{self.role} {self.index} on {self.host.address}"


def fit_args(config: str, root: Path, *extra: str) -> list[str]:
    """``ds-train fit`` of an example config, one process per task, quiet, its TrainingReport to root/report.json."""
    return [
        "fit",
        *example_config(config),
        *quiet_trainer_args(root),
        "--trainer.devices=1",
        f"--trainer.callbacks.output_json={root / 'report.json'}",
        *extra,
    ]


def cluster_spec(jobs: dict[str, list[Host]]) -> dict[str, list[str]]:
    """TF_CONFIG's ``cluster``: every task at its host's address, all on one port (free on loopback, so in every
    namespace too: each has its own ports)."""
    port = free_port()
    return {job: [f"{host.address}:{port}" for host in hosts] for job, hosts in jobs.items()}


def start(
    spec: dict[str, list[str]],
    role: str,
    index: int,
    host: Host,
    args: list[str],
    logs: Path,
    tf_extra: dict[str, Any] | None = None,
) -> Task:
    """One TF_CONFIG task; ``tf_extra``: more keys of its TF_CONFIG (TFJob's ``"environment": "cloud"``)."""
    tf_config = {"cluster": spec, "task": {"type": role, "index": index}, **(tf_extra or {})}
    return start_with(host, role, index, args, logs, TF_CONFIG=json.dumps(tf_config))


def start_with(host: Host, role: str, index: int, args: list[str], logs: Path, **variables: str) -> Task:
    """``ds-train`` on ``host`` with ``variables`` on top of a clean environment, which sets no interface, address or
    port of its own."""
    env = worker_env()
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(variable, None)
    env.update(variables)
    log = logs / f"{role}{index}.log"
    with log.open("w") as out:
        proc = host.run([sys.executable, "-m", "ds_lightning.cli", *args], cwd=REPO, env=env, stdout=out, stderr=out)
    return Task(role, index, host, proc, log)


def start_all(
    spec: dict[str, list[str]],
    hosts: dict[str, list[Host]],
    args: list[str],
    logs: Path,
    tf_extra: dict[str, Any] | None = None,
) -> list[Task]:
    """Starts every task of ``spec`` (servers first, as an operator would) with the same arguments."""
    order = sorted(spec, key=lambda job: job != "ps")
    logs.mkdir(parents=True, exist_ok=True)
    return [start(spec, job, i, host, args, logs, tf_extra) for job in order for i, host in enumerate(hosts[job])]


def wait(tasks: list[Task], timeout: float = RUN_TIMEOUT) -> float:
    """Waits for every task (killing any still alive after ``timeout`` seconds); returns the seconds waited."""
    begin = time.monotonic()
    for task in tasks:
        try:
            task.proc.wait(timeout=max(0.1, timeout - (time.monotonic() - begin)))
        except subprocess.TimeoutExpired:
            task.proc.kill()
            task.proc.wait()
    return time.monotonic() - begin


def assert_succeeded(tasks: list[Task]) -> None:
    for task in tasks:
        assert task.proc.returncode == 0, f"{task} exited with {task.proc.returncode}:\n{task.output[-5000:]}"


def step_of(heartbeat: Path, rank: int) -> int:
    """The last global step rank ``rank``'s Heartbeat callback wrote, or -1 before its first batch."""
    path = Path(f"{heartbeat}.rank{rank}")
    return int(path.read_text()) if path.exists() else -1


def wait_for_step(heartbeat: Path, rank: int, step: int, tasks: list[Task], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while step_of(heartbeat, rank) < step:
        dead = [t for t in tasks if t.proc.poll() is not None]
        assert not dead, f"{dead[0]} exited with {dead[0].proc.returncode} early:\n{dead[0].output[-4000:]}"
        assert time.monotonic() < deadline, f"rank {rank} did not reach step {step} in {timeout} s"
        time.sleep(0.1)


class ListenerWatch:
    """Polls every host's listening TCP sockets (``ss -ltnp`` in its namespace) while a run goes on.

    ``seen[host.name]`` collects ``(address, port, process)`` of every listener observed at any poll.
    """

    def __init__(self, cluster: Cluster, interval: float = 0.5) -> None:
        self.cluster = cluster
        self.interval = interval
        self.seen: dict[str, set[tuple[str, int, str]]] = {host.name: set() for host in cluster.hosts}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True, name="listener-watch")

    def _poll(self) -> None:
        while not self._stop.is_set():
            for host in self.cluster.hosts:
                try:
                    found = self.cluster.listening(host)
                except Exception:  # a poll racing teardown; the next one counts
                    continue
                # The process text carries the fd, which differs per socket; keep just the program name.
                self.seen[host.name].update((addr, port, proc.split(",")[0]) for addr, port, proc in found)
            self._stop.wait(self.interval)

    def __enter__(self) -> ListenerWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def outside_the_spec(self) -> dict[str, list[tuple[str, int, str]]]:
        """Per host, every listener on an address other than that host's own cluster address."""
        return {
            host.name: sorted(s for s in self.seen[host.name] if s[0] != host.address)
            for host in self.cluster.hosts
            if any(s[0] != host.address for s in self.seen[host.name])
        }


def run_watched(
    cluster: Cluster,
    hosts: dict[str, list[Host]],
    args: list[str],
    logs: Path,
    during: Callable[[list[Task]], None] | None = None,
    tf_extra: dict[str, Any] | None = None,
) -> list[Task]:
    """Runs every task of ``hosts`` to success (``during(tasks)`` acts on the running cluster) and checks the run.

    Checks: rank 0's TrainingReport (``logs/report.json``) shows learning (val_acc > 0.5), and every host's
    listeners stayed on its own cluster address, with the rendezvous store seen on the chief (so the watch could not
    pass by seeing nothing).
    """
    spec = cluster_spec(hosts)
    with ListenerWatch(cluster) as watch:
        tasks = start_all(spec, hosts, args, logs, tf_extra)
        if during is not None:
            during(tasks)
        wait(tasks)
    assert_succeeded(tasks)
    # Learning happened across the hosts: 5x chance. Short async runs, a cut link among them, vary by 10+ points;
    # accuracy targets are the loopback tests' business.
    assert json.loads((logs / "report.json").read_text())["val_acc"] > 0.5
    assert watch.outside_the_spec() == {}
    chief = cluster.hosts[0]
    store_port = int(spec[next(iter(spec))][0].rpartition(":")[2])
    assert (chief.address, store_port) in {(a, p) for a, p, _ in watch.seen[chief.name]}, watch.seen
    for host in cluster.hosts:
        assert watch.seen[host.name], f"no listener ever seen on {host.name}"
    return tasks
