"""A small multi-host cluster made of Linux network namespaces on one bridge.

Each host is a network namespace with its own loopback and one ``eth0`` (a veth pair whose other end is a port of a
bridge in the root namespace). Hosts get addresses from the benchmarking range 198.18.0.0/15, one /24 per cluster,
so two clusters alive at the same time never share a subnet. The bridge itself has no address: traffic stays between
the namespaces.

Example:
    >>> with Cluster(2) as cluster:  # doctest: +SKIP
    ...     a, b = cluster.hosts
    ...     cluster.shape(b, rate_mbit=100)
    ...     server = b.run(["python", "-m", "http.server", "--bind", b.address, "8000"])

Everything needs root and iproute2 (``ip``, ``tc``, ``ss``); :func:`missing_requirements` says why a cluster can't be
built here. Link shaping uses ``netem`` when the kernel has it; without it (``CONFIG_NET_SCH_NETEM`` unset) a pure rate
limit falls back to ``tbf`` and a delay raises :class:`ShapingUnsupportedError`.

"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import ipaddress
import logging
import secrets
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import IO, Any

from ds_lightning.testing._iproute import (
    BENCHMARK_NETWORK,
    BRIDGE_PREFIX,
    DEFAULT_PREFIX,
    IFNAMSIZ,
    LOCK_DIR,
    NAME_RE,
    TERMINATE_GRACE_S,
    CommandError,
    delete_link,
    delete_namespace,
    ip,
    kill_namespace_pids,
    leftover_bridges,
    leftover_namespaces,
    link_names,
    missing_requirements,
    netem_args,
    netem_available,
    netns_names,
    parse_ss_listen,
    probe_command,
    qdisc_available,
    root_networks,
    run,
    signal_process,
    tbf_args,
    tool,
)

__all__ = [
    "BENCHMARK_NETWORK",
    "Cluster",
    "Host",
    "ShapingUnsupportedError",
    "leftover_bridges",
    "leftover_namespaces",
    "missing_requirements",
    "netem_available",
    "qdisc_available",
]

logger = logging.getLogger(__name__)


class ShapingUnsupportedError(RuntimeError):
    """The kernel lacks the queueing discipline a requested link shape needs."""


@dataclass
class Host:
    """One host of a :class:`Cluster`: a network namespace with ``eth0`` on the cluster's bridge.

    Attributes:
        name: The network namespace name.
        address: The IPv4 address of ``eth0`` (no prefix length).
        interface: The interface name inside the namespace.
        bridge_port: The root-namespace end of the veth pair, a port of the bridge.

    """

    name: str
    address: str
    interface: str = "eth0"
    bridge_port: str = ""
    _track: Callable[[subprocess.Popen[Any]], None] | None = field(default=None, repr=False, compare=False)

    def command(self, cmd: Sequence[str]) -> list[str]:
        """The command line that runs ``cmd`` inside this namespace."""
        return [tool("ip"), "netns", "exec", self.name, *cmd]

    def run(self, cmd: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Starts ``cmd`` inside the namespace; the cluster kills it at teardown if it is still alive.

        Args:
            cmd: The command line.
            **popen_kwargs: Passed to :class:`subprocess.Popen`; ``start_new_session`` defaults to True so teardown
                can signal the whole process group.

        Returns:
            The started process.

        """
        popen_kwargs.setdefault("start_new_session", True)
        proc: subprocess.Popen[Any] = subprocess.Popen(self.command(cmd), **popen_kwargs)
        if self._track is not None:
            self._track(proc)
        return proc

    def check_output(self, cmd: Sequence[str], timeout: float = 30) -> str:
        """Runs ``cmd`` inside the namespace to completion.

        Args:
            cmd: The command line.
            timeout: Seconds before it is killed (raises :class:`subprocess.TimeoutExpired`).

        Returns:
            Its stdout as text.

        Raises:
            subprocess.CalledProcessError: On a non-zero exit (the message includes stderr).

        """
        return run(self.command(cmd), timeout=timeout).stdout


