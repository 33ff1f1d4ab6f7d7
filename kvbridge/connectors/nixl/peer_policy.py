"""Which prefill engines a decode node may connect to: the `allowed_peers` allow-list.

A decode request names the prefill engine's side-channel host in its kv_transfer_params, and
whoever can reach the decode node's HTTP API writes those params. Without a limit, any client
could make the node open connections (and NIXL agents) to any address. The allow-list holds
CIDR networks ("10.0.0.0/16", "127.0.0.1", "::1") and exact host names ("prefill-0.svc"); "*"
allows every host. The default allows loopback only: a multi-host deployment lists its prefill
nodes' addresses or network.

Host names are matched as written, never resolved here: the node's resolver must not decide
what an API client may reach.
"""

from __future__ import annotations

import ipaddress

from kvbridge.errors import ConfigError

DEFAULT_ALLOWED_PEERS = ("127.0.0.0/8", "::1")
ANY_PEER = "*"


class PeerPolicy:
    def __init__(self, allowed: tuple[str, ...] | list[str] = DEFAULT_ALLOWED_PEERS) -> None:
        self.allowed = tuple(allowed)
        self._any = ANY_PEER in self.allowed
        self._networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        self._names: set[str] = set()
        for entry in self.allowed:
            if not isinstance(entry, str) or not entry:
                raise ConfigError(f"NixlConnector option allowed_peers holds {entry!r}; expected CIDRs or host names")
            if entry == ANY_PEER:
                continue
            try:
                self._networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                if "/" in entry:
                    raise ConfigError(f"NixlConnector option allowed_peers: {entry!r} is not a valid network") from None
                self._names.add(entry.lower())

    def allows(self, host: str) -> bool:
        if self._any:
            return True
        try:
            address = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            return host.lower() in self._names
        return any(address in network for network in self._networks)
