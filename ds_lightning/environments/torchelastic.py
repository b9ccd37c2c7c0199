"""Runs started by ``torchrun``: the number of nodes and the network interface come from torchrun, not the config.

torchrun (Lightning's ``TorchElasticEnvironment``) decides how many nodes join each round of its rendezvous: with
``--nnodes=1:2`` a job may run on two nodes, lose one and go on with one. The Trainer's ``num_nodes`` is fixed in
the config, so Lightning's own check (``devices x num_nodes == WORLD_SIZE``) would stop the smaller round. Under
torchrun the strategies take the node count from torchrun's variables instead, and point gloo/NCCL at the interface
that reaches ``MASTER_ADDR`` (on a multi-homed host, or inside a network namespace, the host name may resolve to an
address the other nodes cannot reach).
"""

from __future__ import annotations

import os

from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.environments import TorchElasticEnvironment

__all__ = ["elastic_num_nodes", "store_round"]

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
