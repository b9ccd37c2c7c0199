"""Rank 0's rendezvous store listens on the main address only, not on every interface as torch's env:// store does."""

from __future__ import annotations

import logging
import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from ds_lightning.environments.rendezvous import ALL_INTERFACES_VARIABLE, bound_listener, rendezvous_store
from tests.helpers.runner import free_port


def _accepts(address: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(2)
        try:
            sock.connect((address, port))
        except OSError:
            return False
        return True


def test_the_store_listens_on_the_main_address_only():
    port = free_port()
    store = rendezvous_store("127.0.0.1", port, 0, 1, timedelta(seconds=10), spans_hosts=False)
    store.set("key", "value")
    client = dist.TCPStore("127.0.0.1", port, 1, is_master=False, timeout=timedelta(seconds=10))
    assert client.get("key") == b"value"
    # 127.0.0.2 is this machine too: a store on all interfaces would accept there.
    assert not _accepts("127.0.0.2", port)
    # Negative control: torch's own master store does accept there.
    other = free_port()
    _torch_store = dist.TCPStore("127.0.0.1", other, 1, is_master=True, timeout=timedelta(seconds=10))
    assert _accepts("127.0.0.2", other)


def test_a_taken_port_names_master_port():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(dist.DistNetworkError, match=rf"127\.0\.0\.1:{port}.*choose a free MASTER_PORT"):
            bound_listener("127.0.0.1", port, spans_hosts=False)


def test_an_address_this_machine_lacks_falls_back_to_all_interfaces_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        assert bound_listener("198.51.100.7", free_port(), spans_hosts=True) is None  # TEST-NET-2
    assert "198.51.100.7" in caplog.text and "not an address of rank 0's machine" in caplog.text


def test_loopback_is_refused_only_when_the_run_spans_hosts(caplog):
    port = free_port()
    listener = bound_listener("127.0.0.1", port, spans_hosts=False)
    assert listener is not None
    with listener:
        assert listener.getsockname() == ("127.0.0.1", port)
    with caplog.at_level(logging.WARNING):
        assert bound_listener("127.0.0.1", free_port(), spans_hosts=True) is None
    assert "loopback" in caplog.text and "MASTER_ADDR" in caplog.text


def test_an_unresolvable_main_address_leaves_the_store_on_all_interfaces_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        assert bound_listener("no-such-host.invalid", free_port(), spans_hosts=False) is None
    assert "MASTER_ADDR='no-such-host.invalid' does not resolve" in caplog.text
    assert "listens on all interfaces" in caplog.text


def test_the_opt_out_keeps_torchs_behaviour(monkeypatch, caplog):
    monkeypatch.setenv(ALL_INTERFACES_VARIABLE, "1")
    port = free_port()
    with caplog.at_level(logging.WARNING):
        store = rendezvous_store("127.0.0.1", port, 0, 1, timedelta(seconds=10), spans_hosts=False)
    store.set("key", "value")
    assert _accepts("127.0.0.2", port)  # on every interface, as asked; nothing to warn about
    assert caplog.text == ""
