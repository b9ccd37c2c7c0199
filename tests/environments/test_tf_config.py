"""TF_CONFIG parsing, its errors, automatic selection by ds_mirrored, and a two-task run on 127.0.0.1."""

from __future__ import annotations

import json
import subprocess
import sys

import lightning.pytorch as pl
import pytest
import torch

from ds_lightning.environments import TFConfig, TFConfigEnvironment, TFConfigError
from ds_lightning.strategies import MirroredStrategy
from tests.helpers.runner import REPO, example_config, free_port, quiet_trainer_args, worker_env


def tf_config(cluster: dict, task_type: str = "worker", index: int = 0) -> str:
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


def test_ranks_and_main_address_come_from_the_cluster_spec():
    cluster = {"chief": ["10.0.0.1:2222"], "worker": ["10.0.0.2:2223", "10.0.0.3:2224"]}
    env = TFConfigEnvironment(tf_config(cluster, "worker", 1))
    assert env.main_address == "10.0.0.1"
    assert env.main_port == 2222
    assert env.node_rank() == 2  # chief is node 0, worker 0 is node 1
    assert env.world_size() == 3
    assert env.global_rank() == 2
    assert env.local_rank() == 0
    chief = TFConfigEnvironment(tf_config(cluster, "chief", 0))
    assert chief.node_rank() == 0


def test_kubeflow_tfjob_master_is_the_chief_and_its_environment_key_is_read_past():
    """TFJob's ``Master`` replica writes ``master`` into TF_CONFIG, with ``"environment": "cloud"`` beside it."""
    cluster = {"master": ["job-master-0:2222"], "worker": ["job-worker-0:2222"], "ps": ["job-ps-0:2222"]}
    written = {"cluster": cluster, "task": {"type": "master", "index": 0}, "environment": "cloud"}
    master = TFConfigEnvironment(json.dumps(written))
    assert (master.node_rank(), master.world_size(), master.main_address) == (0, 2, "job-master-0")
    worker = TFConfigEnvironment(json.dumps({**written, "task": {"type": "worker", "index": 0}}))
    assert (worker.node_rank(), worker.main_address, worker.main_port) == (1, "job-master-0", 2222)
    assert TFConfig.from_json(json.dumps(written)).cluster["chief"] == [("job-master-0", 2222)]
    # Control: both names of the one job are refused, naming them.
    both = {**written, "cluster": {**cluster, "chief": ["job-chief-0:2222"]}}
    with pytest.raises(TFConfigError, match="both `master` and `chief`"):
        TFConfig.from_json(json.dumps(both))


def test_without_chief_worker_zero_hosts_the_rendezvous():
    env = TFConfigEnvironment(tf_config({"worker": ["127.0.0.1:5000", "127.0.0.1:5001"]}, "worker", 1))
    assert (env.main_address, env.main_port, env.node_rank()) == ("127.0.0.1", 5000, 1)


def test_detect_follows_the_variable(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert not TFConfigEnvironment.detect()
    monkeypatch.setenv("TF_CONFIG", tf_config({"worker": ["h:1"]}))
    assert TFConfigEnvironment.detect()


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"task": {"type": "worker", "index": 0}}), "no `cluster`"),
        (json.dumps({"cluster": {"worker": ["h:1"]}}), "no `task`"),
        (tf_config({"worker": ["h:1"]}, "worker", 3), "`task.index` is 3"),
        (tf_config({"worker": ["h:1"]}, "chief", 0), "`task.type` is 'chief'"),
        (json.dumps({"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": "0"}}), "`task.index`"),
        (tf_config({"worker": ["h:x"]}), "`cluster.worker[0]`"),
        (tf_config({"worker": ["nohost"]}), "`cluster.worker[0]`"),
        (tf_config({"worker": []}), "`cluster.worker`"),
        (tf_config({"gpu": ["h:1"]}), "`cluster.gpu`"),
        (tf_config({"ps": ["h:1"]}, "ps", 0), "no `chief` or `worker`"),
    ],
)
def test_malformed_tf_config_names_the_field(text, field):
    with pytest.raises(TFConfigError, match=field.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        TFConfig.from_json(text)


def test_ds_mirrored_picks_tf_config_and_adopts_num_nodes(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", tf_config({"worker": ["127.0.0.1:5000", "127.0.0.1:5001"]}, "worker", 1))
    trainer = pl.Trainer(strategy="ds_mirrored", accelerator="cpu", devices=1, logger=False)
    strategy = trainer.strategy
    assert isinstance(strategy.cluster_environment, TFConfigEnvironment)
    assert strategy.num_nodes == 2
    assert strategy.global_rank == 1 and strategy.world_size == 2
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 1}


def test_several_devices_per_task_multiply_the_world(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", tf_config({"chief": ["127.0.0.1:5000"], "worker": ["127.0.0.1:5001"]}, "worker", 0))
    trainer = pl.Trainer(strategy="ds_mirrored", accelerator="cpu", devices=2, logger=False)
    assert trainer.strategy.world_size == 4
    assert trainer.strategy.global_rank == 2  # node 1, local rank 0


@pytest.mark.parametrize(
    ("cluster", "task", "message"),
    [
        ({"worker": ["h:1"], "ps": ["h:2"]}, ("ps", 0), "`task.type` is 'ps'"),
        ({"worker": ["h:1"], "ps": ["h:2"]}, ("worker", 0), "`cluster.ps`"),
    ],
)
def test_ps_under_ds_mirrored_fails_before_any_process_group(monkeypatch, cluster, task, message):
    monkeypatch.setenv("TF_CONFIG", tf_config(cluster, *task))
    with pytest.raises(TFConfigError, match=message):
        pl.Trainer(strategy="ds_mirrored", accelerator="cpu", devices=1, logger=False)
    assert not torch.distributed.is_initialized()


def test_conflicting_num_nodes_is_refused(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", tf_config({"worker": ["h:1", "h:2"]}, "worker", 0))
    with pytest.raises(TFConfigError, match="num_nodes=3"):
        pl.Trainer(strategy=MirroredStrategy(), accelerator="cpu", devices=1, num_nodes=3, logger=False)


@pytest.mark.multiprocess
def test_two_tasks_each_with_its_own_tf_config_train_together(tmp_path):
    ports = [free_port(), free_port()]
    cluster = {"chief": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"]}
    record = tmp_path / "strategy.json"
    out = tmp_path / "params"
    procs = []
    for task_type, index in (("chief", 0), ("worker", 0)):
        env = worker_env(TF_CONFIG=tf_config(cluster, task_type, index))
        env.pop("MASTER_PORT")
        args = [
            sys.executable, "-m", "ds_lightning.cli", "fit", *example_config("mirrored.yaml"),
            *quiet_trainer_args(tmp_path), "--trainer.devices=1", "--trainer.max_steps=5",
            "--trainer.limit_val_batches=0",
            "--trainer.callbacks+=tests.helpers.callbacks.RecordStrategy", f"--trainer.callbacks.path={record}",
            "--trainer.callbacks+=tests.helpers.callbacks.SaveParams", f"--trainer.callbacks.path={out}",
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    for proc, output in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, output[-4000:]
    info = json.loads(record.read_text())
    assert info["environment"] == "TFConfigEnvironment"
    assert info["world_size"] == 2 and info["num_nodes"] == 2
    chief = torch.load(f"{out}.rank0.pt", weights_only=True)
    worker = torch.load(f"{out}.rank1.pt", weights_only=True)
    assert chief["global_step"] == worker["global_step"] == 5
    for name, value in chief["state_dict"].items():
        torch.testing.assert_close(worker["state_dict"][name], value, atol=0, rtol=0)
