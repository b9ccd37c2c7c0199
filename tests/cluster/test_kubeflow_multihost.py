"""Kubeflow's operators on namespace hosts: each pod a host, its processes started with exactly the variables the
operator sets (a pod's address stands in for its service's DNS name; no Kubernetes runs here).

- TFJob: ``TF_CONFIG`` with its ``master`` replica and ``"environment": "cloud"``, under ds_mirrored and
  ds_parameter_server;
- PyTorchJob: ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK`` in each pod, one process each, under
  ds_mirrored and ds_pipeline (adopted as Lightning's ``KubeflowEnvironment``);
- the ``PET_*`` variables of PyTorchJob with ``nprocPerNode`` and of Kubeflow Trainer's TrainJob, read by ``torchrun``
  in each pod, under ds_mirrored.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ds_lightning.testing.netns import Cluster
from tests.cluster.tasks import ListenerWatch, Task, assert_succeeded, fit_args, run_watched, start_with, wait
from tests.helpers.runner import REPO, free_port, worker_env

pytestmark = pytest.mark.multiprocess

#: Kubernetes' own variables in every pod: how ds_lightning tells a PyTorchJob pod from a hand launch.
KUBERNETES = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443", "PYTHONUNBUFFERED": "1"}


def _learnt_across(tasks: list[Task], root: Path, members: int) -> None:
    assert_succeeded(tasks)
    assert json.loads((root / "report.json").read_text())["val_acc"] > 0.5
    # Every rank joined one group: a pod left on its own would train alone as MEMBER 1/1 and still learn.
    for rank in range(members):
        assert f"GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/{members}" in "".join(t.output for t in tasks)


@pytest.mark.parametrize(
    ("config", "jobs", "extra"),
    [
        ("mirrored.yaml", ("master", "worker"), []),
        ("parameter_server.yaml", ("master", "worker", "ps"), ["--trainer.strategy.init_args.timeout=120"]),
    ],
    ids=["ds_mirrored", "ds_parameter_server"],
)
def test_tfjob_master_and_cloud_environment_train_across_hosts(cluster_factory, tmp_path, config, jobs, extra):
    cluster: Cluster = cluster_factory(len(jobs))
    hosts = {job: [host] for job, host in zip(jobs, cluster.hosts, strict=True)}
    args = fit_args(config, tmp_path, "--trainer.max_epochs=2", *extra)
    tasks = run_watched(cluster, hosts, args, tmp_path, tf_extra={"environment": "cloud"})
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in "".join(t.output for t in tasks)


@pytest.mark.parametrize(
    ("config", "extra"),
    [("mirrored.yaml", []), ("pipeline.yaml", ["--trainer.strategy.init_args.trace_path=null"])],
    ids=["ds_mirrored", "ds_pipeline"],
)
def test_pytorchjob_pods_train_across_hosts(cluster_factory, tmp_path, config, extra):
    cluster: Cluster = cluster_factory(2)
    master, port = cluster.hosts[0], str(free_port())
    args = fit_args(config, tmp_path, "--trainer.max_epochs=2", *extra)
    job = {"MASTER_ADDR": master.address, "MASTER_PORT": port, "WORLD_SIZE": "2", **KUBERNETES}
    tmp_path.mkdir(exist_ok=True)
    with ListenerWatch(cluster) as watch:
        tasks = [
            start_with(host, "pod", rank, args, tmp_path, **job, RANK=str(rank))
            for rank, host in enumerate(cluster.hosts)
        ]
        wait(tasks)
    _learnt_across(tasks, tmp_path, 2)
    assert watch.outside_the_spec() == {}, watch.seen  # every listener on its pod's own address


def test_pet_variables_start_torchrun_in_each_pod(cluster_factory, tmp_path):
    """PyTorchJob with ``nprocPerNode`` (and TrainJob) run ``torchrun`` in each pod, which reads its options from the
    operator's ``PET_*`` variables; the workers it starts run under Lightning's TorchElasticEnvironment."""
    cluster: Cluster = cluster_factory(2)
    master, port = cluster.hosts[0], str(free_port())
    args = fit_args("mirrored.yaml", tmp_path, "--trainer.max_epochs=2")
    tasks = []
    for rank, host in enumerate(cluster.hosts):
        env = worker_env()
        for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(variable, None)
        env.update(KUBERNETES)
        env.update(PET_NNODES="2", PET_NPROC_PER_NODE="1", PET_NODE_RANK=str(rank))
        env.update(PET_MASTER_ADDR=master.address, PET_MASTER_PORT=port)
        log = tmp_path / f"pod{rank}.log"
        with log.open("w") as out:
            command = [sys.executable, "-m", "torch.distributed.run", "-m", "ds_lightning.cli", *args]
            proc: subprocess.Popen[bytes] = host.run(command, cwd=REPO, env=env, stdout=out, stderr=out)
        tasks.append(Task("pod", rank, host, proc, log))
    wait(tasks)
    _learnt_across(tasks, tmp_path, 2)
