"""A Lightning ``ClusterEnvironment`` driven by TensorFlow's ``TF_CONFIG`` cluster description.

Each TF task is one Lightning *node*: the chief is node 0, worker ``i`` is node ``i + 1`` (or ``i`` when the cluster has
no chief). Lightning's own launcher then starts one process per local device inside each task, exactly as it does for
``num_nodes > 1`` runs, so ``Trainer(devices=2)`` on every task gives a world of ``tasks x 2`` processes.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from lightning.fabric.plugins.environments import ClusterEnvironment
from typing_extensions import override

log = logging.getLogger(__name__)

__all__ = ["TFConfig", "TFConfigEnvironment", "TFConfigError"]

TRAINING_JOBS = ("chief", "worker")
KNOWN_JOBS = ("chief", "worker", "ps", "evaluator")
#: Kubeflow's TFJob names its chief replica ``Master`` (TensorFlow 1's name), and writes that job into TF_CONFIG.
JOB_ALIASES = {"master": "chief"}


class TFConfigError(ValueError):
    """``TF_CONFIG`` is malformed or does not fit the strategy; the message names the offending field."""


def _parse_address(value: Any, where: str) -> tuple[str, int]:
    if not isinstance(value, str) or ":" not in value:
        raise TFConfigError(f"TF_CONFIG field `{where}` must be a 'host:port' string, got {value!r}.")
    host, _, port_text = value.rpartition(":")
    host = host.strip("[]")  # allow "[::1]:2222"
    if not host:
        raise TFConfigError(f"TF_CONFIG field `{where}` has an empty host in {value!r}; write it as 'host:port'.")
    try:
        port = int(port_text)
    except ValueError:
        raise TFConfigError(f"TF_CONFIG field `{where}` has a non-numeric port in {value!r}.") from None
    if not 0 < port < 65536:
        raise TFConfigError(f"TF_CONFIG field `{where}` has port {port} in {value!r}; use a port in 1..65535.")
    return host, port


@dataclass(frozen=True)
class TFConfig:
    """A validated ``TF_CONFIG``: the cluster's jobs and this process's task.

    Attributes:
        cluster: job name to the ``(host, port)`` of each of its tasks, in index order.
        task_type: this task's job, e.g. ``"worker"``.
        task_index: this task's index inside its job.

    """

    cluster: dict[str, list[tuple[str, int]]]
    task_type: str
    task_index: int

    @classmethod
    def from_json(cls, text: str) -> TFConfig:
        """Parse and validate a ``TF_CONFIG`` JSON string.

        Raises:
            TFConfigError: naming the field that is missing or wrong.

        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise TFConfigError(
                f"TF_CONFIG is not valid JSON ({err.msg} at position {err.pos}): {text[:200]!r}"
            ) from None
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: Any) -> TFConfig:
        """Validate an already-decoded ``TF_CONFIG`` mapping.

        Raises:
            TFConfigError: naming the field that is missing or wrong.

        """
        if not isinstance(data, dict):
            raise TFConfigError(
                f"TF_CONFIG must be a JSON object with `cluster` and `task`, got {type(data).__name__}."
            )
        if "cluster" not in data:
            raise TFConfigError('TF_CONFIG has no `cluster` field; add {"cluster": {"worker": ["host:port", ...]}}.')
        raw_cluster = data["cluster"]
        if not isinstance(raw_cluster, dict) or not raw_cluster:
            raise TFConfigError(
                f"TF_CONFIG field `cluster` must be a non-empty object of job lists, got {raw_cluster!r}."
            )
        both = [alias for alias, job in JOB_ALIASES.items() if alias in raw_cluster and job in raw_cluster]
        if both:
            raise TFConfigError(
                f"TF_CONFIG field `cluster` has both `{both[0]}` and `{JOB_ALIASES[both[0]]}`, two names of one job;"
                " keep one of them."
            )
        cluster: dict[str, list[tuple[str, int]]] = {}
        for written, tasks in raw_cluster.items():
            job = JOB_ALIASES.get(written, written)
            if job not in KNOWN_JOBS:
                raise TFConfigError(
                    f"TF_CONFIG field `cluster.{written}` is not a known job; use one of {[*KNOWN_JOBS, *JOB_ALIASES]}."
                )
            if isinstance(tasks, dict):  # TF also accepts {index: address} for sparse clusters
                try:
                    tasks = [tasks[k] for k in sorted(tasks, key=int)]
                except ValueError:
                    raise TFConfigError(f"TF_CONFIG field `cluster.{written}` has non-integer task indices.") from None
            if not isinstance(tasks, list) or not tasks:
                raise TFConfigError(
                    f"TF_CONFIG field `cluster.{written}` must be a non-empty list of 'host:port' strings."
                )
            cluster[job] = [_parse_address(addr, f"cluster.{written}[{i}]") for i, addr in enumerate(tasks)]
        if len(cluster.get("chief", [])) > 1:
            raise TFConfigError(
                f"TF_CONFIG field `cluster.chief` lists {len(cluster['chief'])} tasks; a cluster has one."
            )
        if not any(job in cluster for job in TRAINING_JOBS):
            raise TFConfigError("TF_CONFIG field `cluster` has no `chief` or `worker` job, so nothing would train.")

        if "task" not in data:
            raise TFConfigError('TF_CONFIG has no `task` field; add {"task": {"type": "worker", "index": 0}}.')
        task = data["task"]
        if not isinstance(task, dict):
            raise TFConfigError(f"TF_CONFIG field `task` must be an object with `type` and `index`, got {task!r}.")
        task_type = task.get("type")
        if not isinstance(task_type, str) or not task_type:
            raise TFConfigError(f"TF_CONFIG field `task.type` must name a job such as 'worker', got {task_type!r}.")
        task_type = JOB_ALIASES.get(task_type, task_type)
        if task_type not in cluster and task_type != "evaluator":
            raise TFConfigError(
                f"TF_CONFIG field `task.type` is {task_type!r}, which is not a job in `cluster` ({sorted(cluster)})."
            )
        index = task.get("index", 0)
        if isinstance(index, bool) or not isinstance(index, int):
            raise TFConfigError(f"TF_CONFIG field `task.index` must be an integer, got {index!r}.")
        size = len(cluster.get(task_type, []))
        if task_type != "evaluator" and not 0 <= index < size:
            raise TFConfigError(
                f"TF_CONFIG field `task.index` is {index}, out of range for job {task_type!r} with {size} task(s)"
                f" (valid: 0..{size - 1})."
            )
        return cls(cluster=cluster, task_type=task_type, task_index=index)

    @property
    def training_tasks(self) -> list[tuple[str, int]]:
        """``(job, index)`` of every task that trains, in rank order: the chief first, then the workers."""
        return [(job, i) for job in TRAINING_JOBS for i in range(len(self.cluster.get(job, [])))]

    @property
    def is_training_task(self) -> bool:
        """Whether this task trains (chief or worker), as opposed to serving (ps) or evaluating."""
        return self.task_type in TRAINING_JOBS

    @property
    def num_training_tasks(self) -> int:
        """How many tasks train."""
        return len(self.training_tasks)

    @property
    def task_rank(self) -> int:
        """This task's position among the training tasks.

        Raises:
            TFConfigError: if this task does not train.

        """
        if not self.is_training_task:
            raise TFConfigError(f"TF_CONFIG task {self.task_type!r} does not train, so it has no training rank.")
        return self.training_tasks.index((self.task_type, self.task_index))

    @property
    def own_address(self) -> tuple[str, int]:
        """``(host, port)`` of this process's own task in the cluster spec."""
        return self.cluster[self.task_type][self.task_index]

    @property
    def main_address(self) -> tuple[str, int]:
        """``(host, port)`` of the first training task (the chief if there is one), where rendezvous happens."""
        job, index = self.training_tasks[0]
        return self.cluster[job][index]


