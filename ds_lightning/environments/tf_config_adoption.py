"""How a strategy adopts ``TF_CONFIG``: find the one in use, refuse a cluster it cannot run, and pick the environment.

Lightning detects cluster environments from a fixed list that ``TF_CONFIG`` is not on, so the ds strategies adopt it
themselves, before the launcher is configured (``ClusterStrategy.adopt_cluster``): each chief/worker task becomes one
Lightning node running :class:`~ds_lightning.environments.TFConfigEnvironment`.
"""

from __future__ import annotations

import os

from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.environments import LightningEnvironment

from ds_lightning.environments.tf_config import TFConfig, TFConfigEnvironment, TFConfigError

__all__ = ["adopt_tf_config", "check_tf_config", "tf_config_in_use"]


def tf_config_in_use(env: ClusterEnvironment | None) -> TFConfig | None:
    """The ``TF_CONFIG`` this process runs under: its environment's, or the variable's when no other was chosen."""
    if isinstance(env, TFConfigEnvironment):
        return env.config
    if (env is None or type(env) is LightningEnvironment) and TFConfigEnvironment.detect():
        return TFConfig.from_json(os.environ["TF_CONFIG"])
    return None


def check_tf_config(strategy_name: str, config: TFConfig, num_nodes: int, serves_parameters: bool = False) -> None:
    """Refuse a ``TF_CONFIG`` cluster the strategy cannot run, naming the field and the fix.

    Raises:
        TFConfigError: for an ``evaluator`` task; for ``ps`` tasks or a ``ps`` job unless ``serves_parameters``, and
            for no ``ps`` job when it does; for a ``num_nodes`` other than 1 or the number of training tasks.

    """
    if config.task_type == "evaluator":
        raise TFConfigError(
            f"TF_CONFIG field `task.type` is 'evaluator', which {strategy_name} does not run; evaluate with"
            " `ds-train validate` outside the cluster instead."
        )
    if serves_parameters and not config.cluster.get("ps"):
        raise TFConfigError(
            f"TF_CONFIG has no `cluster.ps` job, so {strategy_name} has no parameter servers; list at least one"
            ' ps task, e.g. "ps": ["10.0.0.3:2222"], and start it with the same ds-train command.'
        )
    if not serves_parameters and config.task_type == "ps":
        raise TFConfigError(
            f"TF_CONFIG field `task.type` is 'ps' (index {config.task_index}), but {strategy_name} has no parameter"
            " servers. Start this task with strategy='ds_parameter_server', or remove it from the cluster."
        )
    if not serves_parameters and "ps" in config.cluster:
        raise TFConfigError(
            f"TF_CONFIG field `cluster.ps` lists {len(config.cluster['ps'])} parameter server(s), which {strategy_name}"
            " would never use; remove `ps` from the cluster or use strategy='ds_parameter_server'."
        )
    tasks = config.num_training_tasks
    if num_nodes not in (1, tasks):
        raise TFConfigError(
            f"TF_CONFIG lists {tasks} training task(s) (chief + workers) but Trainer(num_nodes={num_nodes});"
            f" use num_nodes={tasks} or leave it at its default."
        )


def adopt_tf_config(
    strategy_name: str, env: ClusterEnvironment | None, num_nodes: int, serves_parameters: bool = False
) -> tuple[ClusterEnvironment | None, int]:
    """Use ``TF_CONFIG`` when it is set and no more specific environment was chosen, and validate it.

    Returns:
        The environment to use (a training task's :class:`TFConfigEnvironment`; a ``ps`` task's is left as it was)
        and the number of nodes (one per chief/worker task).

    Raises:
        TFConfigError: see :func:`check_tf_config`.

    """
    config = tf_config_in_use(env)
    if config is None:
        return env, num_nodes
    check_tf_config(strategy_name, config, num_nodes, serves_parameters)
    if config.is_training_task and not isinstance(env, TFConfigEnvironment):
        env = TFConfigEnvironment()
    return env, config.num_training_tasks
