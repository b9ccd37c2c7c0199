"""The network-namespace test cluster: addressing, isolation, shaping, cuts, listeners and teardown."""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ds_lightning.testing.netns import (
    BENCHMARK_NETWORK,
    Cluster,
    Host,
    ShapingUnsupportedError,
    leftover_bridges,
    leftover_namespaces,
    missing_requirements,
    netem_available,
)
from tests.cluster import conftest as cluster_conftest
from tests.cluster.conftest import (
    REQUIRE_CLUSTER,
    cluster_unavailable,
    default_search_path,
    require_cluster,
    unavailable_action,
)

MakeCluster = Callable[[int], Cluster]

PORT = 5555  # namespaces are fresh, so any port is free

SERVER = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen()
while True:
    conn, _ = s.accept()
    conn.close()
"""

CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
except OSError as exc:
    print(type(exc).__name__, exc)
    sys.exit(1)
print("connected")
"""


def python(code: str, *args: object) -> list[str]:
    return [sys.executable, "-I", "-S", "-c", code, *map(str, args)]


def serve(cluster: Cluster, host: Host, address: str, port: int = PORT) -> subprocess.Popen[bytes]:
    """Starts a TCP server in ``host`` and waits until ``ss`` shows it listening."""
    proc = host.run(python(SERVER, address, port))
    deadline = time.monotonic() + 10
    while not any(addr == address and p == port for addr, p, _ in cluster.listening(host)):
        assert proc.poll() is None, f"server in {host.name} exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"server in {host.name} not listening on {address}:{port}"
        time.sleep(0.05)
    return proc


def connects(src: Host, address: str, port: int = PORT, timeout: float = 3.0) -> bool:
    """Whether a TCP connect from inside ``src`` to ``address:port`` succeeds within ``timeout`` seconds."""
    proc = subprocess.run(
        src.command(python(CONNECT, address, port, timeout)), capture_output=True, text=True, timeout=timeout + 10
    )
    return proc.returncode == 0


def ping(src: Host, dst: Host) -> bool:
    cmd = src.command(["ping", "-n", "-q", "-c", "1", "-W", "2", dst.address])
    return subprocess.run(cmd, capture_output=True, timeout=10).returncode == 0


