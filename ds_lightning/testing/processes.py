"""Starting training processes for tests and benchmarks: a free rendezvous port and a clean environment."""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from pathlib import Path

__all__ = ["LAUNCH_VARIABLES", "free_port", "worker_env"]

#: Variables a launcher, a cluster or a parameter-server run sets for its children; a fresh launch must not inherit
#: them, or it would think it is one rank of the outer run.
LAUNCH_VARIABLES = (
    "LOCAL_RANK",
    "NODE_RANK",
    "WORLD_SIZE",
    "GROUP_RANK",
    "RANK",
    "TF_CONFIG",
    "PL_GLOBAL_SEED",
    "DS_PS_SERVER",
    "DS_PS_SERVERS_STARTED",
)


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_env(
    threads: int = 1,
    rendezvous: bool = True,
    pythonpath: Sequence[str | Path] = (),
    warnings: str = "ignore::DeprecationWarning",
    **extra: str,
) -> dict[str, str]:
    """This process's environment without any launcher's or cluster's variables, for a fresh launch.

    Args:
        threads: ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` (one per process keeps several ranks on few cores fast).
        rendezvous: also set ``MASTER_ADDR=127.0.0.1`` and a free ``MASTER_PORT`` for a multi-process launch.
        pythonpath: folders put first on ``PYTHONPATH`` (e.g. a repository whose modules the children import).
        warnings: ``PYTHONWARNINGS`` of the children.
        **extra: further variables, set last.

    Returns:
        The environment to pass to ``subprocess``.

    """
    env = dict(os.environ)
    for var in LAUNCH_VARIABLES:
        env.pop(var, None)
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        PYTHONPATH=os.pathsep.join(filter(None, [*map(str, pythonpath), env.get("PYTHONPATH", "")])),
        PYTHONWARNINGS=warnings,
    )
    if rendezvous:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env.update(extra)
    return env
