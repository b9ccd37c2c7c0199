"""iproute2 plumbing for :mod:`ds_lightning.testing.netns`.

Running ``ip``/``tc``/``ss``, probing what the kernel offers, listing and deleting namespaces and links, and
signalling processes.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BENCHMARK_NETWORK = ipaddress.IPv4Network("198.18.0.0/15")
"""RFC 2544 benchmarking range; every cluster takes one /24 ``198.18.<k>.0/24`` of it."""

DEFAULT_PREFIX = "ds"
"""Start of every generated namespace prefix (``ds<6 hex>``); :func:`leftover_namespaces` looks for it."""

BRIDGE_PREFIX = "dsb"
"""Start of every bridge name (``dsb<6 hex>``); :func:`leftover_bridges` looks for it."""

IFNAMSIZ = 15
"""Longest Linux interface name."""

SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin", "/bin"])
LOCK_DIR = Path(tempfile.gettempdir()) / "ds_lightning_netns"
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
TERMINATE_GRACE_S = 3.0

# Connects to port 9 (discard) of argv[1]: an answer of any kind (accept or RST) proves the host is reachable.
PROBE_CODE = (
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


def binary(name: str) -> str | None:
    """Absolute path of ``name``, also looking in the sbin folders a non-login PATH may lack."""
    return shutil.which(name, path=SEARCH_PATH)


def tool(name: str) -> str:
    """Absolute path of an iproute2 binary (falls back to the bare name so the error names it)."""
    return binary(name) or name


def run(args: Sequence[str], *, timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess[str]:
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
        raise CommandError(proc.returncode, list(args), proc.stdout, proc.stderr)
    return proc


class CommandError(subprocess.CalledProcessError):
    """A :class:`subprocess.CalledProcessError` whose message carries the command's stderr."""

    def __str__(self) -> str:
        detail = (self.stderr or "").strip()
        return f"{super().__str__()}: {detail}" if detail else super().__str__()


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Runs ``ip <args>``."""
    return run([tool("ip"), *args], check=check)


def fmt(value: float) -> str:
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
    if any(binary(name) is None for name in ("ip", "tc", "ss")):
        return "needs iproute2 (ip, tc, ss): apt-get install iproute2"
    probe = f"dsprobe{secrets.token_hex(4)}"
    try:
        added = ip("netns", "add", probe, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"`ip netns add` failed: {exc}"
    if added.returncode != 0:
        return f"`ip netns add` failed: {(added.stderr or added.stdout).strip() or f'exit {added.returncode}'}"
    deleted = ip("netns", "delete", probe, check=False)
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
    if os.geteuid() != 0 or binary("ip") is None or binary("tc") is None:
        return False
    probe = f"dsprobe{secrets.token_hex(4)}"
    if ip("netns", "add", probe, check=False).returncode != 0:
        return False
    try:
        ip("-n", probe, "link", "set", "lo", "up", check=False)
        return (
            run([tool("tc"), "-n", probe, "qdisc", "add", "dev", "lo", "root", *args[kind]], check=False).returncode
            == 0
        )
    finally:
        ip("netns", "delete", probe, check=False)


def netem_available() -> bool:
    """Whether ``tc ... netem`` works here (needed for :meth:`Cluster.shape` with a delay)."""
    return qdisc_available("netem")


def netns_names() -> list[str]:
    """Names from ``ip netns list`` (each line is ``name`` or ``name (id: N)``)."""
    out = ip("netns", "list", check=False).stdout
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
    return sorted(name for name in netns_names() if pattern.fullmatch(name))


def link_names(*selector: str) -> list[str]:
    """Interface names from ``ip -o link show <selector>`` in the root namespace."""
    out = ip("-o", "link", "show", *selector, check=False).stdout
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
    return sorted(name for name in link_names("type", "bridge") if name.startswith(prefix))


def root_networks() -> list[ipaddress.IPv4Network]:
    """IPv4 networks of every address in the root namespace."""
    out = ip("-o", "-4", "addr", "show", check=False).stdout
    nets = []
    for match in re.finditer(r"\binet (\d+\.\d+\.\d+\.\d+/\d+)", out):
        nets.append(ipaddress.IPv4Interface(match.group(1)).network)
    return nets


def parse_ss_listen(output: str) -> list[tuple[str, int, str]]:
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


def signal_process(proc: subprocess.Popen[Any], sig: signal.Signals) -> None:
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


def kill_namespace_pids(name: str) -> None:
    """SIGKILLs whatever still runs in the namespace (it would keep the namespace and its veth alive)."""
    out = ip("netns", "pids", name, check=False).stdout
    for pid in (int(tok) for tok in out.split() if tok.isdigit()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def delete_link(link: str) -> None:
    proc = ip("link", "delete", "dev", link, check=False)
    if proc.returncode != 0 and "Cannot find device" not in proc.stderr:
        raise RuntimeError(proc.stderr.strip() or f"exit {proc.returncode}")


def delete_namespace(name: str) -> None:
    proc = ip("netns", "delete", name, check=False)
    if proc.returncode != 0 and name in netns_names():
        raise RuntimeError(proc.stderr.strip() or f"exit {proc.returncode}")


def netem_args(rate_mbit: float | None, delay_ms: float | None) -> list[str]:
    """The ``netem`` qdisc arguments for a delay and/or a rate (only the parts given)."""
    args = ["netem"]
    if delay_ms is not None:
        args += ["delay", f"{fmt(delay_ms)}ms"]
    if rate_mbit is not None:
        args += ["rate", f"{fmt(rate_mbit)}mbit"]
    return args


def tbf_args(rate_mbit: float) -> list[str]:
    """A ``tbf`` rate limiter's arguments, the fallback for a rate-only shape without netem."""
    # Burst of ~5 ms at line rate but at least 64 KiB so GSO super-packets on veth are not split;
    # queue of ~50 ms at line rate (netem's default queue is 1000 packets).
    rate_bytes = rate_mbit * 1e6 / 8
    burst = max(64 * 1024, int(rate_bytes * 0.005))
    limit = max(2 * burst, int(rate_bytes * 0.05))
    return ["tbf", "rate", f"{fmt(rate_mbit)}mbit", "burst", str(burst), "limit", str(limit)]


def probe_command(address: str, timeout: float) -> list[str]:
    """A command that exits 0 when ``address`` answers: ``ping -c 1``, or a TCP connect to port 9 without ping."""
    ping = binary("ping")
    if ping is not None:
        return [ping, "-n", "-q", "-c", "1", "-W", fmt(max(1.0, timeout)), address]
    return [sys.executable, "-I", "-S", "-c", PROBE_CODE, address, fmt(timeout)]