def link_exists(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", "dev", name], capture_output=True).returncode == 0


@pytest.mark.multiprocess
def test_hosts_have_distinct_benchmark_addresses_and_reach_each_other(cluster_factory: MakeCluster) -> None:
    cluster = cluster_factory(2)
    a, b = cluster.hosts
    addresses = [ipaddress.IPv4Address(h.address) for h in cluster.hosts]
    assert len(set(addresses)) == 2
    assert all(addr in BENCHMARK_NETWORK for addr in addresses)
    assert cluster.network is not None and all(addr in cluster.network for addr in addresses)
    assert [h.interface for h in cluster.hosts] == ["eth0", "eth0"]
    assert all(len(h.bridge_port) <= 15 and len(h.name) <= 15 for h in cluster.hosts)
    assert len(cluster.bridge) <= 15

    if shutil.which("ping"):
        assert ping(a, b) and ping(b, a)
    else:
        serve(cluster, a, a.address)
        serve(cluster, b, b.address)
        assert connects(a, b.address)
        assert connects(b, a.address)
    assert cluster.can_reach(a, b) and cluster.can_reach(b, a)


def test_two_live_clusters_use_different_subnets(cluster_factory: MakeCluster) -> None:
    first, second = cluster_factory(1), cluster_factory(1)
    assert first.network != second.network
    assert first.bridge != second.bridge
    assert not set(leftover_namespaces(first.prefix)) & set(leftover_namespaces(second.prefix))


@pytest.mark.multiprocess
def test_loopback_is_private_to_each_namespace(cluster_factory: MakeCluster) -> None:
    cluster = cluster_factory(2)
    a, b = cluster.hosts
    serve(cluster, a, "127.0.0.1")

    assert connects(a, "127.0.0.1")
    assert not connects(b, a.address)  # bound to a's loopback only: refused on a's eth0 address
    assert not connects(b, "127.0.0.1")  # b's loopback is b's own


def test_shape_rate_installs_qdisc_on_both_ends_and_unshape_removes_it(cluster_factory: MakeCluster) -> None:
    cluster = cluster_factory(2)
    host = cluster.hosts[1]

    kind = cluster.shape(host, rate_mbit=100)
    assert kind == ("netem" if netem_available() else "tbf")
    inside = host.check_output(["tc", "qdisc", "show", "dev", "eth0"])
    outside = subprocess.run(
        ["tc", "qdisc", "show", "dev", host.bridge_port], capture_output=True, text=True, check=True
    ).stdout
    for shown in (inside, outside):
        assert f"qdisc {kind} " in shown and " root " in shown
        assert "rate 100Mbit" in shown
    assert cluster.qdiscs(host) == (inside, outside)
    assert "rate" not in cluster.qdiscs(cluster.hosts[0])[0]  # the other host is untouched

    cluster.unshape(host)
    for shown in cluster.qdiscs(host):
        assert kind not in shown and "rate" not in shown
    cluster.unshape(host)  # nothing left to delete: not an error


@pytest.mark.skipif(not netem_available(), reason="kernel has no netem qdisc (CONFIG_NET_SCH_NETEM)")
def test_shape_delay_installs_netem_on_both_ends(cluster_factory: MakeCluster) -> None:
    cluster = cluster_factory(2)
    host = cluster.hosts[0]

    assert cluster.shape(host, rate_mbit=200, delay_ms=50) == "netem"
    for shown in cluster.qdiscs(host):
        assert "qdisc netem " in shown and "delay 50ms" in shown and "rate 200Mbit" in shown

    cluster.shape(host, delay_ms=5)  # replace, delay only
    for shown in cluster.qdiscs(host):
        assert "delay 5ms" in shown and "rate" not in shown

    cluster.unshape(host)
    for shown in cluster.qdiscs(host):
        assert "netem" not in shown


@pytest.mark.skipif(netem_available(), reason="kernel has netem: delay is supported")
def test_shape_delay_without_netem_raises(cluster_factory: MakeCluster) -> None:
    cluster = cluster_factory(1)
    with pytest.raises(ShapingUnsupportedError, match="netem"):
        cluster.shape(cluster.hosts[0], rate_mbit=100, delay_ms=50)
    for shown in cluster.qdiscs(cluster.hosts[0]):
        assert "rate" not in shown  # nothing half-installed


def test_shape_rejects_nonsense(cluster_factory: MakeCluster) -> None:
    cluster = cluster_factory(1)
    host = cluster.hosts[0]
    with pytest.raises(ValueError):
        cluster.shape(host)
    with pytest.raises(ValueError):
        cluster.shape(host, rate_mbit=0)


@pytest.mark.multiprocess
def test_cut_makes_host_unreachable_and_restore_reconnects(cluster_factory: MakeCluster) -> None:
    cluster = cluster_factory(2)
    a, b = cluster.hosts
    serve(cluster, b, b.address)
    assert connects(a, b.address)

    cluster.cut(b)
    assert not connects(a, b.address, timeout=3.0)
    assert not cluster.can_reach(a, b, timeout=0.5)

    cluster.restore(b)
    assert connects(a, b.address)
    assert cluster.can_reach(b, a)


@pytest.mark.multiprocess
def test_listening_reports_listener_address_port_and_process(cluster_factory: MakeCluster) -> None:
    cluster = cluster_factory(2)
    a, b = cluster.hosts
    proc = serve(cluster, a, a.address, port=6123)

    listeners = cluster.listening(a)
    matching = [(addr, port, text) for addr, port, text in listeners if port == 6123]
    assert len(matching) == 1
    addr, _, text = matching[0]
    assert addr == a.address
    assert f"pid={proc.pid}" in text and "python" in text
    assert all(port != 6123 for _, port, _ in cluster.listening(b))


def _assert_gone(prefix: str, bridge: str, ports: list[str], procs: list[subprocess.Popen[bytes]]) -> None:
    assert leftover_namespaces(prefix) == []
    assert bridge not in leftover_bridges()
    assert not link_exists(bridge)
    assert not any(link_exists(port) for port in ports)
    assert all(proc.poll() is not None for proc in procs)


@pytest.mark.multiprocess
def test_close_tears_everything_down(netns_required: None) -> None:
    with Cluster(2) as cluster:
        names = [h.name for h in cluster.hosts]
        assert leftover_namespaces(cluster.prefix) == names
        assert cluster.bridge in leftover_bridges()
        procs = [h.run(["sleep", "60"]) for h in cluster.hosts]
    _assert_gone(cluster.prefix, cluster.bridge, [h.bridge_port for h in cluster.hosts], procs)
    cluster.close()  # idempotent


@pytest.mark.multiprocess
def test_close_tears_everything_down_when_the_body_raises(netns_required: None) -> None:
    with pytest.raises(RuntimeError, match="boom"), Cluster(2) as cluster:
        procs = [h.run(["sleep", "60"]) for h in cluster.hosts]
        cluster.shape(cluster.hosts[0], rate_mbit=50)
        raise RuntimeError("boom")
    _assert_gone(cluster.prefix, cluster.bridge, [h.bridge_port for h in cluster.hosts], procs)


def _has_cap_sys_admin() -> bool:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) & (1 << 21))
    return False


