"""Choosing the interface that holds a task's own cluster address, for gloo and NCCL."""

from __future__ import annotations

import logging
import os
import socket

import pytest

from ds_lightning.environments._interfaces import (
    SOCKET_IFNAME_VARIABLES,
    _ipv4_of,
    interface_holding,
    pin_socket_interfaces,
)


def _a_non_loopback_interface() -> tuple[str, str]:
    for _, name in socket.if_nameindex():
        address = _ipv4_of(name)
        if address is not None and not address.startswith("127."):
            return name, address
    pytest.skip("this host has no non-loopback IPv4 interface")


@pytest.fixture(autouse=True)
def _no_preset_interface(monkeypatch):
    for variable in SOCKET_IFNAME_VARIABLES:
        monkeypatch.delenv(variable, raising=False)


def test_the_interface_holding_an_address_is_found():
    assert interface_holding("127.0.0.1") == "lo"
    name, address = _a_non_loopback_interface()
    assert interface_holding(address) == name
    assert interface_holding("198.51.100.7") is None  # TEST-NET-2: on no interface here


def test_a_non_loopback_task_address_pins_gloo_and_nccl_to_its_interface():
    name, address = _a_non_loopback_interface()
    assert pin_socket_interfaces(address) == name
    assert [os.environ[v] for v in SOCKET_IFNAME_VARIABLES] == [name, name]


def test_loopback_leaves_the_defaults_alone():
    assert pin_socket_interfaces("127.0.0.1") is None
    assert not any(v in os.environ for v in SOCKET_IFNAME_VARIABLES)


def test_the_users_choice_wins(monkeypatch):
    _, address = _a_non_loopback_interface()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "mine0")
    assert pin_socket_interfaces(address) == "mine0"
    assert os.environ["GLOO_SOCKET_IFNAME"] == "mine0" and "NCCL_SOCKET_IFNAME" not in os.environ


def test_an_address_no_interface_holds_warns_with_the_fix(caplog):
    with caplog.at_level(logging.WARNING):
        assert pin_socket_interfaces("198.51.100.7") is None
    assert "Set GLOO_SOCKET_IFNAME" in caplog.text
    assert not any(v in os.environ for v in SOCKET_IFNAME_VARIABLES)
