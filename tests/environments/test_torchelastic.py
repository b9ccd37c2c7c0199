"""Under torchrun the node count comes from its current round, gloo/NCCL use the interface towards MASTER_ADDR, and
ds_parameter_server serves on torchrun's last ranks."""

from __future__ import annotations

import os
import socket

import pytest
from lightning.fabric.plugins.environments import LightningEnvironment, TorchElasticEnvironment
from lightning.pytorch import Trainer

from ds_lightning.environments._interfaces import (
    SOCKET_IFNAME_VARIABLES,
    _ipv4_of,
    pin_interfaces_toward_main,
    route_source_address,
)
from ds_lightning.environments.torchelastic import elastic_num_nodes
from ds_lightning.strategies import ParameterServerStrategy


@pytest.fixture
def torchrun_round(monkeypatch):
    """The variables torchrun sets in a worker of a round of 2 nodes x 2 processes (this one: rank 2)."""
    for variable in SOCKET_IFNAME_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    values = {
        "TORCHELASTIC_RUN_ID": "test",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "RANK": "2",
        "LOCAL_RANK": "0",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    return monkeypatch


def test_the_node_count_is_the_rounds_not_the_configs(torchrun_round):
    assert TorchElasticEnvironment.detect()
    assert elastic_num_nodes(TorchElasticEnvironment(), num_processes=2) == 2
    torchrun_round.setenv("WORLD_SIZE", "2")  # the round after a node was lost
    assert elastic_num_nodes(TorchElasticEnvironment(), num_processes=2) == 1
    assert elastic_num_nodes(LightningEnvironment(), num_processes=2) is None


def test_devices_other_than_nproc_per_node_is_refused_with_the_fix(torchrun_round):
    with pytest.raises(
        ValueError, match=r"--nproc-per-node=2\) but the Trainer has devices=1; pass --trainer.devices=2"
    ):
        elastic_num_nodes(TorchElasticEnvironment(), num_processes=1)
    torchrun_round.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="same --nproc-per-node"):
        elastic_num_nodes(TorchElasticEnvironment(), num_processes=2)


@pytest.mark.parametrize("strategy", ["ds_mirrored", "ds_pipeline"])
def test_the_trainer_adopts_the_rounds_node_count(torchrun_round, strategy):
    trainer = Trainer(accelerator="cpu", devices=2, num_nodes=1, strategy=strategy, logger=False)
    assert trainer.num_nodes == 2
    assert trainer.world_size == 4
    assert trainer.global_rank == 2


@pytest.mark.parametrize(("rank", "server"), [(0, None), (2, None), (3, 0)])
def test_ds_parameter_server_under_torchrun_serves_on_the_last_ranks(torchrun_round, rank, server):
    torchrun_round.setenv("RANK", str(rank))
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ds_parameter_server", logger=False)
    strategy = trainer.strategy
    assert strategy.num_servers == 1
    assert strategy.num_workers == 3
    assert strategy.is_server is (server is not None)
    assert strategy._server_index == server
    assert trainer.world_size == 3  # the workers' process group
    assert trainer.global_rank == rank
    assert trainer.num_nodes == 2
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 3, "rank": rank}
    assert strategy.cluster_environment.creates_processes_externally  # torchrun started them all: no servers to start


def test_ds_parameter_server_under_torchrun_without_a_worker_fails_at_start_naming_the_fix(torchrun_round):
    with pytest.raises(ValueError, match=r"WORLD_SIZE=4 .*num_servers=4\).*at least 5 processes.*lower num_servers"):
        Trainer(accelerator="cpu", devices=2, strategy=ParameterServerStrategy(num_servers=4), logger=False)


def test_the_route_source_address_is_this_hosts_address_towards_the_target():
    assert route_source_address("127.0.0.1", 9) == "127.0.0.1"
    for _, name in socket.if_nameindex():
        address = _ipv4_of(name)
        if address is not None and not address.startswith("127."):
            assert route_source_address(address, 9) == address  # a local address routes from itself
            break
    assert route_source_address("no-such-host.invalid", 9) is None


def test_gloo_is_pinned_to_the_interface_towards_master_addr(torchrun_round):
    env = TorchElasticEnvironment()
    assert pin_interfaces_toward_main(env.main_address, env.main_port) is None  # loopback: the defaults are right
    assert all(variable not in os.environ for variable in SOCKET_IFNAME_VARIABLES)
    for _, name in socket.if_nameindex():
        address = _ipv4_of(name)
        if address is not None and not address.startswith("127."):
            torchrun_round.setenv("MASTER_ADDR", address)
            env = TorchElasticEnvironment()
            assert pin_interfaces_toward_main(env.main_address, env.main_port) == name
            assert os.environ["GLOO_SOCKET_IFNAME"] == name
            return
    pytest.skip("this host has no non-loopback IPv4 interface")
