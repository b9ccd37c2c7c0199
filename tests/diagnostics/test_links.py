"""The link counters (the kernel's TCP counters of real sockets) and the slow-link rule (pure)."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from ds_lightning.diagnostics.link_counters import LinkCounter, read_tcp_counters, tcp_connections
from ds_lightning.diagnostics.link_verdict import LinkUse, RankLinks, find_slow_link


@pytest.fixture
def connected():
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    yield server, client, accepted
    for sock in (client, accepted, server):
        sock.close()


def _send(sender: socket.socket, receiver: socket.socket, size: int) -> None:
    def read_all() -> None:
        left = size
        while left:
            left -= len(receiver.recv(left))

    reader = threading.Thread(target=read_all)
    reader.start()
    sender.sendall(b"x" * size)
    reader.join(timeout=30)


def test_the_counters_are_the_kernels_bytes_and_leave_the_socket_open(connected):
    _, client, accepted = connected
    before = read_tcp_counters(client.fileno())
    assert before is not None
    _send(client, accepted, 3_000_000)
    _send(accepted, client, 1_000_000)
    after = read_tcp_counters(client.fileno())
    assert after is not None
    assert after.bytes_sent - before.bytes_sent == 3_000_000
    assert after.bytes_received - before.bytes_received == 1_000_000
    os.fstat(client.fileno())  # still open: reading never closes the owner's descriptor
    client.sendall(b"ok")
    assert accepted.recv(2) == b"ok"


def test_a_listening_socket_or_a_file_has_no_counters(connected, tmp_path):
    server, _, _ = connected
    assert read_tcp_counters(server.fileno()) is None
    with open(tmp_path / "f", "w") as handle:
        assert read_tcp_counters(handle.fileno()) is None


def test_without_tcp_info_there_are_no_counters_and_no_connections(connected, monkeypatch):
    from ds_lightning.diagnostics import link_counters

    _, client, _ = connected
    monkeypatch.setattr(link_counters, "_TCP_INFO", None)  # as on macOS or Windows
    assert read_tcp_counters(client.fileno()) is None and tcp_connections() == []


def test_connections_on_an_excluded_port_are_left_out(connected):
    server, client, accepted = connected
    port = server.getsockname()[1]
    found = {c.fd for c in tcp_connections()}
    assert {client.fileno(), accepted.fileno()} <= found
    assert not {client.fileno(), accepted.fileno()} & {c.fd for c in tcp_connections([port])}


def test_the_counter_adds_per_remote_and_per_step(connected):
    _, client, accepted = connected
    counter = LinkCounter()
    counter.start()
    assert counter.available and counter.host_address() == "127.0.0.1"
    _send(client, accepted, 2_000_000)
    counter.sample(5)
    _send(client, accepted, 1_000_000)
    counter.sample(None)
    link = counter.links["127.0.0.1"]
    # Both ends are this process: what one sends the other receives.
    assert link.bytes_sent == link.bytes_received == 3_000_000
    assert set(link.step_busy_us) == {5}
    counter.stop()
    assert not counter.available


def _use(sent: int, busy_ms: float, steps: dict[int, float] | None = None) -> LinkUse:
    per_step = {s: int(ms * 1e3) for s, ms in (steps or {}).items()}
    return LinkUse(sent, sent, int(busy_ms * 1e3), per_step)


def _ring(slow: dict[tuple[int, int], float]) -> list[RankLinks]:
    """Three ranks on three hosts, each sending 20 MB to the next; ``slow`` scales a transfer's busy time."""
    hosts = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    ranks = []
    for r in range(3):
        nxt = (r + 1) % 3
        factor = slow.get((r, nxt), 1.0)
        busy = 200 * factor  # 100 MB/s unslowed
        links = {hosts[nxt]: _use(20_000_000, busy, {s: busy / 10 for s in range(10)})}
        ranks.append(RankLinks(r, hosts[r], links))
    return ranks


def test_the_host_every_transfer_of_which_is_slow_is_named():
    # Host 3's link at a tenth: the transfers into it (2 -> 3) and out of it (3 -> 1) both crawl.
    found = find_slow_link(_ring({(1, 2): 10.0, (2, 0): 10.0}), step_ms=250.0)
    assert found.slow_host == "10.0.0.3", found
    slow, fast = found.host("10.0.0.3"), found.host("10.0.0.1")
    assert slow.rate_mb_s == pytest.approx(10.0) and fast.rate_mb_s == pytest.approx(100.0)
    assert slow.link_ms == pytest.approx(200.0)  # the longest busy transfer over it, each step
    assert "ranks [2]" in found.reason and "80%" in found.reason


def test_equal_links_name_no_host():
    found = find_slow_link(_ring({}), step_ms=50.0)
    assert found.slow_host is None and "none is under half" in found.reason


def test_two_hosts_cannot_place_the_slow_link():
    hosts = ["10.0.0.1", "10.0.0.2"]
    ranks = [RankLinks(r, hosts[r], {hosts[1 - r]: _use(20_000_000, 2000 if r else 200)}) for r in range(2)]
    found = find_slow_link(ranks, step_ms=50.0)
    assert found.slow_host is None and "two hosts" in found.reason


def test_small_transfers_give_no_rate_and_one_host_has_no_links():
    hosts = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    tiny = [RankLinks(r, hosts[r], {hosts[(r + 1) % 3]: _use(1000, 1)}) for r in range(3)]
    assert "too small" in find_slow_link(tiny, 5.0).reason
    alone = [RankLinks(r, "127.0.0.1", {"127.0.0.1": _use(20_000_000, 10)}) for r in range(2)]
    assert "one host" in find_slow_link(alone, 5.0).reason
