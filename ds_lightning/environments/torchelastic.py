"""Runs started by ``torchrun``: the number of nodes and the network interface come from torchrun, not the config.

torchrun (Lightning's ``TorchElasticEnvironment``) decides how many nodes join each round of its rendezvous: with
``--nnodes=1:2`` a job may run on two nodes, lose one and go on with one. The Trainer's ``num_nodes`` is fixed in
the config, so Lightning's own check (``devices x num_nodes == WORLD_SIZE``) would stop the smaller round. Under
torchrun the strategies take the node count from torchrun's variables instead, and point gloo/NCCL at the interface
that reaches ``MASTER_ADDR`` (on a multi-homed host, or inside a network namespace, the host name may resolve to an
address the other nodes cannot reach).
"""

from __future__ import annotations

import logging
import os
import socket

from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.environments import TorchElasticEnvironment

from ds_lightning.environments._interfaces import is_loopback, pin_socket_interfaces

log = logging.getLogger(__name__)

__all__ = ["elastic_num_nodes", "pin_elastic_interfaces", "route_source_address", "store_round"]

RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"


def elastic_num_nodes(env: ClusterEnvironment | None, num_processes: int) -> int | None:
    """The nodes in torchrun's current round: ``WORLD_SIZE / LOCAL_WORLD_SIZE``; ``None`` outside torchrun.

    Args:
        env: the run's cluster environment.
        num_processes: the Trainer's processes per node (``devices``).

    Raises:
        ValueError: ``devices`` differs from torchrun's ``--nproc-per-node``, or the nodes run different numbers of
            processes, naming the fix.

    """
    if not isinstance(env, TorchElasticEnvironment):
        return None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", num_processes))
    world = env.world_size()
    if local != num_processes:
        raise ValueError(
            f"torchrun started {local} process(es) on this node (--nproc-per-node={local}) but the Trainer has"
            f" devices={num_processes}; pass --trainer.devices={local} (or start torchrun with"
            f" --nproc-per-node={num_processes})."
        )
    if world % local:
        raise ValueError(
            f"torchrun's world of {world} process(es) is not a whole number of nodes of {local}; start every node's"
            f" torchrun with the same --nproc-per-node."
        )
    return world // local


def route_source_address(host: str, port: int) -> str | None:
    """This machine's address on the route to ``host`` (what a connection to it would come from), or None."""
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)
    except OSError:
        return None
    for *_, address in infos:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            try:
                sock.connect(address)  # UDP: picks the route and source address, sends nothing
            except OSError:
                continue
            return str(sock.getsockname()[0])
    return None


def pin_elastic_interfaces(env: ClusterEnvironment | None) -> str | None:
    """Under torchrun, make gloo and NCCL use the interface on the route to ``MASTER_ADDR``.

    A value the user set is kept and a loopback ``MASTER_ADDR`` changes nothing (see
    :func:`~ds_lightning.environments.pin_socket_interfaces`). Call before the process group starts.

    Returns:
        The interface in use, or None outside torchrun, on loopback or when no route was found.

    """
    if not isinstance(env, TorchElasticEnvironment) or is_loopback(env.main_address):
        return None
    address = route_source_address(env.main_address, env.main_port)
    if address is None:
        log.warning(
            "ds_lightning: no route from this host to MASTER_ADDR=%s; gloo/NCCL choose their own interface. Set"
            " GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME) to the interface the other nodes reach this one on.",
            env.main_address,
        )
        return None
    return pin_socket_interfaces(address)


def store_round() -> int:
    """Which group the store at ``MASTER_ADDR:MASTER_PORT`` serves now: 0, or torchrun's restarts when it is shared.

    Under torchrun's default the workers share the agent's store, which outlives a restart and keeps the old group's
    keys; the agents restart together, so their restart count tells the rounds apart. Otherwise (no torchrun, or
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: rank 0 hosts it) each group's store is new, and an agent started again
    (a host back) counts its restarts from 0, so the count must not be used.
    """
    if os.environ.get(AGENT_STORE_ENV) != "True":
        return 0
    return int(os.environ.get(RESTART_ENV, "0"))
