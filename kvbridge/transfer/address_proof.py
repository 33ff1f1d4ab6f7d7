"""Side-channel addresses vouched for by a holder of the side-channel secret.

A decode request's kv_transfer_params name the prefill's side channel (host and port), and any
client of the decode node's HTTP API writes those params. `allowed_peers` bounds the hosts, not the
ports: with its default (loopback), a client could otherwise make the decode node open a TCP
connection, and send a handshake, to any local service (a database, an admin API, a port scan by
timing).

So the prefill engine that returns the params proves its own address: an HMAC-SHA256, with the
side-channel secret, over (engine id, incarnation, host, port, a term), in a domain of its own
(neither a side-channel frame nor a grant can stand for it). A decode node that has a secret
connects only to an address whose proof checks with that secret:

    prove_address(secret, address, expires_at) -> hex MAC   (prefill, in params["remote_address_mac"])
    check_address(secret, address, expires_at, mac, now)    (decode, before any connection)

The term is the lease's (`lease_s` from the grant): past it the lease is gone whatever the decode
reads, so an old proof cannot point the node at a port that another program took since. A proof
is accepted for `CLOCK_SKEW_S` more, the side channel's replay window, which bounds the skew of the
two hosts' clocks anyway. Without a secret (`--insecure-side-channel`) nothing can be proven and
`allowed_peers` is the only bound.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import NamedTuple

from kvbridge.errors import AuthenticationError

_DOMAIN = b"kvbridge-side-channel-v3/address\0"
# A decode's offer inbox (transfer/offers.py) is proven in a domain of its own: its proof never vouches
# for a side channel, nor a side channel's for an inbox.
INBOX_DOMAIN = b"kvbridge-side-channel-v3/inbox\0"
CLOCK_SKEW_S = 30.0  # as the side channel's replay window (transfer/auth.py)
MAC_HEX_CHARS = 64  # HMAC-SHA256, as hex


class SideChannelAddress(NamedTuple):
    """Which engine instance answers where."""

    engine_id: str
    incarnation: str
    host: str
    port: int


def prove_address(secret: bytes, address: SideChannelAddress, expires_at: float, domain: bytes = _DOMAIN) -> str:
    """The hex MAC that vouches for `address` until `expires_at` (wall-clock seconds)."""
    fields = [address.engine_id.encode(), address.incarnation.encode(), address.host.encode()]
    body = b"".join(struct.pack(">I", len(f)) + f for f in fields)  # lengths keep the boundaries unambiguous
    body += struct.pack(">Hd", address.port, expires_at)
    return hmac.new(secret, domain + body, hashlib.sha256).hexdigest()


def check_address(
    secret: bytes, address: SideChannelAddress, expires_at: float, mac: str, now_wall: float
) -> None:
    """Raise AuthenticationError unless `mac` vouches for `address` and its term has not ended."""
    if not mac:
        raise AuthenticationError(
            "the params carry no proof of the prefill's side-channel address (remote_address_mac): pass the "
            "kv_transfer_params that the prefill node returned, unchanged (an older prefill node, or one run "
            "with --insecure-side-channel, gives none)"
        )
    if not hmac.compare_digest(mac.encode("ascii", "replace"), prove_address(secret, address, expires_at).encode()):
        raise AuthenticationError(
            f"the prefill's side-channel address {address.host}:{address.port} is not vouched for with this "
            "node's side-channel secret (params altered, or the prefill node uses another secret: set the same "
            "KVBRIDGE_SIDE_CHANNEL_SECRET on both nodes); nothing was connected to"
        )
    if now_wall > expires_at + CLOCK_SKEW_S:
        raise AuthenticationError(
            f"the proof of the prefill's side-channel address ended {now_wall - expires_at:.1f} s ago (the "
            "lease's term); nothing was connected to"
        )
