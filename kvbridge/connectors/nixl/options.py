"""NixlConnector options, read from `KVTransferConfig.extra` and validated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvbridge.connectors.nixl.peer_policy import DEFAULT_ALLOWED_PEERS, PeerPolicy
from kvbridge.connectors.options import options_from_extra
from kvbridge.errors import ConfigError
from kvbridge.transfer.options import TransferOptions


@dataclass(frozen=True)
class NixlOptions(TransferOptions):
    """The endpoint's `TransferOptions` (timeouts, backend, descriptor mode, CUDA IPC) plus the P/D ones."""

    lease_s: float = 30.0  # prefill holds blocks this long without a renewal from the reader
    # Prefill engines a decode node may connect to (CIDRs, host names, "*"); see peer_policy.py.
    allowed_peers: tuple[str, ...] = DEFAULT_ALLOWED_PEERS
    max_peers: int = 64  # prefill engines a decode node talks to at once; more are refused
    peer_idle_s: float = 300.0  # a peer with no transfer for this long is forgotten (sockets, NIXL agent)
    # Prefill: digest leased blocks when granting; decode: use a read only if its bytes match that
    # digest (transfer/digest.py). Off on either side means reads are not verified.
    verify_kv_digest: bool = True
    # Prefill: with verify_kv_digest, also digest each KV head of the leased blocks (when the pages
    # hold several), which a decode rank holding only some of them needs (a decode of a larger TP size
    # than this node's, e.g. TP 1 -> 2). On by default (transfer/head_digests.py): wsum64, a GPU's
    # digest, splits its one pass by head; xxh3-64, host memory's, hashes the heads again (about 5x
    # the blocks' cost). Off, such readers refuse the read (a recompute, named in their log).
    digest_kv_heads: bool = True
    # Prefill: grant a lease as its request finishes, where the worker half shares the scheduler's
    # process, and return it signed in the params (transfer/grants.py): decode nodes then verify what
    # they read without a round trip to this node. Off: readers confirm every read on the side channel.
    sign_grants: bool = True
    # Decode: a prefill side channel that did not answer (a failed handshake) is not read from for this
    # long: requests naming it are computed here from the start, with no load error for
    # kv_load_failure_policy to turn into a failed request. 0: every request tries again.
    unreachable_peer_cooldown_s: float = 10.0
    # Decode: a read from a same-host GPU peer whose params carry its signed grant loads in the step that
    # schedules the request (vLLM's synchronous load), not in a later one: the CUDA IPC copy and its digest
    # are queued before that step's forward pass, which waits for them on the device, and the digest is
    # compared as the step ends; a mismatch is a load error, and vLLM drops that step's token and
    # recomputes. Reads that cannot go that way (a first read from a peer, NIXL, tensor parallelism) load
    # asynchronously as before.
    sync_ipc_reads: bool = False
    # Decode: in a step where the engine runs no model and polls its connectors again only after it (vLLM
    # sleeps ~1 ms after such a step, then runs another), wait up to this long for a read in flight to end,
    # so that its request computes in the next step instead of some polls later: a same-host read and its
    # verification take well under this. Likewise the schedule after such a step waits up to this long, once,
    # for the offer of a request sent at once (handoff_inbox), taking it as it lands. Nothing runs meanwhile;
    # a request arriving in it waits at most this long. 0: never wait. The reference engine runs no such
    # steps (its connectors wake it).
    idle_step_wait_s: float = 0.003
    # Decode: bind an inbox (on side_channel_host; handoff_inbox_port, 0 picks a free one) where prefill
    # nodes offer a request's kv_transfer_params as it finishes, for clients that send both legs at once
    # (transfer/offers.py). A request sent with a handoff_key waits for its offer at most handoff_wait_s,
    # then is computed here.
    handoff_inbox: bool = False
    handoff_inbox_port: int = 0
    handoff_wait_s: float = 30.0

    def __post_init__(self) -> None:
        super().__post_init__()
        peers = self.allowed_peers
        object.__setattr__(self, "allowed_peers", (peers,) if isinstance(peers, str) else tuple(peers))
        PeerPolicy(self.allowed_peers)  # raises ConfigError on a malformed entry
        if self.max_peers < 1:
            raise ConfigError(f"NixlConnector option max_peers must be >= 1, got {self.max_peers}")
        if not 0 <= self.unreachable_peer_cooldown_s < 1e6:
            raise ConfigError(
                f"NixlConnector option unreachable_peer_cooldown_s must be in [0, 1e6), got {self.unreachable_peer_cooldown_s}"
            )
        if not 0 <= self.handoff_inbox_port < 65536:
            raise ConfigError(f"NixlConnector option handoff_inbox_port must be a port or 0, got {self.handoff_inbox_port}")
        if not 0 <= self.idle_step_wait_s <= 1:
            raise ConfigError(f"NixlConnector option idle_step_wait_s must be in [0, 1] seconds, got {self.idle_step_wait_s}")
        for name in ("lease_s", "peer_idle_s", "handoff_wait_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"NixlConnector option {name} must be positive, got {getattr(self, name)}")

    @property
    def _owner(self) -> str:
        return "NixlConnector"

    @property
    def peer_policy(self) -> PeerPolicy:
        return PeerPolicy(self.allowed_peers)

    @property
    def renew_interval_s(self) -> float:
        return self.lease_s / 3

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> NixlOptions:
        return options_from_extra(cls, extra, "NixlConnector")
