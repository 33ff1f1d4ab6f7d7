"""NixlConnector options, read from `KVTransferConfig.extra` and validated."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvbridge.connectors.nixl.peer_policy import DEFAULT_ALLOWED_PEERS, PeerPolicy
from kvbridge.connectors.options import options_from_extra
from kvbridge.errors import ConfigError


@dataclass(frozen=True)
class NixlOptions:
    lease_s: float = 30.0  # prefill holds blocks this long without a renewal from the reader
    handshake_timeout_s: float = 5.0  # per attempt
    handshake_retries: int = 2
    transfer_timeout_s: float = 30.0  # handshake + read of one request, end to end
    backend: str | None = None  # NIXL backend plugin; None: KVBRIDGE_NIXL_BACKEND, else UCX
    backend_params: dict[str, str] = field(default_factory=dict)  # the plugin's parameters (UCX: num_workers)
    descriptor_mode: str = "blocks"  # see kvbridge/transfer/endpoint.py
    cuda_ipc: bool = True  # GPU peers on one host copy each other's KV through CUDA IPC mappings, not NIXL
    ipc_min_runs: int = 16  # ...for transfers of at least this many runs of blocks (fewer: NIXL is as fast)
    # Prefill engines a decode node may connect to (CIDRs, host names, "*"); see peer_policy.py.
    allowed_peers: tuple[str, ...] = DEFAULT_ALLOWED_PEERS
    max_peers: int = 64  # prefill engines a decode node talks to at once; more are refused
    peer_idle_s: float = 300.0  # a peer with no transfer for this long is forgotten (sockets, NIXL agent)

    def __post_init__(self) -> None:
        peers = self.allowed_peers
        object.__setattr__(self, "allowed_peers", (peers,) if isinstance(peers, str) else tuple(peers))
        PeerPolicy(self.allowed_peers)  # raises ConfigError on a malformed entry
        if self.max_peers < 1:
            raise ConfigError(f"NixlConnector option max_peers must be >= 1, got {self.max_peers}")
        for name in ("lease_s", "handshake_timeout_s", "transfer_timeout_s", "peer_idle_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"NixlConnector option {name} must be positive, got {getattr(self, name)}")
        if self.handshake_retries < 0:
            raise ConfigError(f"NixlConnector option handshake_retries must be >= 0, got {self.handshake_retries}")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.backend_params.items()):
            raise ConfigError("NixlConnector option backend_params must map strings to strings, e.g. {'num_workers': '4'}")
        if self.ipc_min_runs < 1:
            raise ConfigError(f"NixlConnector option ipc_min_runs must be >= 1, got {self.ipc_min_runs}")
        if self.descriptor_mode not in ("blocks", "ranges"):
            raise ConfigError(f"NixlConnector option descriptor_mode={self.descriptor_mode!r}; expected 'blocks' or 'ranges'")

    @property
    def peer_policy(self) -> PeerPolicy:
        return PeerPolicy(self.allowed_peers)

    @property
    def renew_interval_s(self) -> float:
        return self.lease_s / 3

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> NixlOptions:
        return options_from_extra(cls, extra, "NixlConnector")
