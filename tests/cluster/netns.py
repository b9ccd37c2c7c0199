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
import functools
import ipaddress
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

logger = logging.getLogger(__name__)

BENCHMARK_NETWORK = ipaddress.IPv4Network("198.18.0.0/15")
"""RFC 2544 benchmarking range; every cluster takes one /24 ``198.18.<k>.0/24`` of it."""

DEFAULT_PREFIX = "ds"
"""Start of every generated namespace prefix (``ds<6 hex>``); :func:`leftover_namespaces` looks for it."""

BRIDGE_PREFIX = "dsb"
"""Start of every bridge name (``dsb<6 hex>``); :func:`leftover_bridges` looks for it."""

IFNAMSIZ = 15
"""Longest Linux interface name."""

_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin", "/bin"])
_LOCK_DIR = Path(tempfile.gettempdir()) / "ds_lightning_netns"
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
_TERMINATE_GRACE_S = 3.0

# Connects to port 9 (discard) of argv[1]: an answer of any kind (accept or RST) proves the host is reachable.
_PROBE_CODE = (
    "import socket, sys\n"
    "s = socket.socket()\n"
    "s.settimeout(float(sys.argv[2]))\n"
    "try:\n"
    "    s.connect((sys.argv[1], 9))\n"
    "except ConnectionRefusedError:\n"
    "    sys.exit(0)\n"
    "except OSError:\n"
    "    sys.exit(1)\n"
)


class ShapingUnsupportedError(RuntimeError):
    """The kernel lacks the queueing discipline a requested link shape needs."""


def _binary(name: str) -> str | None:
    """Absolute path of ``name``, also looking in the sbin folders a non-login PATH may lack."""
    return shutil.which(name, path=_SEARCH_PATH)


def _tool(name: str) -> str:
    """Absolute path of an iproute2 binary (falls back to the bare name so the error names it)."""
    return _binary(name) or name


