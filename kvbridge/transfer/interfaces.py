"""Addresses and interfaces: what a node advertises to peers, and which interface carries its KV.

A prefill node tells decode nodes where to reach its side channel (`remote_host` in the
`kv_transfer_params` it returns). That must be an address a peer can connect to: a wildcard
bind address (`0.0.0.0`, `::`) is not one. `advertised_host` picks the address, and
`ucx_on_interface_of` keeps UCX on the interface that owns it, so a node serving on loopback or on
one private network does not also open its KV transfers to every other interface.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import Iterator

from kvbridge.errors import ConfigError

logger = logging.getLogger(__name__)

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's primary IPv4 address
# Documentation-only addresses (RFC 5737, RFC 3849): connecting a UDP socket to one sends nothing
# but makes the kernel choose the source address of the route a real packet would take.
_ROUTE_PROBES = ((socket.AF_INET, "192.0.2.1"), (socket.AF_INET6, "2001:db8::1"))


def is_wildcard(host: str) -> bool:
    return host in ("", "0.0.0.0", "::", "[::]")


def advertised_host(bind_host: str, side_channel_host: str | None) -> str:
    """The side-channel address this node binds and advertises to peers.

    `side_channel_host` when given (it must be a concrete address); else `bind_host` unless it is a
    wildcard; else the source address of this host's default route, logged, since a host with
    several networks may want another (raises ConfigError when there is no route to guess from).
    """
    if side_channel_host is not None:
        if is_wildcard(side_channel_host):
            raise ConfigError(
                f"--side-channel-host {side_channel_host} is a wildcard, but peers need an address they can "
                "reach: pass this node's address on the network its peers share"
            )
        return side_channel_host
    if not is_wildcard(bind_host):
        return bind_host
    address = default_route_address()
    if address is None:
        raise ConfigError(
            f"--host {bind_host} binds every interface, but peers need one address to reach this node's side "
            "channel and this host has no default route to guess it from: pass --side-channel-host ADDRESS"
        )
    logger.info("--host %s: advertising %s (the default route's address) to peers; "
                "pass --side-channel-host to choose another", bind_host, address)  # fmt: skip
    return address


def default_route_address() -> str | None:
    for family, probe in _ROUTE_PROBES:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as sock:
                sock.connect((probe, 9))
                return sock.getsockname()[0]
        except OSError:
            continue
    return None


def interface_of(host: str) -> str | None:
    """The name of the local interface that owns `host` (an address or a resolvable name), or None."""
    try:
        address = ipaddress.ip_address(socket.getaddrinfo(host, None)[0][4][0].split("%")[0])
    except (OSError, ValueError, IndexError):
        return None
    if address.is_loopback:
        return _loopback_interface()
    if address.version == 6:
        return _ipv6_interfaces().get(address)
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == address:
            return name
    return None


@contextlib.contextmanager
def ucx_on_interface_of(host: str) -> Iterator[None]:
    """Inside: UCX contexts created use only the network interface that owns `host`.

    Sets UCX_NET_DEVICES for the duration (UCX reads it when a context is created) unless the user
    set it, `host` is a wildcard, or no local interface owns it. Same-host memory transports
    (shared memory, CMA, CUDA IPC) are not network devices: they stay available. (NIXL's own UCX
    `device_list` parameter names InfiniBand-style ports, `dev:1`, which no TCP interface matches.)
    """
    device = None if "UCX_NET_DEVICES" in os.environ or is_wildcard(host) else interface_of(host)
    if device is None:
        yield
        return
    os.environ["UCX_NET_DEVICES"] = device
    try:
        yield
    finally:
        os.environ.pop("UCX_NET_DEVICES", None)


def _ipv4_of(name: str) -> ipaddress.IPv4Address | None:
    request = struct.pack("256s", name.encode()[:15])
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
    except OSError:  # no IPv4 address on this interface
        return None
    return ipaddress.IPv4Address(reply[20:24])


def _ipv6_interfaces() -> dict[ipaddress.IPv6Address, str]:
    try:
        with open("/proc/net/if_inet6") as f:
            rows = [line.split() for line in f]
    except OSError:
        return {}
    return {ipaddress.IPv6Address(int(row[0], 16)): row[5] for row in rows if len(row) == 6}


def _loopback_interface() -> str | None:
    loopback = ipaddress.IPv4Address("127.0.0.1")
    return next((name for _, name in socket.if_nameindex() if _ipv4_of(name) == loopback), None)
