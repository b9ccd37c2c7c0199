"""Real multi-host runs: every task its own ``ds-train`` process on its own network-namespace host, driven by TF_CONFIG.

Each run also watches every host's listening sockets: nothing the pack starts may listen on an address other than
the host's own cluster address (no ``0.0.0.0``, no loopback). ds_mirrored's two-host run, with the same checks, is
the short-link-cut test in ``test_wire_faults.py``.
"""

from __future__ import annotations

import re

import pytest

from ds_lightning.testing.netns import Cluster
from tests.cluster.tasks import fit_args, run_watched

pytestmark = pytest.mark.multiprocess


def _train(cluster: Cluster, hosts: dict, config: str, tmp_path, *extra: str):
    args = fit_args(config, tmp_path, "--trainer.max_epochs=2", *extra)
    return run_watched(cluster, hosts, args, tmp_path)


@pytest.mark.parametrize("num_servers", [1, 2], ids=["1ps-2workers", "2ps-2workers"])
def test_ds_parameter_server_trains_across_hosts(cluster_factory, tmp_path, num_servers):
    cluster: Cluster = cluster_factory(2 + num_servers)
    chief, worker, *servers = cluster.hosts
    tasks = _train(
        cluster,
        {"chief": [chief], "worker": [worker], "ps": servers},
        "parameter_server.yaml",
        tmp_path,
        f"--trainer.strategy.init_args.num_servers={num_servers}",
        "--trainer.strategy.init_args.timeout=120",
        "--trainer.strategy.init_args.min_shard_bytes=1024",  # small model: split it over both servers
    )
    # Every server held a share of the model and served both workers to the end.
    for task in tasks:
        if task.role == "ps":
            serving = re.search(rf"parameter server {task.index} serving (\d+) parameters to 2 worker", task.output)
            assert serving and int(serving.group(1)) > 0, task.output[-3000:]
            assert re.search(r"done: [1-9]\d* updates .* workers finished \[(0, 1|1, 0)\], lost \[\]", task.output)


def test_ds_pipeline_runs_its_two_stages_on_two_hosts(cluster_factory, tmp_path):
    cluster: Cluster = cluster_factory(2)
    tasks = _train(
        cluster, {"worker": cluster.hosts}, "pipeline.yaml", tmp_path, "--trainer.strategy.init_args.trace_path=null"
    )
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in tasks[1].output
