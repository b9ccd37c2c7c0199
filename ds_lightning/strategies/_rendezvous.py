"""The process group's rendezvous store, listening on the cluster's main address instead of every interface.

torch's ``env://`` rendezvous starts rank 0's TCPStore on all interfaces (``*:MASTER_PORT``), so any host that can
reach rank 0's machine can read and write the store. Here rank 0 binds the listening socket to ``MASTER_ADDR`` itself
and hands it to the store (``master_listen_fd``); the other ranks connect exactly as before.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy

log = logging.getLogger(__name__)

_BACKLOG = 2048  # rendezvous bursts: every rank (and every parameter server) connects at once


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def _listen(host: str, port: int) -> socket.socket:
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


def bound_listener(host: str, port: int, spans_hosts: bool) -> socket.socket | None:
    """A socket listening on ``host:port`` only, or None where the store must listen on all interfaces.

    None (with a warning) when ``host`` is no address of this machine (a NAT or service address) or, for a run that
    ``spans_hosts``, when it resolves here to loopback (``/etc/hosts`` often maps the host name to 127.0.1.1, which the
    other hosts can't reach).

    Raises:
        torch.distributed.DistNetworkError: the port is taken or the address can't be used, naming the fix.

    """
    try:
        resolved = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0]
    except OSError as error:
        raise dist.DistNetworkError(
            f"MASTER_ADDR={host!r} does not resolve ({error}); set it to rank 0's address in the cluster."
        ) from error
    if spans_hosts and _is_loopback(resolved):
        log.warning(
            "MASTER_ADDR=%r resolves to the loopback address %s on rank 0, which other hosts can't reach; the"
            " rendezvous store listens on all interfaces. Set MASTER_ADDR to rank 0's cluster address.",
            host,
            resolved,
        )
        return None
    try:
        return _listen(host, port)
    except OSError as error:
        if error.errno == errno.EADDRNOTAVAIL:
            log.warning(
                "MASTER_ADDR=%r (%s) is not an address of rank 0's machine; the rendezvous store listens on all"
                " interfaces. Set MASTER_ADDR to an address this machine holds to keep it off other networks.",
                host,
                resolved,
            )
            return None
        raise dist.DistNetworkError(
            f"Rank 0 could not listen on {host}:{port} for the rendezvous ({error}). Another process holds the port:"
            " choose a free MASTER_PORT (or stop the process holding it)."
        ) from error


def rendezvous_store(
    host: str, port: int, rank: int, world_size: int, timeout: timedelta, spans_hosts: bool
) -> dist.TCPStore:
    """The TCPStore ``init_process_group`` would make, but rank 0's listens on ``host`` only (see module docs)."""
    if rank != 0:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    listener = bound_listener(host, port, spans_hosts)
    if listener is None:
        return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout)
    # The store owns the descriptor from here on; libuv's backend accepts an already-listening socket.
    return dist.TCPStore(
        host, port, world_size, is_master=True, timeout=timeout, master_listen_fd=listener.detach(), use_libuv=True
    )


def setup_distributed(strategy: DDPStrategy) -> None:
    """``DDPStrategy.setup_distributed`` with the rendezvous store from :func:`rendezvous_store`.

    Under torchrun (``TORCHELASTIC_USE_AGENT_STORE``) the agent already hosts the store, so torch's own rendezvous runs.
    """
    reset_seed()
    strategy.set_world_ranks()
    strategy._process_group_backend = strategy._get_process_group_backend()
    env = strategy.cluster_environment
    assert env is not None
    kwargs: dict[str, Any] = {"timeout": strategy._timeout}
    if strategy.root_device.type != "cpu":
        kwargs["device_id"] = strategy.root_device
    if not dist.is_initialized() and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        kwargs["store"] = rendezvous_store(
            env.main_address,
            env.main_port,
            env.global_rank(),
            env.world_size(),
            strategy._timeout,
            spans_hosts=strategy.num_nodes > 1,
        )
    _init_dist_connection(env, strategy._process_group_backend, **kwargs)
