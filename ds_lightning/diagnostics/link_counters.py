"""The kernel's own TCP counters of this process's connections to the other ranks: wire bytes and busy time per link.

Gloo talks TCP between every pair of ranks, and Linux keeps per-connection counters that no user-space layer can
fake: ``tcp_info`` (``getsockopt(TCP_INFO)``, what ``ss -ti`` prints) holds the bytes the connection sent and
received and ``tcpi_busy_time``, the time it had data in flight or queued (waits on the receive window and on the
send buffer included). Bytes over busy time is the rate the link actually carried, whatever the collective's
algorithm; and a connection's busy time in a step is how long that step kept its link busy.

:class:`LinkCounter` finds this process's established TCP connections once training has started (gloo connects
its process groups when they are built), leaves out those to the rendezvous store (its port), and reads their
counters at every step's end: a few microseconds per connection. It never keeps a socket open: each read wraps the
file descriptor and lets go of it, so a connection gloo closes is really closed.

Busy time is counted by the kernel in jiffies (1 to 4 ms, depending on its ``HZ``): per step it is a coarse figure,
over many steps an unbiased one. A transport that is not TCP (NCCL over InfiniBand, shared memory) has no such
counters, and the report's link columns then read ``-``.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["Connection", "LinkCounter", "TcpCounters", "read_tcp_counters"]

_TCP_INFO = getattr(socket, "TCP_INFO", None)  # Linux only: elsewhere no connection has counters
_TCP_INFO_LEN = 232
_ESTABLISHED = 1
# Offsets in struct tcp_info (include/uapi/linux/tcp.h): tcpi_bytes_received, tcpi_busy_time, tcpi_bytes_sent.
_BYTES_RECEIVED_AT = 128
_BUSY_TIME_AT = 168
_BYTES_SENT_AT = 200
_FIELDS_END = 208  # kernels before 4.19 return a shorter struct, without tcpi_bytes_sent


@dataclass(frozen=True)
class TcpCounters:
    """One connection's cumulative counters, as the kernel keeps them."""

    bytes_sent: int
    bytes_received: int
    busy_us: int


def read_tcp_counters(fd: int) -> TcpCounters | None:
    """The counters of the TCP socket ``fd``; ``None`` when it is not an established TCP connection (any more)."""
    if _TCP_INFO is None:
        return None
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _TCP_INFO_LEN)
    except OSError:
        return None
    finally:
        sock.detach()  # the descriptor stays the owner's: never close it from here
    if len(raw) < _FIELDS_END or raw[0] != _ESTABLISHED:
        return None
    (received,) = struct.unpack_from("Q", raw, _BYTES_RECEIVED_AT)
    (busy,) = struct.unpack_from("Q", raw, _BUSY_TIME_AT)
    (sent,) = struct.unpack_from("Q", raw, _BYTES_SENT_AT)
    return TcpCounters(bytes_sent=sent, bytes_received=received, busy_us=busy)


@dataclass(frozen=True)
class Connection:
    """One established TCP connection of this process: its descriptor and both ends' addresses."""

    fd: int
    local: str
    local_port: int
    remote: str
    remote_port: int


def _plain(address: str) -> str:
    """``::ffff:10.0.0.1`` as ``10.0.0.1``, so an IPv4 peer is named the same whichever family the socket has."""
    parsed = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
        return str(parsed.ipv4_mapped)
    return str(parsed)


def tcp_connections(exclude_ports: Iterable[int] = ()) -> list[Connection]:
    """This process's established TCP connections, less those with either end on one of ``exclude_ports``."""
    excluded = set(exclude_ports)
    found = []
    try:
        descriptors = os.listdir("/proc/self/fd")
    except OSError:
        return []
    for name in descriptors:
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                continue
            local, remote = sock.getsockname(), sock.getpeername()
        except OSError:
            continue  # a listening or unconnected socket
        finally:
            sock.detach()
        if local[1] in excluded or remote[1] in excluded or read_tcp_counters(fd) is None:
            continue
        found.append(Connection(fd, _plain(local[0]), int(local[1]), _plain(remote[0]), int(remote[1])))
    return found


@dataclass
class _Link:
    """What this process sent to and received from one remote address, since :meth:`LinkCounter.start`."""

    bytes_sent: int = 0
    bytes_received: int = 0
    busy_us: int = 0
    step_busy_us: dict[int, int] = field(default_factory=dict)


class LinkCounter:
    """Per remote address: the bytes this process's TCP connections sent and received, and their busy time per step.

    Args:
        exclude_ports: ports whose connections are not the training's links (the rendezvous store's).

    """

    def __init__(self, exclude_ports: Iterable[int] = ()) -> None:
        self.exclude_ports = tuple(exclude_ports)
        self.links: dict[str, _Link] = {}
        self.local_addresses: list[str] = []
        self._connections: list[Connection] = []
        self._last: dict[int, TcpCounters] = {}

    @property
    def available(self) -> bool:
        """Whether any connection was found (a single process, or a transport other than TCP, has none)."""
        return bool(self._connections)

    def start(self) -> None:
        """Find the connections and take their counters as the zero point."""
        self._connections = tcp_connections(self.exclude_ports)
        self.links = {}
        self.local_addresses = sorted({c.local for c in self._connections})
        self._last = {}
        for connection in self._connections:
            counters = read_tcp_counters(connection.fd)
            if counters is not None:
                self._last[connection.fd] = counters

    def sample(self, step: int | None) -> None:
        """Add what every connection did since the last sample; its busy time counts to ``step`` (``None``: none)."""
        busy_now: dict[str, int] = {}
        for connection in self._connections:
            before = self._last.get(connection.fd)
            now = read_tcp_counters(connection.fd)
            if before is None or now is None:
                continue
            self._last[connection.fd] = now
            link = self.links.setdefault(connection.remote, _Link())
            link.bytes_sent += now.bytes_sent - before.bytes_sent
            link.bytes_received += now.bytes_received - before.bytes_received
            link.busy_us += now.busy_us - before.busy_us
            # Connections to one address run side by side (process groups), so the link was busy at least as long
            # as the busiest of them.
            busy_now[connection.remote] = max(busy_now.get(connection.remote, 0), now.busy_us - before.busy_us)
        if step is not None:
            for remote, busy in busy_now.items():
                by_step = self.links[remote].step_busy_us
                by_step[step] = by_step.get(step, 0) + busy

    def host_address(self) -> str | None:
        """The address this process's links leave from: its one non-loopback local address, else loopback."""
        outside = [a for a in self.local_addresses if not ipaddress.ip_address(a).is_loopback]
        if outside:
            return outside[0]
        return self.local_addresses[0] if self.local_addresses else None

    def stop(self) -> None:
        """Forget the connections (their descriptors may be closed and reused after training)."""
        self._connections, self._last = [], {}
