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

log = logging.getLogger(__name__)

__all__ = ["ALL_INTERFACES_VARIABLE", "bound_listener", "rendezvous_store"]

_BACKLOG = 2048  # rendezvous bursts: every rank (and every parameter server) connects at once

#: Set to 1 to leave the store on all interfaces, as torch's env:// rendezvous does.
ALL_INTERFACES_VARIABLE = "DS_LIGHTNING_STORE_ON_ALL_INTERFACES"


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def _listen(family: int, address: tuple[Any, ...]) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


def _on_all_interfaces(reason: str, *args: object) -> None:
    log.warning(reason + " The rendezvous store listens on all interfaces.", *args)


def bound_listener(host: str, port: int, spans_hosts: bool) -> socket.socket | None:
    """A socket listening on ``host:port`` only, or None where the store must listen on all interfaces.

    None, with a warning that says why, when binding could make the store unreachable or fail where torch's own store
    works: ``host`` does not resolve here, resolves to several addresses (dual-stack names; the others would be
    refused), is no address of this machine (a NAT or service address), resolves to loopback in a run that
    ``spans_hosts`` (``/etc/hosts`` often maps the host name to 127.0.1.1), or can't be bound for another reason.
    ``DS_LIGHTNING_STORE_ON_ALL_INTERFACES=1`` asks for all interfaces outright.

    Raises:
        torch.distributed.DistNetworkError: the port is taken, naming the fix.

    """
    if os.environ.get(ALL_INTERFACES_VARIABLE) == "1":
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as error:
        _on_all_interfaces("MASTER_ADDR=%r does not resolve on rank 0 (%s).", host, error)
        return None
    addresses = sorted({str(info[4][0]) for info in infos})
    if len(addresses) > 1:
        _on_all_interfaces(
            "MASTER_ADDR=%r resolves to several addresses on rank 0 (%s); set it to one of them to bind the store.",
            host,
            ", ".join(addresses),
        )
        return None
    if spans_hosts and _is_loopback(addresses[0]):
        _on_all_interfaces(
            "MASTER_ADDR=%r resolves to the loopback address %s on rank 0, which other hosts can't reach; set it to"
            " rank 0's cluster address.",
            host,
            addresses[0],
        )
        return None
    family, _, _, _, address = infos[0]
    try:
        return _listen(family, address)
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            raise dist.DistNetworkError(
                f"Rank 0 could not listen on {host}:{port} for the rendezvous ({error}). Another process holds the"
                " port: choose a free MASTER_PORT (or stop the process holding it)."
            ) from error
        if error.errno == errno.EADDRNOTAVAIL:
            _on_all_interfaces(
                "MASTER_ADDR=%r (%s) is not an address of rank 0's machine; set MASTER_ADDR to an address this"
                " machine holds to keep the store off other networks.",
                host,
                addresses[0],
            )
        else:
            _on_all_interfaces("Rank 0 could not listen on %s:%s only (%s).", host, port, error)
        return None


def rendezvous_store(
    host: str, port: int, rank: int, world_size: int, timeout: timedelta, spans_hosts: bool
) -> dist.TCPStore:
    """The TCPStore ``init_process_group`` would make, but rank 0's listens on ``host`` only (see module docs)."""
    if rank != 0:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    listener = bound_listener(host, port, spans_hosts)
    if listener is None:
        return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout)
    # The store owns the descriptor from here on. Both backends accept an already-listening socket; USE_LIBUV=0
    # picks the old one, as it does for torch's own store.
    use_libuv = os.environ.get("USE_LIBUV", "1") == "1"
    return dist.TCPStore(
        host, port, world_size, is_master=True, timeout=timeout, master_listen_fd=listener.detach(), use_libuv=use_libuv
    )
