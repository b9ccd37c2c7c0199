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


def pin_interfaces_toward_main(main_address: str, main_port: int) -> str | None:
    """Make gloo and NCCL use the interface on the route to the main address.

    For launches that name no address of this task (torchrun, a Kubeflow PyTorchJob pod): only ``MASTER_ADDR``. A
    value the user set is kept and a loopback main address changes nothing (see :func:`pin_socket_interfaces`). Call
    before the process group starts.

    Returns:
        The interface in use, or None on loopback or when no route was found (a warning then says what to set).

    """
    if is_loopback(main_address):
        return None
    address = route_source_address(main_address, main_port)
    if address is None:
        log.warning(
            "ds_lightning: no route from this host to MASTER_ADDR=%s; gloo/NCCL choose their own interface. Set"
            " GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME) to the interface the other nodes reach this one on.",
            main_address,
        )
        return None
    return pin_socket_interfaces(address)
