"""Which processes of a ``ds_parameter_server`` run serve: ``TF_CONFIG``'s ``ps`` tasks, or the launcher's servers."""

from __future__ import annotations

from lightning.fabric.plugins.environments import LightningEnvironment

from ds_lightning.environments.tf_config import TFConfig, TFConfigError


def tf_config_servers(config: TFConfig, num_servers_arg: int | None) -> tuple[int, int | None]:
    """The number of servers ``TF_CONFIG`` lists, and this task's server index (``None`` unless it is a ``ps`` task).

    Raises:
        TFConfigError: when ``num_servers`` was given and differs from the ``ps`` tasks, naming both and the fix.

    """
    servers = len(config.cluster["ps"])  # adopt_cluster refused a cluster without a ps job
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