class TFConfigEnvironment(ClusterEnvironment):
    """Cluster environment read from ``TF_CONFIG`` (``{"cluster": {...}, "task": {"type": ..., "index": ...}}``).

    Each chief/worker task is a Lightning node; ``ds_mirrored`` picks this environment automatically when ``TF_CONFIG``
    is set. ``ps`` and ``evaluator`` tasks are recognised here, and the strategies decide whether they may run.

    Args:
        tf_config: the JSON text to use instead of the ``TF_CONFIG`` environment variable.

    Raises:
        TFConfigError: when the JSON is malformed; the message names the field.

    """

    def __init__(self, tf_config: str | None = None) -> None:
        text = tf_config if tf_config is not None else os.environ.get("TF_CONFIG")
        if text is None:
            raise TFConfigError("TFConfigEnvironment needs the TF_CONFIG environment variable (or `tf_config=`).")
        self.config = TFConfig.from_json(text)
        self._world_size: int | None = None
        self._global_rank: int | None = None

    @property
    @override
    def creates_processes_externally(self) -> bool:
        # Each task is started by the user; Lightning starts that task's extra local processes.
        return "LOCAL_RANK" in os.environ

    @property
    @override
    def main_address(self) -> str:
        return self.config.main_address[0]

    @property
    @override
    def main_port(self) -> int:
        return self.config.main_address[1]

    @staticmethod
    @override
    def detect() -> bool:
        return bool(os.environ.get("TF_CONFIG", "").strip())

    @override
    def world_size(self) -> int:
        # Before the strategy sets it, assume one process per task.
        return self._world_size if self._world_size is not None else self.config.num_training_tasks

    @override
    def set_world_size(self, size: int) -> None:
        self._world_size = size

    @override
    def global_rank(self) -> int:
        return self._global_rank if self._global_rank is not None else self.node_rank()

    @override
    def set_global_rank(self, rank: int) -> None:
        self._global_rank = rank

    @override
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    @override
    def node_rank(self) -> int:
        return self.config.task_rank

    @override
    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        tasks = self.config.num_training_tasks
        if num_nodes != tasks:
            raise TFConfigError(
                f"TF_CONFIG lists {tasks} training task(s) (chief + workers) but the Trainer has num_nodes={num_nodes};"
                f" pass Trainer(num_nodes={tasks}) or leave num_nodes at its default so the strategy adopts it."
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(task={self.config.task_type}:{self.config.task_index})"
