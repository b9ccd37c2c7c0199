"""Which processes of a ``ds_parameter_server`` run serve, under each launch: ``TF_CONFIG``, torchrun or ours.

- ``TF_CONFIG``: its ``ps`` tasks serve (:func:`tf_config_servers`), the chief and workers train.
- torchrun starts (and, after a failure, restarts) every process of the run, servers included, as TF's ``ps`` tasks
  are tasks of the cluster: with ``WORLD_SIZE`` processes and ``num_servers`` servers, ranks ``0..W-1`` are the
  workers (``W = WORLD_SIZE - num_servers``) and rank ``W + i`` is server ``i`` (:class:`TorchrunPart`). The workers
  form their process group among themselves; the server channel forms from torchrun's store at
  ``MASTER_ADDR:MASTER_PORT``.
- Our own launcher starts the servers beside the workers and tells each its index.

Whatever the launch, a server's rank is ``num_workers + server_index`` (:func:`server_environment`).
"""

from __future__ import annotations

import os
import socket

from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.environments import LightningEnvironment, TorchElasticEnvironment
from typing_extensions import override

from ds_lightning.environments._interfaces import is_loopback, route_source_address
from ds_lightning.environments.tf_config import TFConfig, TFConfigError

__all__ = ["TorchrunPart", "server_environment", "tf_config_servers", "torchrun_part"]


def tf_config_servers(config: TFConfig, num_servers_arg: int | None) -> tuple[int, int | None]:
    """The number of servers ``TF_CONFIG`` lists, and this task's server index (``None`` unless it is a ``ps`` task).

    Raises:
        TFConfigError: when ``num_servers`` was given and differs from the ``ps`` tasks, naming both and the fix.

    """
    servers = len(config.cluster["ps"])  # adopt_tf_config refused a cluster without a ps job
    if num_servers_arg not in (None, servers):
        raise TFConfigError(
            f"num_servers={num_servers_arg} but TF_CONFIG lists {servers} ps task(s); leave num_servers"
            " unset under TF_CONFIG, or make the cluster spec match."
        )
    return servers, config.task_index if config.task_type == "ps" else None


def server_environment(num_workers: int, server_index: int) -> LightningEnvironment:
    """A server's environment: the workers' world, and the rank after theirs (``num_workers + server_index``)."""
    env = LightningEnvironment()
    env.set_world_size(num_workers)
    env.set_global_rank(num_workers + server_index)
    return env


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