def test_missing_requirements_reports_this_machine() -> None:
    reason = missing_requirements()
    ip = shutil.which("ip", path=default_search_path())
    if os.geteuid() != 0:
        assert reason == "needs root (uid 0) to create network namespaces"
    elif not all(shutil.which(tool, path=default_search_path()) for tool in ("ip", "tc", "ss")):
        assert reason == "needs iproute2 (ip, tc, ss): apt-get install iproute2"
    elif _has_cap_sys_admin():
        assert reason is None
    else:
        assert reason is not None and "ip netns add" in reason
    if ip is None:
        require_cluster()  # skips (fails with the switch on) naming the missing tools: no namespace list to read
    namespaces = subprocess.run([ip, "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    assert "dsprobe" not in namespaces  # the probe namespace was deleted


# --- whether cluster tests run, skip or fail (no root needed) ---------------------------------------------------


def _tools_dir(tmp_path, *names: str) -> str:
    """A folder holding executable stand-ins named ``names``: a search path with exactly those tools."""
    for name in names:
        tool = tmp_path / name
        tool.write_text("#!/bin/sh\nexit 0\n")
        tool.chmod(0o755)
    return str(tmp_path)


def test_cluster_unavailable_names_root_then_each_missing_iproute2_tool(tmp_path) -> None:
    assert cluster_unavailable(search_path=_tools_dir(tmp_path), euid=1000) == (
        "needs root (uid 0) to create network namespaces"
    )
    assert cluster_unavailable(search_path=_tools_dir(tmp_path), euid=0) == (
        "needs iproute2 (ip, tc, ss not found): apt-get install iproute2"
    )
    assert cluster_unavailable(search_path=_tools_dir(tmp_path, "tc", "ss"), euid=0) == (
        "needs iproute2 (ip not found): apt-get install iproute2"
    )


@pytest.mark.parametrize(
    ("reason", "environ", "action"),
    [
        (None, {REQUIRE_CLUSTER: "1"}, "run"),
        (None, {}, "run"),
        ("needs iproute2", {}, "skip"),
        ("needs iproute2", {REQUIRE_CLUSTER: "0"}, "skip"),
        ("needs iproute2", {"CI": "true"}, "skip"),  # a runner's CI variable decides nothing: only the switch does
        ("needs iproute2", {REQUIRE_CLUSTER: "1"}, "fail"),
        ("needs root", {REQUIRE_CLUSTER: "1"}, "fail"),  # the machine was meant to run them: not root is a failure too
        ("`ip netns add` failed", {REQUIRE_CLUSTER: " 1 ", "CI": ""}, "fail"),
    ],
)
def test_unavailable_action_fails_only_when_the_switch_requires_clusters(reason, environ, action) -> None:
    assert unavailable_action(reason, environ) == action


@pytest.mark.parametrize("required", ["", "1"])
def test_a_path_without_ip_skips_with_the_reason_or_fails_when_required(tmp_path, monkeypatch, required) -> None:
    monkeypatch.setattr(cluster_conftest, "SYSTEM_DIRS", ())
    monkeypatch.setenv("PATH", _tools_dir(tmp_path, "tc", "ss"))
    monkeypatch.setenv(REQUIRE_CLUSTER, required)
    monkeypatch.setenv("CI", "true")  # ignored
    expected = pytest.fail.Exception if required else pytest.skip.Exception
    with pytest.raises(expected) as outcome:
        cluster_conftest.require_cluster()
    assert ("ip not found" if os.geteuid() == 0 else "needs root") in str(outcome.value)
    if required:
        assert f"{REQUIRE_CLUSTER}=1" in str(outcome.value)


def test_ci_run_exports_the_switch_before_the_suite() -> None:
    """``.ci/run`` itself turns a skipped cluster test into a failure: the switch is exported before ``make test``."""
    script = (Path(__file__).resolve().parents[2] / ".ci" / "run").read_text()
    export = script.index(f"export {REQUIRE_CLUSTER}=")
    assert export < script.index("make test"), "export the switch before make test runs the suite"
    assert f"{REQUIRE_CLUSTER}=${{{REQUIRE_CLUSTER}:-1}}" in script  # on unless the machine opts out in the open
