"""What a node advertises to peers and which interface UCX may use (interfaces.py).

The same rules run across real interfaces in tests/serve/test_netns.py."""

from __future__ import annotations

import os

import pytest

from kvbridge.errors import ConfigError
from kvbridge.transfer import interfaces
from kvbridge.transfer.interfaces import advertised_host, interface_of, is_wildcard, ucx_on_interface_of


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "[::]"])
def test_wildcards(host):
    assert is_wildcard(host)


def test_a_concrete_bind_address_is_advertised():
    assert advertised_host("10.1.2.3", None) == "10.1.2.3"
    assert advertised_host("0.0.0.0", "10.1.2.3") == "10.1.2.3"  # --side-channel-host wins


def test_a_wildcard_bind_advertises_the_default_route_address(monkeypatch):
    monkeypatch.setattr(interfaces, "default_route_address", lambda: "10.20.30.40")
    assert advertised_host("0.0.0.0", None) == "10.20.30.40"


def test_a_wildcard_bind_without_a_route_is_refused_naming_the_flag(monkeypatch):
    monkeypatch.setattr(interfaces, "default_route_address", lambda: None)
    with pytest.raises(ConfigError, match="--side-channel-host"):
        advertised_host("0.0.0.0", None)


def test_a_wildcard_side_channel_host_is_refused():
    with pytest.raises(ConfigError, match="wildcard"):
        advertised_host("127.0.0.1", "0.0.0.0")


def test_loopback_addresses_belong_to_the_loopback_interface():
    assert interface_of("127.0.0.1") == interface_of("localhost") == "lo"
    assert interface_of("127.0.0.2") == "lo"


def test_addresses_no_interface_owns():
    assert interface_of("192.0.2.77") is None  # documentation-only: on no interface here
    assert interface_of("no-such-host.invalid") is None


def test_ucx_is_kept_on_the_served_interface_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    with ucx_on_interface_of("127.0.0.1"):
        assert os.environ["UCX_NET_DEVICES"] == "lo"
    assert "UCX_NET_DEVICES" not in os.environ  # only while the UCX context is created
    for host in ("0.0.0.0", "192.0.2.77"):  # a wildcard; an address no interface owns
        with ucx_on_interface_of(host):
            assert "UCX_NET_DEVICES" not in os.environ
    monkeypatch.setenv("UCX_NET_DEVICES", "mlx5_0:1")
    with ucx_on_interface_of("127.0.0.1"):
        assert os.environ["UCX_NET_DEVICES"] == "mlx5_0:1"
