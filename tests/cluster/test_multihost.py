"""Real multi-host runs: every task its own ``ds-train`` process on its own network-namespace host, driven by TF_CONFIG.

Nothing here sets ``GLOO_SOCKET_IFNAME``: inside a namespace gloo would otherwise bind to 127.0.0.1 and the other host's
connection would be refused, so these runs pass only if the pack picks the interface holding the task's address.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.netns import Cluster, Host
from tests.helpers.runner import CONFIGS, REPO, free_port, quiet_trainer_args, worker_env

pytestmark = pytest.mark.multiprocess

RUN_TIMEOUT = 240


def _start(host: Host, tf_config: dict, args: list[str], log: Path) -> subprocess.Popen:
    env = worker_env(TF_CONFIG=json.dumps(tf_config))
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(variable, None)
    with log.open("w") as out:
        return host.run([sys.executable, "-m", "ds_lightning.cli", *args], cwd=REPO, env=env, stdout=out, stderr=out)


def _finish(procs: list[subprocess.Popen], logs: list[Path]) -> list[str]:
    for proc in procs:
        try:
            proc.wait(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
    outputs = [log.read_text(errors="replace") for log in logs]
    for proc, output in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, output[-5000:]
    return outputs


def test_ds_mirrored_trains_across_two_hosts(cluster_factory, tmp_path):
    cluster: Cluster = cluster_factory(2)
    port = free_port()  # free on loopback; each namespace has its own ports, so it is free there too
    workers = [f"{host.address}:{port}" for host in cluster.hosts]
    report = tmp_path / "report.json"
    args = [
        "fit",
        f"--config={CONFIGS / 'mirrored.yaml'}",
        *quiet_trainer_args(tmp_path),
        "--trainer.devices=1",
        "--trainer.max_epochs=2",
        f"--trainer.callbacks.output_json={report}",
    ]
    logs = [tmp_path / f"host{i}.log" for i in range(2)]
    procs = [
        _start(host, {"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}, args, logs[i])
        for i, host in enumerate(cluster.hosts)
    ]
    outputs = _finish(procs, logs)
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in outputs[1]
    summary = json.loads(report.read_text())
    assert summary["val_acc"] > 0.8, summary  # 2 epochs: learning happened across the hosts
