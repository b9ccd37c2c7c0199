"""``ds_parameter_server`` under torchrun: the last ``num_servers`` of torchrun's ranks serve, the others train.

torchrun starts (and, after a failure, restarts) every process of the run, servers included, as TF's ``ps`` tasks are
tasks of the cluster: with ``WORLD_SIZE`` processes and ``num_servers`` servers, ranks ``0..W-1`` are the workers
(``W = WORLD_SIZE - num_servers``) and rank ``W + i`` is server ``i``. The workers form their process group among
themselves; the server channel forms from torchrun's store at ``MASTER_ADDR:MASTER_PORT``.
"""

from __future__ import annotations

import os
import socket

from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from typing_extensions import override

from ds_lightning.environments._interfaces import is_loopback
from ds_lightning.environments.torchelastic import route_source_address

RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"


class TorchrunPart(TorchElasticEnvironment):
    """torchrun's environment as one process of a ``ds_parameter_server`` run sees it: the workers' world.

    ``world_size`` is the number of workers (the size of their process group); ``global_rank`` stays torchrun's
    ``RANK``, so a server's is ``num_workers + server_index`` as in every other launch.

    Args:
        num_servers: how many of torchrun's last ranks serve.

    """

    def __init__(self, num_servers: int) -> None:
        super().__init__()
        self.num_servers = num_servers
        self.num_workers = int(os.environ["WORLD_SIZE"]) - num_servers

    @property
    def server_index(self) -> int | None:
        """This process's server index, or ``None`` on a worker."""
        rank = self.global_rank()
        return rank - self.num_workers if rank >= self.num_workers else None

    @override
    def world_size(self) -> int:
        return self.num_workers

    @override
    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        return None  # checked when the part was made (see torchrun_part); servers are not devices x nodes

    def channel_host(self) -> str:
        """The address this process's end of the server channel binds to: the one on the route to ``MASTER_ADDR``."""
        if is_loopback(self.main_address):
            return "127.0.0.1"
        return route_source_address(self.main_address, self.main_port) or socket.gethostname()


def torchrun_part(env: ClusterEnvironment | None, num_servers: int) -> TorchrunPart | None:
    """Split torchrun's world into workers and servers; ``None`` outside torchrun. Safe to call again.

    Raises:
        ValueError: when torchrun's world leaves no worker beside ``num_servers`` servers, naming both and the fix.

    """
    if isinstance(env, TorchrunPart):
        return env
    if not isinstance(env, TorchElasticEnvironment):
        return None
    world = env.world_size()
    if world <= num_servers:
        raise ValueError(
            f"torchrun started WORLD_SIZE={world} process(es), and ds_parameter_server(num_servers={num_servers})"
            f" makes the last {num_servers} of them parameter servers, which leaves no worker. Start torchrun with"
            f" at least {num_servers + 1} processes in all (--nproc-per-node x nodes, with"
            " --trainer.devices=--nproc-per-node), or lower num_servers."
        )
    return TorchrunPart(num_servers)


def store_round() -> int:
    """Which group the store at ``MASTER_ADDR:MASTER_PORT`` serves now: 0, or torchrun's restarts when it is shared.

    Under torchrun's default the workers share the agent's store, which outlives a restart and keeps the old group's
    keys; the agents restart together, so their restart count tells the rounds apart. Otherwise (no torchrun, or
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: rank 0 hosts it) each group's store is new, and an agent started again
    (a host back) counts its restarts from 0, so the count must not be used.
    """
    if os.environ.get(AGENT_STORE_ENV) != "True":
        return 0
    return int(os.environ.get(RESTART_ENV, "0"))
