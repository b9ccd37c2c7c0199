"""Kubeflow PyTorchJob pods: one process per pod, adopted as Lightning's KubeflowEnvironment by the ds strategies."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.plugins.environments import KubeflowEnvironment, LightningEnvironment

from ds_lightning.environments.kubeflow import adopt_pytorchjob, pytorchjob_in_use

#: What a PyTorchJob pod's process sees (the operator's four variables and Kubernetes' own), worker 1 of 3 pods.
POD = {
    "MASTER_ADDR": "job-master-0",
    "MASTER_PORT": "23456",
    "WORLD_SIZE": "3",
    "RANK": "2",
    "KUBERNETES_SERVICE_HOST": "10.96.0.1",
    "KUBERNETES_SERVICE_PORT": "443",
    "PYTHONUNBUFFERED": "1",
}


@pytest.fixture
def pod(monkeypatch):
    for variable in ("LOCAL_RANK", "TF_CONFIG", "NODE_RANK", "GROUP_RANK"):
        monkeypatch.delenv(variable, raising=False)
    for name, value in POD.items():
        monkeypatch.setenv(name, value)
    return monkeypatch


def test_a_pod_is_one_node_of_one_process(pod):
    env, nodes = adopt_pytorchjob("ds_mirrored", LightningEnvironment(), 1, 1)
    assert isinstance(env, KubeflowEnvironment) and nodes == 3
    assert (env.global_rank(), env.world_size(), env.node_rank(), env.local_rank()) == (2, 3, 2, 0)
    assert (env.main_address, env.main_port) == ("job-master-0", 23456)


def test_outside_a_pod_or_under_a_launcher_nothing_changes(pod):
    """Controls: without Kubernetes' variable (a hand launch), under torchrun or Lightning's launcher (LOCAL_RANK),
    and when another environment was chosen, the PyTorchJob variables are not taken."""
    pod.delenv("KUBERNETES_SERVICE_HOST")
    assert not pytorchjob_in_use(LightningEnvironment())
    pod.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    pod.setenv("LOCAL_RANK", "0")
    assert not pytorchjob_in_use(None)
    pod.delenv("LOCAL_RANK")
    assert pytorchjob_in_use(None)

    class Mine(LightningEnvironment):
        pass

    mine = Mine()
    assert adopt_pytorchjob("ds_mirrored", mine, 1, 1) == (mine, 1)


def test_several_devices_in_a_pod_are_refused_with_the_fix(pod):
    with pytest.raises(ValueError, match=r"devices=2.*--trainer.devices=1.*torchrun -m ds_lightning.cli"):
        adopt_pytorchjob("ds_mirrored", None, 1, 2)
    with pytest.raises(ValueError, match="num_nodes=2"):
        adopt_pytorchjob("ds_mirrored", None, 2, 1)


@pytest.mark.parametrize("strategy", ["ds_mirrored", "ds_pipeline"])
def test_ds_strategies_adopt_the_pod_before_any_process_group(pod, strategy):
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy.cluster_environment, KubeflowEnvironment)
    assert trainer.strategy.num_nodes == 3
    assert (trainer.strategy.global_rank, trainer.strategy.world_size) == (2, 3)
    assert not torch.distributed.is_initialized()
