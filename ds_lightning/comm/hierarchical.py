"""Two-level (hierarchical) gradient all-reduce as a DDP comm hook, built from ``torch.distributed`` subgroups.

Each bucket is summed onto one process per host (the host's leader) with ``reduce`` on the host's group, the leaders
all-reduce the host sums with one another (compressed, when a compression is set: only this stage crosses hosts), and
each leader broadcasts the mean back inside its host. Only the leaders' all-reduce uses the slow inter-host links,
and it carries one gradient per host instead of one per process. The leaders' stage is the compression method's
(:meth:`~ds_lightning.comm.compression.base.Compression.inter_host`): :class:`CastStage` for the dense ones.

The host layout comes from the cluster environment's node rank (``TF_CONFIG``'s task, torchrun's ``GROUP_RANK``,
Lightning's ``NODE_RANK``), gathered once from every rank, so hosts may run different numbers of processes.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at runtime.

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

from ds_lightning.comm.wire import WireLog

log = logging.getLogger(__name__)

__all__ = [
    "CastStage",
    "HierarchicalSetting",
    "HierarchicalState",
    "HostGroups",
    "HostLayout",
    "hierarchical_hook",
    "host_groups",
    "use_hierarchy",
]

HierarchicalSetting = bool | Literal["auto"]


@dataclass(frozen=True)
class HostLayout:
    """Which global ranks share a host: ``hosts[i]`` lists host ``i``'s ranks, the first of them its leader.

    Attributes:
        hosts: global ranks per host, hosts ordered by node rank, ranks ascending.

    """

    hosts: tuple[tuple[int, ...], ...]

    @classmethod
    def from_node_ranks(cls, node_ranks: Sequence[int]) -> "HostLayout":
        """The layout of ``node_ranks[global_rank]``, each rank's node (host) rank."""
        by_node: dict[int, list[int]] = {}
        for rank, node in enumerate(node_ranks):
            by_node.setdefault(int(node), []).append(rank)
        return cls(tuple(tuple(by_node[node]) for node in sorted(by_node)))

    @property
    def leaders(self) -> tuple[int, ...]:
        """The global rank of each host's leader (its lowest rank), in host order."""
        return tuple(ranks[0] for ranks in self.hosts)

    @property
    def local_world_sizes(self) -> tuple[int, ...]:
        """Processes per host, in host order."""
        return tuple(len(ranks) for ranks in self.hosts)

    @property
    def world_size(self) -> int:
        """All processes of the run."""
        return sum(self.local_world_sizes)

    def host_of(self, rank: int) -> int:
        """The index of the host that runs global ``rank``."""
        for index, ranks in enumerate(self.hosts):
            if rank in ranks:
                return index
        raise ValueError(f"rank {rank} is on no host of {self.hosts}; ranks run from 0 to {self.world_size - 1}.")

    @property
    def benefits(self) -> bool:
        """Whether two levels save inter-host traffic: more than one host and more than one process on some host."""
        return len(self.hosts) > 1 and max(self.local_world_sizes) > 1


def use_hierarchy(setting: HierarchicalSetting, layout: HostLayout) -> bool:
    """Whether to run the two-level all-reduce for ``setting`` on ``layout``.

    ``"auto"`` and ``True`` both run it only where it saves inter-host traffic (:attr:`HostLayout.benefits`): with one
    host, or one process per host, the two-level path is the flat all-reduce with extra steps, so ``True`` falls
    back to the flat ring there (with an info log) and the same configuration runs on a laptop and on a cluster.
    """
    if setting is False:
        return False
    if not layout.benefits:
        if setting is True:
            log.info(
                "ds_mirrored: hierarchical=True but the run has %d host(s) with %s process(es): the two-level"
                " all-reduce saves nothing here, so gradients take the flat all-reduce.",
                len(layout.hosts),
                list(layout.local_world_sizes),
            )
        return False
    return True


@dataclass
class HostGroups:
    """This rank's process groups for the two-level all-reduce.

    Attributes:
        layout: every host's ranks.
        host: the group of this rank's host (every rank is in exactly one).
        leaders: the group of the hosts' leaders; ``None`` on every other rank.
        leader: global rank of this host's leader.
        host_size: processes on this rank's host.

    """

    layout: HostLayout
    host: dist.ProcessGroup
    leaders: dist.ProcessGroup | None
    leader: int
    host_size: int

    @property
    def is_leader(self) -> bool:
        """Whether this rank takes part in the inter-host all-reduce."""
        return self.leaders is not None


