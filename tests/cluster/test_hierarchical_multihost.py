"""ds_mirrored's two-level all-reduce on 2 namespace hosts x 2 processes (TF_CONFIG): parity and inter-host bytes.

Each host's processes reach one another over its loopback, so its ``eth0`` veth carries only what crosses hosts;
its ``tx_bytes``, read inside the namespace before and after a run, is what the run sent between hosts.
"""

from __future__ import annotations

import pytest
import torch

from ds_lightning.testing.netns import Cluster, Host
from tests.cluster.tasks import assert_succeeded, cluster_spec, fit_args, start_all, wait

pytestmark = pytest.mark.multiprocess

STEPS = 8


def _tx_bytes(host: Host) -> int:
    return int(host.check_output(["cat", f"/sys/class/net/{host.interface}/statistics/tx_bytes"]))


def _fit(cluster: Cluster, tmp_path, hierarchical: str) -> tuple[dict, int]:
    """One 2 hosts x 2 processes run of the digits MLP; rank 0's final state and the bytes both hosts sent."""
    root = tmp_path / f"hierarchical-{hierarchical}"
    args = fit_args(
        "mirrored.yaml",
        root,
        "--trainer.devices=2",
        f"--trainer.max_steps={STEPS}",
        "--trainer.limit_val_batches=0",
        "--trainer.strategy=ds_lightning.strategies.MirroredStrategy",
        "--trainer.strategy.init_args.timeout=120",
        f"--trainer.strategy.init_args.hierarchical={hierarchical}",
        "--model.init_args.hidden_sizes=[256]",  # gradients, not start-up, dominate the bytes
        "--trainer.callbacks+=tests.helpers.callbacks.SaveParams",
        f"--trainer.callbacks.path={root / 'params'}",
    )
    before = [_tx_bytes(host) for host in cluster.hosts]
    hosts = {"worker": cluster.hosts}
    tasks = start_all(cluster_spec(hosts), hosts, args, root)
    wait(tasks)
    assert_succeeded(tasks)
    sent = sum(_tx_bytes(host) - b for host, b in zip(cluster.hosts, before, strict=True))
    return torch.load(root / "params.rank0.pt", weights_only=True), sent


def test_two_level_matches_the_flat_ring_and_sends_fewer_bytes_between_hosts(cluster_factory, tmp_path):
    cluster: Cluster = cluster_factory(2)
    two_level, two_level_bytes = _fit(cluster, tmp_path, "auto")
    flat, flat_bytes = _fit(cluster, tmp_path, "false")
    assert two_level["world_size"] == flat["world_size"] == 4
    assert two_level["global_step"] == flat["global_step"] == STEPS
    for name, value in flat["state_dict"].items():
        assert (two_level["state_dict"][name] - value).abs().max().item() <= 1e-5, name
    # Per step a host sends one gradient across (the leaders' all-reduce) instead of the flat ring's 1.5: 0.67x, and
    # start-up traffic is common to both (measured here: 0.70x).
    assert two_level_bytes < 0.8 * flat_bytes, (two_level_bytes, flat_bytes)
