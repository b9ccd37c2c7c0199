"""Which network interface a task's own cluster address lives on, so gloo and NCCL bind to it.

Left alone, gloo picks the address its host name resolves to, which on a multi-homed host (or inside a network
namespace) can be 127.0.0.1 or an interface the other tasks cannot reach: connections are then refused. The cluster
spec names each task's address, so the interface that holds it is the one to use.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct

log = logging.getLogger(__name__)

#: The variables gloo and NCCL read; a value the user set is never replaced.
SOCKET_IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's primary IPv4 address


def _ipv4_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None  # no IPv4 address on this interface
    return socket.inet_ntoa(packed[20:24])


def interface_holding(host: str) -> str | None:
    """The name of this machine's interface whose IPv4 address is ``host`` (a name is resolved first), or None."""
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return None
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == address:
            return name
    return None


def is_loopback(host: str) -> bool:
    """Whether ``host`` is (or resolves to) a loopback address."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def pin_socket_interfaces(host: str) -> str | None:
    """Point gloo and NCCL at the interface holding ``host``, unless the user chose one already.

    Returns:
        The interface now in use for this task's address, or None when ``host`` is loopback (the defaults are right)
        or no interface here holds it (a warning then says how to choose one).

    """
    if is_loopback(host):
        return None
    chosen = [os.environ[v] for v in SOCKET_IFNAME_VARIABLES if os.environ.get(v)]
    if chosen:
        return chosen[0]
    name = interface_holding(host)
    if name is None:
        log.warning(
            "ds_lightning: no interface of this host holds %s, this task's address in the cluster spec; gloo/NCCL"
            " choose their own. Set GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME) to the interface the other tasks"
            " reach this one on.",
            host,
        )
        return None
    for variable in SOCKET_IFNAME_VARIABLES:
        os.environ[variable] = name
    return name