def _gather_node_ranks(node_rank: int, device: torch.device) -> list[int]:
    # On the default group, whose timeout is the strategy's; NCCL needs the tensors on the rank's device.
    mine = torch.tensor([node_rank], dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [int(t.item()) for t in every]


def host_groups(
    setting: HierarchicalSetting, node_rank: int, device: torch.device, timeout: timedelta | None
) -> HostGroups | None:
    """Gather every rank's host and, when :func:`use_hierarchy` says so, create the host and leader groups.

    Collective: every rank of the default group must call it, with the same ``setting``.

    Args:
        setting: ``True``, ``False`` or ``"auto"`` (see :func:`use_hierarchy`).
        node_rank: this rank's host, from the cluster environment.
        device: where this rank's collectives run (its CUDA device under NCCL).
        timeout: every new group's collective timeout (the strategy's ``timeout``).

    Returns:
        This rank's groups, or ``None`` for the flat all-reduce.

    """
    if setting is False:
        return None  # the same on every rank: no collective needed to agree on it
    layout = HostLayout.from_node_ranks(_gather_node_ranks(node_rank, device))
    if not use_hierarchy(setting, layout):
        return None
    rank = dist.get_rank()
    own = layout.hosts[layout.host_of(rank)]
    host: dist.ProcessGroup | None = None
    for ranks in layout.hosts:  # dist.new_group is collective: every rank creates every group, in the same order
        group = dist.new_group(list(ranks), timeout=timeout)
        if ranks == own:
            host = group
    leaders = dist.new_group(list(layout.leaders), timeout=timeout)
    assert host is not None
    log.info(
        "ds_mirrored: hierarchical all-reduce over %d hosts with %s processes; leaders (inter-host) are ranks %s.",
        len(layout.hosts),
        list(layout.local_world_sizes),
        list(layout.leaders),
    )
    is_leader = rank == own[0]
    return HostGroups(layout, host, leaders if is_leader else None, own[0], len(own))


@dataclass
class CastStage:
    """The leaders' stage of a dense method: the host sums, divided by the world size, all-reduced at ``dtype``.

    Attributes:
        leaders: the leaders' group (``None`` on other ranks, which never run the stage).
        wire: what this rank sent across hosts, per step.
        dtype: the dtype sent (``torch.float16``/``bfloat16``), or ``None`` for the gradient's own.

    """

    leaders: dist.ProcessGroup | None
    wire: WireLog
    dtype: torch.dtype | None = None

    def __call__(self, bucket: dist.GradBucket, groups: "HostGroups") -> None:
        """Turn the host's gradient sum in the bucket into the mean over every rank of the run."""
        buffer = bucket.buffer()
        buffer.div_(groups.layout.world_size)  # before a half-width cast, so sums cannot overflow it
        send = buffer if self.dtype is None else buffer.to(self.dtype)
        self.wire.record(send)
        dist.all_reduce(send, group=self.leaders)
        if send is not buffer:
            buffer.copy_(send)


@dataclass
class HierarchicalState:
    """State of :func:`hierarchical_hook`.

    Attributes:
        groups: this rank's host and leader groups.
        wire: what this rank sent across hosts (nothing on non-leaders), per step.
        inter_host: on a leader, turns the host's gradient sum in a bucket into the mean over every rank of the run
            (the compression method's stage).

    """

    groups: HostGroups
    wire: WireLog
    inter_host: Callable[[dist.GradBucket, HostGroups], None]


def _completed(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(tensor)
    return future


def hierarchical_hook(state: HierarchicalState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: reduce the bucket onto the host's leader, all-reduce among leaders, broadcast inside the host.

    Every collective is issued synchronously from the hook's own thread, in bucket order, so all ranks issue them in
    the same order (see :mod:`ds_lightning.comm.compression.powersgd` for why callbacks on gloo's threads would not).
    """
    groups, buffer = state.groups, bucket.buffer()
    if groups.host_size > 1:
        dist.reduce(buffer, dst=groups.leader, group=groups.host)
    if groups.is_leader:
        state.inter_host(bucket, groups)
    if groups.host_size > 1:
        dist.broadcast(buffer, src=groups.leader, group=groups.host)
    if bucket.is_last():
        state.wire.end_step()
    return _completed(buffer)
