"""Which processes of a ``ds_parameter_server`` run serve, under each launch: ``TF_CONFIG``, torchrun or ours.

- ``TF_CONFIG``: its ``ps`` tasks serve (:func:`tf_config_servers`), the chief and workers train.
- torchrun and SLURM's ``srun`` start every process of the run, servers included, as TF's ``ps`` tasks are tasks of
  the cluster: with ``N`` processes (``WORLD_SIZE``, ``SLURM_NTASKS``) and ``num_servers`` servers, ranks ``0..W-1``
  are the workers (``W = N - num_servers``) and rank ``W + i`` is server ``i`` (:class:`SchedulerPart`). The workers
  form their process group among themselves; the server channel forms from the store at
  ``MASTER_ADDR:MASTER_PORT`` (torchrun's agent's, or rank 0's under SLURM).
- Our own launcher starts the servers beside the workers and tells each its index.

Whatever the launch, a server's rank is ``num_workers + server_index`` (:func:`server_environment`).
"""

from __future__ import annotations

import socket
from typing import Any

from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment, TorchElasticEnvironment
from typing_extensions import override

from ds_lightning.environments._interfaces import is_loopback, route_source_address
from ds_lightning.environments.tf_config import TFConfig, TFConfigError

__all__ = [
    "SchedulerPart",
    "SlurmPart",
    "TorchrunPart",
    "scheduler_part",
    "server_environment",
    "tf_config_servers",
]


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


class SchedulerPart(ClusterEnvironment):
    """A scheduler's world as one process of a ``ds_parameter_server`` run sees it: the workers' world.

    torchrun and SLURM's ``srun`` start every process of the run, servers included; the last ``num_servers`` ranks
    serve. ``world_size`` is the number of workers (the size of their process group); ``global_rank`` stays the
    scheduler's, so a server's is ``num_workers + server_index`` as in every other launch. Mixed in before the
    scheduler's own environment (:class:`TorchrunPart`, :class:`SlurmPart`).

    Args:
        num_servers: how many of the scheduler's last ranks serve.
        **environment: the scheduler environment's own arguments.

    """

    #: Whether the scheduler restarts every process after one fails (torchrun), so a server stops on a lost worker
    #: instead of going on with the survivors.
    restarts_whole_group = False

    def __init__(self, num_servers: int, **environment: Any) -> None:
        super().__init__(**environment)
        self.num_servers = num_servers
        # The scheduler's whole world: always a concrete environment, mixed in after this class (see the subclasses).
        self.num_workers = super().world_size() - num_servers  # type: ignore[safe-super]

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
        return None  # checked when the part was made (see scheduler_part); servers are not devices x nodes

    def channel_host(self) -> str:
        """The address this process's end of the server channel binds to: the one on the route to the main address."""
        main = self.main_address
        if is_loopback(main):
            return "127.0.0.1"
        return route_source_address(main, self.main_port) or socket.gethostname()


class TorchrunPart(SchedulerPart, TorchElasticEnvironment):
    """torchrun's environment as one process of a ``ds_parameter_server`` run sees it (see :class:`SchedulerPart`)."""

    restarts_whole_group = True


class SlurmPart(SchedulerPart, SLURMEnvironment):
    """SLURM's environment (``srun``'s tasks) as one process of a ``ds_parameter_server`` run sees it.

    The last ``num_servers`` tasks serve; with SLURM's default block distribution they are on the last node(s). Keeps
    the user's ``auto_requeue`` and ``requeue_signal`` (see :class:`SchedulerPart`).
    """


def scheduler_part(env: ClusterEnvironment | None, num_servers: int) -> SchedulerPart | None:
    """Split torchrun's or SLURM's world into workers and servers; ``None`` under another launch. Safe to call again.

    Raises:
        ValueError: when the scheduler's world leaves no worker beside ``num_servers`` servers, naming both and the
            fix.

    """
    if isinstance(env, SchedulerPart):
        return env
    if isinstance(env, TorchElasticEnvironment):
        launch, how = "torchrun started WORLD_SIZE", "torchrun with at least {n} processes in all (--nproc-per-node"
        how += " x nodes, with --trainer.devices=--nproc-per-node)"
    elif isinstance(env, SLURMEnvironment):
        launch, how = "srun started SLURM_NTASKS", "the job with at least {n} tasks in all (--ntasks-per-node x"
        how += " --nodes, with --trainer.devices=--ntasks-per-node)"
    else:
        return None
    world = env.world_size()
    if world <= num_servers:
        raise ValueError(
            f"{launch}={world} process(es), and ds_parameter_server(num_servers={num_servers}) makes the last"
            f" {num_servers} of them parameter servers, which leaves no worker. Start"
            f" {how.format(n=num_servers + 1)}, or lower num_servers."
        )
    if isinstance(env, SLURMEnvironment):
        return SlurmPart(num_servers, auto_requeue=env.auto_requeue, requeue_signal=env.requeue_signal)
    return TorchrunPart(num_servers)