class Cluster:
    """A set of network-namespace hosts on one bridge; a context manager that always tears everything down.

    Args:
        n_hosts: Number of hosts (namespaces).
        prefix: Namespace name prefix (host i is ``<prefix>h<i>``); default ``ds<6 hex>``, unique per cluster.

    Attributes:
        prefix: The namespace name prefix.
        bridge: The bridge name in the root namespace.
        network: The cluster's /24 (``198.18.<k>.0/24``); host i has ``.i+1``.
        hosts: The hosts, filled on ``__enter__``.

    """

    def __init__(self, n_hosts: int, prefix: str | None = None) -> None:
        if n_hosts < 1:
            raise ValueError(f"n_hosts must be >= 1, got {n_hosts}")
        if n_hosts > 254:
            raise ValueError(f"one /24 holds at most 254 hosts, got {n_hosts}")
        token = secrets.token_hex(3)
        self.n_hosts = n_hosts
        self.prefix = prefix if prefix is not None else f"{DEFAULT_PREFIX}{token}"
        if not NAME_RE.fullmatch(self.prefix):
            raise ValueError(f"prefix {self.prefix!r} must be letters, digits, '_' or '-'")
        longest = f"{self.prefix}v{n_hosts - 1}"
        if len(longest) > IFNAMSIZ:
            raise ValueError(f"prefix {self.prefix!r} too long: bridge port {longest!r} exceeds {IFNAMSIZ} chars")
        self.bridge = f"{BRIDGE_PREFIX}{token}"
        self.network: ipaddress.IPv4Network | None = None
        self.hosts: list[Host] = []
        self._seed = int(token, 16)
        self._procs: list[subprocess.Popen[Any]] = []
        self._created_namespaces: list[str] = []
        self._created_links: list[str] = []
        self._lock_file: IO[bytes] | None = None
        self._entered = False
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Cluster:
        if self._entered:
            raise RuntimeError("a Cluster can be entered only once")
        self._entered = True
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _build(self) -> None:
        existing_ns = set(netns_names())
        names = [f"{self.prefix}h{i}" for i in range(self.n_hosts)]
        clash = sorted(existing_ns.intersection(names))
        if clash:
            raise RuntimeError(f"namespaces already exist: {clash}")
        existing_links = set(link_names())
        ports = [f"{self.prefix}v{i}" for i in range(self.n_hosts)]
        clash = sorted(existing_links.intersection([self.bridge, *ports]))
        if clash:
            raise RuntimeError(f"interfaces already exist in the root namespace: {clash}")
        self.network = self._claim_network()

        ip("link", "add", "name", self.bridge, "type", "bridge")
        self._created_links.append(self.bridge)
        ip("link", "set", "dev", self.bridge, "addrgenmode", "none", check=False)  # no IPv6 link-local either
        ip("link", "set", "dev", self.bridge, "up")

        hosts_iter = iter(self.network.hosts())
        for name, port in zip(names, ports, strict=True):
            address = str(next(hosts_iter))
            ip("netns", "add", name)
            self._created_namespaces.append(name)
            ip("link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", name)
            self._created_links.append(port)
            ip("link", "set", "dev", port, "addrgenmode", "none", check=False)
            ip("link", "set", "dev", port, "master", self.bridge)
            ip("link", "set", "dev", port, "up")
            ip("-n", name, "link", "set", "dev", "lo", "up")
            ip("-n", name, "addr", "add", f"{address}/{self.network.prefixlen}", "dev", "eth0")
            ip("-n", name, "link", "set", "dev", "eth0", "up")
            self.hosts.append(Host(name=name, address=address, bridge_port=port, _track=self._procs.append))

    def _claim_network(self) -> ipaddress.IPv4Network:
        """Picks ``198.18.<k>.0/24`` unused in the root namespace and not held by another live cluster.

        A cluster holds an exclusive ``flock`` on a per-subnet file for its lifetime, so clusters in other processes
        skip its subnet; the kernel drops the lock if the process dies.
        """
        used = root_networks()
        LOCK_DIR.mkdir(parents=True, exist_ok=True)
        for step in range(256):
            k = (self._seed + step) % 256
            candidate = ipaddress.IPv4Network(f"198.18.{k}.0/24")
            if any(candidate.overlaps(net) for net in used):
                continue
            handle = open(LOCK_DIR / f"198.18.{k}.lock", "ab")  # noqa: SIM115 - held for the cluster's lifetime
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                handle.close()
                continue
            self._lock_file = handle
            return candidate
        raise RuntimeError("no free /24 left in 198.18.0.0/24-198.18.255.0/24")

    def close(self) -> None:
        """Tears everything down: started processes, namespaces (and their veths), the bridge.

        Idempotent and never raises; failures are logged.
        """
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        self._guard("stop processes", self._stop_processes)
        for name in reversed(self._created_namespaces):
            self._guard(f"kill processes in {name}", kill_namespace_pids, name)
        for link in reversed(self._created_links):  # bridge ports first, then the bridge
            self._guard(f"delete link {link}", delete_link, link)
        for name in reversed(self._created_namespaces):
            self._guard(f"delete namespace {name}", delete_namespace, name)
        if self._lock_file is not None:
            self._guard("release subnet lock", self._lock_file.close)
            self._lock_file = None

    @staticmethod
    def _guard(what: str, fn: Callable[..., object], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:
            logger.warning("netns cluster teardown: could not %s: %s", what, exc)

    def _stop_processes(self) -> None:
        alive = [p for p in self._procs if p.poll() is None]
        for proc in alive:
            signal_process(proc, signal.SIGTERM)
        deadline = time.monotonic() + TERMINATE_GRACE_S
        for proc in alive:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                signal_process(proc, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
        self._procs.clear()

    # ------------------------------------------------------------------ network control

    def _live(self, host: Host) -> Host:
        if self._closed or not self.hosts:
            raise RuntimeError("cluster is not running (use it as a context manager)")
        if host not in self.hosts:
            raise ValueError(f"{host.name} is not a host of this cluster")
        return host

    @staticmethod
    def _qdisc_replace(host: Host, *qdisc: str) -> None:
        """Installs ``qdisc`` as the root qdisc on both ends of the host's link: ``eth0`` and the bridge port."""
        tc = tool("tc")
        run([tc, "-n", host.name, "qdisc", "replace", "dev", host.interface, "root", *qdisc])
        run([tc, "qdisc", "replace", "dev", host.bridge_port, "root", *qdisc])

    def shape(self, host: Host, rate_mbit: float | None = None, delay_ms: float | None = None) -> str:
        """Shapes both directions of the host's link (egress of ``eth0`` and of its bridge port).

        Installs ``netem delay <d>ms rate <r>mbit`` as the root qdisc of both ends (only the parts given). Without
        netem in the kernel, a rate-only shape falls back to a ``tbf`` rate limiter.

        Args:
            host: The host whose link to shape.
            rate_mbit: Bandwidth limit per direction in Mbit/s.
            delay_ms: One-way delay per direction in ms (a round trip gains twice this).

        Returns:
            The qdisc kind installed: ``"netem"`` or ``"tbf"``.

        Raises:
            ShapingUnsupportedError: A delay was asked for and the kernel has no netem.

        """
        self._live(host)
        if rate_mbit is None and delay_ms is None:
            raise ValueError("give rate_mbit and/or delay_ms")
        if rate_mbit is not None and rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be > 0, got {rate_mbit}")
        if delay_ms is not None and delay_ms < 0:
            raise ValueError(f"delay_ms must be >= 0, got {delay_ms}")
        if netem_available():
            self._qdisc_replace(host, *netem_args(rate_mbit, delay_ms))
            return "netem"
        if delay_ms:
            raise ShapingUnsupportedError(
                "this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), so link delay cannot be emulated; "
                "rate-only shaping still works (tbf)"
            )
        assert rate_mbit is not None
        self._qdisc_replace(host, *tbf_args(rate_mbit))
        return "tbf"

    def unshape(self, host: Host) -> None:
        """Removes the root qdiscs :meth:`shape` installed on both ends of the host's link."""
        self._live(host)
        tc = tool("tc")
        for cmd in (
            [tc, "-n", host.name, "qdisc", "del", "dev", host.interface, "root"],
            [tc, "qdisc", "del", "dev", host.bridge_port, "root"],
        ):
            proc = run(cmd, check=False)
            benign = ("No such file or directory", "Cannot delete qdisc with handle of zero", "No such")
            if proc.returncode != 0 and not any(text in proc.stderr for text in benign):
                raise CommandError(proc.returncode, cmd, proc.stdout, proc.stderr)

    def qdiscs(self, host: Host) -> tuple[str, str]:
        """``tc qdisc show`` of the host's ``eth0`` (inside) and of its bridge port (outside)."""
        self._live(host)
        tc = tool("tc")
        inside = run([tc, "-n", host.name, "qdisc", "show", "dev", host.interface]).stdout
        outside = run([tc, "qdisc", "show", "dev", host.bridge_port]).stdout
        return inside, outside

    def cut(self, host: Host) -> None:
        """Disconnects the host: its bridge port goes down (its ``eth0`` loses carrier)."""
        self._live(host)
        ip("link", "set", "dev", host.bridge_port, "down")

    def restore(self, host: Host, timeout: float = 10.0) -> None:
        """Reconnects a cut host and, with more than one host, waits until another host reaches it.

        Args:
            host: The host to reconnect.
            timeout: Seconds to wait for reachability.

        Raises:
            TimeoutError: The host is still unreachable after ``timeout`` seconds.

        """
        self._live(host)
        ip("link", "set", "dev", host.bridge_port, "up")
        if self.n_hosts < 2:
            return
        other = next(h for h in self.hosts if h is not host)
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if self.can_reach(other, host, timeout=max(0.2, min(1.0, remaining))):
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{host.name} ({host.address}) unreachable from {other.name} {timeout}s after restore"
                )
            time.sleep(0.1)

    def can_reach(self, src: Host, dst: Host, timeout: float = 1.0) -> bool:
        """Whether ``src`` gets an answer from ``dst``'s address.

        Uses ``ping -c 1`` when installed; otherwise a TCP connect to port 9 from inside ``src``, where either an
        accept or a refusal (RST) counts as an answer.

        Args:
            src: The host that probes.
            dst: The host probed.
            timeout: Seconds to wait for the answer.

        Returns:
            True when an answer came back in time.

        """
        self._live(src)
        cmd = probe_command(dst.address, timeout)
        try:
            return run(src.command(cmd), timeout=timeout + 5, check=False).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def pids(self, host: Host) -> list[int]:
        """Process ids of everything running inside the host's namespace (``ip netns pids``)."""
        self._live(host)
        return [int(tok) for tok in ip("netns", "pids", host.name, check=False).stdout.split() if tok.isdigit()]

    def kill(self, host: Host) -> None:
        """SIGKILLs every process inside the host's namespace, as if the machine lost power (its link stays up)."""
        self._live(host)
        kill_namespace_pids(host.name)

    def listening(self, host: Host) -> list[tuple[str, int, str]]:
        """TCP listeners inside the host's namespace.

        Returns:
            ``(local address, port, process text)`` per listening socket, from ``ss -ltnpH``; the process text is
            like ``users:(("python",pid=12,fd=3))``.

        """
        self._live(host)
        return parse_ss_listen(host.check_output([tool("ss"), "-ltnpH"]))