def _run(args: Sequence[str], *, timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Runs a short administrative command and captures its output.

    Args:
        args: The command line.
        timeout: Seconds before the command is killed.
        check: Raise :class:`subprocess.CalledProcessError` (message includes stderr) on a non-zero exit.

    Returns:
        The completed process with text stdout and stderr.
    """
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise _CommandError(proc.returncode, list(args), proc.stdout, proc.stderr)
    return proc


class _CommandError(subprocess.CalledProcessError):
    """A :class:`subprocess.CalledProcessError` whose message carries the command's stderr."""

    def __str__(self) -> str:
        detail = (self.stderr or "").strip()
        return f"{super().__str__()}: {detail}" if detail else super().__str__()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Runs ``ip <args>``."""
    return _run([_tool("ip"), *args], check=check)


def _fmt(value: float) -> str:
    """Formats a number for tc without exponent notation (``1e+06`` would not parse)."""
    text = f"{value:.6f}".rstrip("0").rstrip(".")
    return text or "0"


def missing_requirements() -> str | None:
    """Says why a :class:`Cluster` cannot be built here.

    Probes by creating and deleting a uniquely named throwaway namespace.

    Returns:
        None when a cluster can be built, else a human-readable reason naming what is missing.
    """
    if os.geteuid() != 0:
        return "needs root (uid 0) to create network namespaces"
    if any(_binary(name) is None for name in ("ip", "tc", "ss")):
        return "needs iproute2 (ip, tc, ss): apt-get install iproute2"
    probe = f"dsprobe{secrets.token_hex(4)}"
    try:
        added = _ip("netns", "add", probe, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"`ip netns add` failed: {exc}"
    if added.returncode != 0:
        return f"`ip netns add` failed: {(added.stderr or added.stdout).strip() or f'exit {added.returncode}'}"
    deleted = _ip("netns", "delete", probe, check=False)
    if deleted.returncode != 0:
        return f"`ip netns delete` failed: {(deleted.stderr or deleted.stdout).strip() or f'exit {deleted.returncode}'}"
    return None


@functools.cache
def qdisc_available(kind: str) -> bool:
    """Whether the kernel offers a queueing discipline (probed once per process in a throwaway namespace).

    Args:
        kind: ``"netem"`` or ``"tbf"``.

    Returns:
        True when ``tc qdisc add ... <kind>`` succeeds.
    """
    args = {"netem": ["netem", "delay", "1ms"], "tbf": ["tbf", "rate", "1mbit", "burst", "32kbit", "latency", "50ms"]}
    if kind not in args:
        raise ValueError(f"unknown qdisc probe {kind!r}; known: {sorted(args)}")
    if os.geteuid() != 0 or _binary("ip") is None or _binary("tc") is None:
        return False
    probe = f"dsprobe{secrets.token_hex(4)}"
    if _ip("netns", "add", probe, check=False).returncode != 0:
        return False
    try:
        _ip("-n", probe, "link", "set", "lo", "up", check=False)
        return (
            _run([_tool("tc"), "-n", probe, "qdisc", "add", "dev", "lo", "root", *args[kind]], check=False).returncode
            == 0
        )
    finally:
        _ip("netns", "delete", probe, check=False)


def netem_available() -> bool:
    """Whether ``tc ... netem`` works here (needed for :meth:`Cluster.shape` with a delay)."""
    return qdisc_available("netem")


def _netns_names() -> list[str]:
    """Names from ``ip netns list`` (each line is ``name`` or ``name (id: N)``)."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def leftover_namespaces(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Namespaces following the cluster naming scheme ``<prefix...>h<i>``.

    Args:
        prefix: Start of the names to look for: the default finds every cluster's, a cluster's own ``prefix`` finds
            only that cluster's.

    Returns:
        Sorted matching namespace names.
    """
    pattern = re.compile(re.escape(prefix) + r"[A-Za-z0-9_-]*h\d+")
    return sorted(name for name in _netns_names() if pattern.fullmatch(name))


def _link_names(*selector: str) -> list[str]:
    """Interface names from ``ip -o link show <selector>`` in the root namespace."""
    out = _ip("-o", "link", "show", *selector, check=False).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@")[0])
    return names


def leftover_bridges(prefix: str = BRIDGE_PREFIX) -> list[str]:
    """Bridges in the root namespace whose names start with ``prefix``.

    Args:
        prefix: Start of the names to look for.

    Returns:
        Sorted matching bridge names.
    """
    return sorted(name for name in _link_names("type", "bridge") if name.startswith(prefix))


def _root_networks() -> list[ipaddress.IPv4Network]:
    """IPv4 networks of every address in the root namespace."""
    out = _ip("-o", "-4", "addr", "show", check=False).stdout
    nets = []
    for match in re.finditer(r"\binet (\d+\.\d+\.\d+\.\d+/\d+)", out):
        nets.append(ipaddress.IPv4Interface(match.group(1)).network)
    return nets


def _parse_ss_listen(output: str) -> list[tuple[str, int, str]]:
    """Parses ``ss -ltnpH`` lines into ``(local address, port, process text)``."""
    result = []
    for line in output.splitlines():
        cols = line.split()
        if len(cols) < 5:
            continue
        local = cols[3]
        address, _, port = local.rpartition(":")
        address = address.strip("[]").split("%")[0]
        try:
            port_number = int(port)
        except ValueError:
            continue
        result.append((address, port_number, " ".join(cols[5:])))
    return result


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
        return [_tool("ip"), "netns", "exec", self.name, *cmd]

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
        return _run(self.command(cmd), timeout=timeout).stdout


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
        if not _NAME_RE.fullmatch(self.prefix):
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
        existing_ns = set(_netns_names())
        names = [f"{self.prefix}h{i}" for i in range(self.n_hosts)]
        clash = sorted(existing_ns.intersection(names))
        if clash:
            raise RuntimeError(f"namespaces already exist: {clash}")
        existing_links = set(_link_names())
        ports = [f"{self.prefix}v{i}" for i in range(self.n_hosts)]
        clash = sorted(existing_links.intersection([self.bridge, *ports]))
        if clash:
            raise RuntimeError(f"interfaces already exist in the root namespace: {clash}")
        self.network = self._claim_network()

        _ip("link", "add", "name", self.bridge, "type", "bridge")
        self._created_links.append(self.bridge)
        _ip("link", "set", "dev", self.bridge, "addrgenmode", "none", check=False)  # no IPv6 link-local either
        _ip("link", "set", "dev", self.bridge, "up")

        hosts_iter = iter(self.network.hosts())
        for name, port in zip(names, ports, strict=True):
            address = str(next(hosts_iter))
            _ip("netns", "add", name)
            self._created_namespaces.append(name)
            _ip("link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", name)
            self._created_links.append(port)
            _ip("link", "set", "dev", port, "addrgenmode", "none", check=False)
            _ip("link", "set", "dev", port, "master", self.bridge)
            _ip("link", "set", "dev", port, "up")
            _ip("-n", name, "link", "set", "dev", "lo", "up")
            _ip("-n", name, "addr", "add", f"{address}/{self.network.prefixlen}", "dev", "eth0")
            _ip("-n", name, "link", "set", "dev", "eth0", "up")
            self.hosts.append(Host(name=name, address=address, bridge_port=port, _track=self._procs.append))

    def _claim_network(self) -> ipaddress.IPv4Network:
        """Picks ``198.18.<k>.0/24`` unused in the root namespace and not held by another live cluster.

        A cluster holds an exclusive ``flock`` on a per-subnet file for its lifetime, so clusters in other processes
        skip its subnet; the kernel drops the lock if the process dies.
        """
        used = _root_networks()
        _LOCK_DIR.mkdir(parents=True, exist_ok=True)
        for step in range(256):
            k = (self._seed + step) % 256
            candidate = ipaddress.IPv4Network(f"198.18.{k}.0/24")
            if any(candidate.overlaps(net) for net in used):
                continue
            handle = open(_LOCK_DIR / f"198.18.{k}.lock", "ab")  # noqa: SIM115 - held for the cluster's lifetime
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
            self._guard(f"kill processes in {name}", self._kill_namespace_pids, name)
        for link in reversed(self._created_links):  # bridge ports first, then the bridge
            self._guard(f"delete link {link}", self._delete_link, link)
        for name in reversed(self._created_namespaces):
            self._guard(f"delete namespace {name}", self._delete_namespace, name)
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
            self._signal(proc, signal.SIGTERM)
        deadline = time.monotonic() + _TERMINATE_GRACE_S
        for proc in alive:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._signal(proc, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
        self._procs.clear()

    @staticmethod
    def _signal(proc: subprocess.Popen[Any], sig: signal.Signals) -> None:
        """Signals the process group when the process leads one (the default of :meth:`Host.run`), else the process."""
        with contextlib.suppress(ProcessLookupError):
            try:
                leads_group = os.getpgid(proc.pid) == proc.pid
            except ProcessLookupError:
                return
            if leads_group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)

    @staticmethod
    def _kill_namespace_pids(name: str) -> None:
        """SIGKILLs whatever still runs in the namespace (it would keep the namespace and its veth alive)."""
        out = _ip("netns", "pids", name, check=False).stdout
        for pid in (int(tok) for tok in out.split() if tok.isdigit()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    @staticmethod
    def _delete_link(link: str) -> None:
        proc = _ip("link", "delete", "dev", link, check=False)
        if proc.returncode != 0 and "Cannot find device" not in proc.stderr:
            raise RuntimeError(proc.stderr.strip() or f"exit {proc.returncode}")

    @staticmethod
    def _delete_namespace(name: str) -> None:
        proc = _ip("netns", "delete", name, check=False)
        if proc.returncode != 0 and name in _netns_names():
            raise RuntimeError(proc.stderr.strip() or f"exit {proc.returncode}")

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
        tc = _tool("tc")
        _run([tc, "-n", host.name, "qdisc", "replace", "dev", host.interface, "root", *qdisc])
        _run([tc, "qdisc", "replace", "dev", host.bridge_port, "root", *qdisc])

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
            args = ["netem"]
            if delay_ms is not None:
                args += ["delay", f"{_fmt(delay_ms)}ms"]
            if rate_mbit is not None:
                args += ["rate", f"{_fmt(rate_mbit)}mbit"]
            self._qdisc_replace(host, *args)
            return "netem"
        if delay_ms:
            raise ShapingUnsupportedError(
                "this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), so link delay cannot be emulated; "
                "rate-only shaping still works (tbf)"
            )
        assert rate_mbit is not None
        # tbf: burst of ~5 ms at line rate but at least 64 KiB so GSO super-packets on veth are not split;
        # queue of ~50 ms at line rate (netem's default queue is 1000 packets).
        rate_bytes = rate_mbit * 1e6 / 8
        burst = max(64 * 1024, int(rate_bytes * 0.005))
        limit = max(2 * burst, int(rate_bytes * 0.05))
        self._qdisc_replace(host, "tbf", "rate", f"{_fmt(rate_mbit)}mbit", "burst", str(burst), "limit", str(limit))
        return "tbf"

    def unshape(self, host: Host) -> None:
        """Removes the root qdiscs :meth:`shape` installed on both ends of the host's link."""
        self._live(host)
        tc = _tool("tc")
        for cmd in (
            [tc, "-n", host.name, "qdisc", "del", "dev", host.interface, "root"],
            [tc, "qdisc", "del", "dev", host.bridge_port, "root"],
        ):
            proc = _run(cmd, check=False)
            benign = ("No such file or directory", "Cannot delete qdisc with handle of zero", "No such")
            if proc.returncode != 0 and not any(text in proc.stderr for text in benign):
                raise _CommandError(proc.returncode, cmd, proc.stdout, proc.stderr)

    def qdiscs(self, host: Host) -> tuple[str, str]:
        """``tc qdisc show`` of the host's ``eth0`` (inside) and of its bridge port (outside)."""
        self._live(host)
        tc = _tool("tc")
        inside = _run([tc, "-n", host.name, "qdisc", "show", "dev", host.interface]).stdout
        outside = _run([tc, "qdisc", "show", "dev", host.bridge_port]).stdout
        return inside, outside

    def cut(self, host: Host) -> None:
        """Disconnects the host: its bridge port goes down (its ``eth0`` loses carrier)."""
        self._live(host)
        _ip("link", "set", "dev", host.bridge_port, "down")

    def restore(self, host: Host, timeout: float = 10.0) -> None:
        """Reconnects a cut host and, with more than one host, waits until another host reaches it.

        Args:
            host: The host to reconnect.
            timeout: Seconds to wait for reachability.

        Raises:
            TimeoutError: The host is still unreachable after ``timeout`` seconds.
        """
        self._live(host)
        _ip("link", "set", "dev", host.bridge_port, "up")
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
        ping = _binary("ping")
        if ping is not None:
            cmd = [ping, "-n", "-q", "-c", "1", "-W", _fmt(max(1.0, timeout)), dst.address]
        else:
            cmd = [sys.executable, "-I", "-S", "-c", _PROBE_CODE, dst.address, _fmt(timeout)]
        try:
            return _run(src.command(cmd), timeout=timeout + 5, check=False).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def pids(self, host: Host) -> list[int]:
        """Process ids of everything running inside the host's namespace (``ip netns pids``)."""
        self._live(host)
        return [int(tok) for tok in _ip("netns", "pids", host.name, check=False).stdout.split() if tok.isdigit()]

    def kill(self, host: Host) -> None:
        """SIGKILLs every process inside the host's namespace, as if the machine lost power (its link stays up)."""
        self._live(host)
        self._kill_namespace_pids(host.name)

    def listening(self, host: Host) -> list[tuple[str, int, str]]:
        """TCP listeners inside the host's namespace.

        Returns:
            ``(local address, port, process text)`` per listening socket, from ``ss -ltnpH``; the process text is
            like ``users:(("python",pid=12,fd=3))``.
        """
        self._live(host)
        return _parse_ss_listen(host.check_output([_tool("ss"), "-ltnpH"]))
