"""Cluster set-up shared by the multi-process strategies: TF_CONFIG adoption and exit clean-up."""

from __future__ import annotations

import atexit
from typing import Literal

from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.utilities.distributed import _destroy_dist_connection

from ds_lightning.environments._interfaces import pin_socket_interfaces
from ds_lightning.environments.tf_config import TFConfigEnvironment, TFConfigError

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
BACKENDS = ("gloo", "nccl", "mpi", "ucc")
_EXIT_HOOK_REGISTERED = False


def check_launch_options(strategy: str, timeout: object, start_method: object, process_group_backend: object) -> None:
    """Validate the launch options every multi-process strategy takes, naming the bad value and the fix.

    Raises:
        ValueError: for a non-positive timeout, an unknown start method or an unknown backend.

    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout={timeout!r} must be a number of seconds > 0, e.g. {strategy}(timeout=600).")
    if start_method not in ("popen", "spawn", "fork", "forkserver"):
        raise ValueError(
            f"start_method={start_method!r} is not supported; choose 'popen', 'spawn', 'fork' or 'forkserver'."
        )
    if process_group_backend is not None and process_group_backend not in BACKENDS:
        raise ValueError(
            f"process_group_backend={process_group_backend!r} is unknown; use one of {list(BACKENDS)} or None"
            " to pick NCCL on CUDA and gloo otherwise."
        )


def adopt_tf_config(
    strategy_name: str, env: ClusterEnvironment | None, num_nodes: int
) -> tuple[ClusterEnvironment | None, int]:
    """Use ``TF_CONFIG`` when it is set and no more specific environment was chosen, and validate it.

    Returns:
        The environment to use and the number of nodes (one per chief/worker task).

    Raises:
        TFConfigError: for ``ps``/``evaluator`` tasks, a ``ps`` job in the cluster, or a conflicting ``num_nodes``.

    """
    if (env is None or type(env) is LightningEnvironment) and TFConfigEnvironment.detect():
        env = TFConfigEnvironment()
    if not isinstance(env, TFConfigEnvironment):
        return env, num_nodes
    config = env.config
    if config.task_type == "ps":
        raise TFConfigError(
            f"TF_CONFIG field `task.type` is 'ps' (index {config.task_index}), but {strategy_name} has no parameter"
            " servers. Start this task with strategy='ds_parameter_server', or remove it from the cluster."
        )
    if config.task_type == "evaluator":
        raise TFConfigError(
            f"TF_CONFIG field `task.type` is 'evaluator', which {strategy_name} does not run; evaluate with"
            " `ds-train validate` outside the cluster instead."
        )
    if "ps" in config.cluster:
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
    return env, tasks


def destroy_process_group_at_exit(backend: str) -> None:
    """Destroy a non-NCCL default process group at interpreter exit.

    Lightning does this for NCCL only; a gloo group left alive at exit can abort the process ("terminate called
    without an active exception") after training has succeeded.
    """
    global _EXIT_HOOK_REGISTERED
    if not _EXIT_HOOK_REGISTERED and backend != "nccl":
        atexit.register(_destroy_dist_connection)
        _EXIT_HOOK_REGISTERED = True


def pin_interfaces(env: ClusterEnvironment | None) -> str | None:
    """Under ``TF_CONFIG``, make gloo and NCCL use the interface that holds this task's address.

    See :func:`~ds_lightning.environments._interfaces.pin_socket_interfaces`; call before the process group starts.
    """
    if not isinstance(env, TFConfigEnvironment):
        return None
    return pin_socket_interfaces(env.config.own_address[0])
