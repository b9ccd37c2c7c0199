"""Kubeflow's PyTorchJob: one process per pod, with its rank and the world in the variables the operator sets.

The training operator starts each replica (pod) of a PyTorchJob with ``MASTER_ADDR`` and ``MASTER_PORT`` (the master
pod's service), ``WORLD_SIZE`` (the pods) and ``RANK`` (this pod's). Lightning's ``KubeflowEnvironment`` reads
exactly those, but Lightning never selects it by itself (its ``detect`` raises), and its default environment would
start ``devices`` processes per pod with every pod as node 0. So the ds strategies adopt it, as they adopt
``TF_CONFIG``: when those four variables are set inside a Kubernetes pod (``KUBERNETES_SERVICE_HOST``, which
Kubernetes sets in every pod) and no launcher of its own started the process (``LOCAL_RANK``: torchrun, Lightning's
launcher), each pod is one Lightning node of one process.

Under torchrun (PyTorchJob with ``nprocPerNode``, or Kubeflow Trainer's TrainJob) the operator sets ``PET_NNODES``,
``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR`` and ``PET_MASTER_PORT``, which torchrun reads as its
options; the processes it starts run under Lightning's ``TorchElasticEnvironment``
(:mod:`~ds_lightning.environments.torchelastic`).
"""

from __future__ import annotations

import os

from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.environments import KubeflowEnvironment, LightningEnvironment

__all__ = ["PYTORCHJOB_VARIABLES", "adopt_pytorchjob", "pytorchjob_in_use"]

#: What the training operator sets in every PyTorchJob pod (one process per pod).
PYTORCHJOB_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
#: Set by Kubernetes in every pod: tells a pod from a hand launch that happens to set the four above.
IN_A_POD = "KUBERNETES_SERVICE_HOST"


def pytorchjob_in_use(env: ClusterEnvironment | None) -> bool:
    """Whether this process is a PyTorchJob pod's process and nothing more specific was chosen or detected."""
    if isinstance(env, KubeflowEnvironment):
        return True
    if env is not None and type(env) is not LightningEnvironment:
        return False  # SLURM, torchrun, TF_CONFIG, or the user's own choice
    started_by_a_launcher = "LOCAL_RANK" in os.environ or "TF_CONFIG" in os.environ
    return IN_A_POD in os.environ and all(v in os.environ for v in PYTORCHJOB_VARIABLES) and not started_by_a_launcher


def adopt_pytorchjob(
    strategy_name: str, env: ClusterEnvironment | None, num_nodes: int, num_processes: int
) -> tuple[ClusterEnvironment | None, int]:
    """In a PyTorchJob pod, Lightning's ``KubeflowEnvironment`` and one node per pod; elsewhere, no change.

    Raises:
        ValueError: ``devices`` is not 1 (the operator starts one process per pod), or ``num_nodes`` is neither 1 nor
            the number of pods, naming the fix.

    """
    if not pytorchjob_in_use(env):
        return env, num_nodes
    pods = int(os.environ["WORLD_SIZE"])
    if num_processes != 1:
        raise ValueError(
            f"{strategy_name} runs in a Kubeflow PyTorchJob pod (WORLD_SIZE={pods}, RANK={os.environ['RANK']}), where"
            f" the operator starts one process per pod, but the Trainer has devices={num_processes}. Pass"
            " --trainer.devices=1, or give the PyTorchJob nprocPerNode and start `torchrun -m ds_lightning.cli` in"
            " the pod (torchrun reads the PET_* variables the operator sets then)."
        )
    if num_nodes not in (1, pods):
        raise ValueError(
            f"The Kubeflow PyTorchJob has WORLD_SIZE={pods} pods but the Trainer has num_nodes={num_nodes}; use"
            f" num_nodes={pods} or leave it at its default."
        )
    return (env if isinstance(env, KubeflowEnvironment) else KubeflowEnvironment()), pods
