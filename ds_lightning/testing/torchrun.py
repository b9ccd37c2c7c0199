"""Elastic ``torchrun`` nodes on a network-namespace cluster: one torchrun agent per host, c10d rendezvous on one.

Inside a namespace the host name resolves to no address of the host, so each agent is told its own address
(``--local-addr``; it becomes ``MASTER_ADDR`` when that node is rank 0) and the rendezvous host is told that it hosts
the c10d store (``--rdzv-conf=is_host=1``; torchrun would otherwise not recognise the endpoint as its own).

Example:
    >>> with Cluster(2) as cluster:  # doctest: +SKIP
    ...     a, b = cluster.hosts
    ...     endpoint = (a.address, free_port())
    ...     args = ["-m", "ds_lightning.cli", "fit", "--config", "run.yaml"]
    ...     nodes = [start_node(h, endpoint, args, logs / f"{h.name}.log", rdzv_host=h is a) for h in (a, b)]

"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ds_lightning.testing.netns import Host
from ds_lightning.testing.processes import worker_env

__all__ = ["ElasticNode", "start_node", "torchrun_command", "wait_all"]

#: torchrun's switch that makes every round publish a fresh store for the workers (see :func:`start_node`).
SHARE_STORE_VARIABLE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
#: torchrun and gloo read these; a node must find its own, not the test process's.
_INHERITED = ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TORCHELASTIC_RUN_ID")


@dataclass
class ElasticNode:
    """One started torchrun agent (and, below it, its workers) on a namespace host."""

    host: Host
    proc: subprocess.Popen[Any]
    log: Path

    @property
    def output(self) -> str:
        """Everything the agent and its workers printed so far."""
        return self.log.read_text(errors="replace")

    def __str__(self) -> str:
        return f"torchrun on {self.host.address}"


def torchrun_command(
    host: Host,
    endpoint: tuple[str, int],
    args: Sequence[str],
    *,
    rdzv_host: bool,
    nnodes: str = "1:2",
    nproc_per_node: int = 1,
    max_restarts: int = 3,
    last_call_s: float = 3.0,
    run_id: str = "ds-elastic",
) -> list[str]:
    """The ``torchrun`` command line of one node: c10d rendezvous at ``endpoint``, then ``python <args>``.

    Args:
        host: the node's host; its address is the agent's ``--local-addr``.
        endpoint: the rendezvous store's ``(address, port)``, on the ``rdzv_host`` node.
        args: what each worker runs after ``python``, e.g. ``["-m", "ds_lightning.cli", "fit", ...]``.
        rdzv_host: whether this node hosts the c10d store.
        nnodes: torchrun's ``--nnodes`` (``MIN:MAX`` for an elastic job).
        nproc_per_node: workers per node.
        max_restarts: how often a failed group is restarted.
        last_call_s: how long a round waits for more nodes once ``MIN`` joined.
        run_id: the job's rendezvous id, the same on every node.

    """
    conf = f"is_host={int(rdzv_host)},last_call_timeout={last_call_s:g},join_timeout=120"
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc_per_node}",
        f"--max-restarts={max_restarts}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint[0]}:{endpoint[1]}",
        f"--rdzv-id={run_id}",
        f"--rdzv-conf={conf}",
        f"--local-addr={host.address}",
        "--monitor-interval=0.2",
        *args,
    ]


def start_node(
    host: Host,
    endpoint: tuple[str, int],
    args: Sequence[str],
    log: Path,
    *,
    rdzv_host: bool,
    cwd: str | Path | None = None,
    pythonpath: Sequence[str | Path] = (),
    **options: Any,
) -> ElasticNode:
    """Starts one node's torchrun agent inside ``host``, its output (and its workers') appended to ``log``.

    Args:
        host: where the agent runs.
        endpoint: see :func:`torchrun_command`.
        args: see :func:`torchrun_command`.
        log: the file the agent's and workers' output is appended to (a restarted node appends to the same one).
        rdzv_host: see :func:`torchrun_command`.
        cwd: the workers' working directory.
        pythonpath: folders put first on the workers' ``PYTHONPATH``.
        **options: further :func:`torchrun_command` options.

    Returns:
        The started node; its cluster kills it at teardown if it is still alive.

    """
    env = worker_env(rendezvous=False, pythonpath=pythonpath)
    for variable in _INHERITED:
        env.pop(variable, None)
    # torch 2.13's agents share rank 0's store with the workers, but a node that joins a later round (a host back
    # after a restart) then waits forever for the store's address, which rank 0 published only in the first round.
    env[SHARE_STORE_VARIABLE] = "1"
    cmd = torchrun_command(host, endpoint, args, rdzv_host=rdzv_host, **options)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as out:
        proc = host.run(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    return ElasticNode(host, proc, log)


def wait_all(nodes: Sequence[ElasticNode], timeout: float) -> None:
    """Waits for every node's agent to exit; kills (SIGKILL) any still alive after ``timeout`` seconds in all."""
    deadline = time.monotonic() + timeout
    for node in nodes:
        try:
            node.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            node.proc.kill()
            node.proc.wait(timeout=30)
