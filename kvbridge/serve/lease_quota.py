"""Lease quotas: how much of a prefill node's KV cache `do_remote_decode` requests may hold.

A request with `do_remote_decode` keeps its prompt's blocks after it finishes, under a lease, until
a decode node reads them or the lease expires (`lease_s`, 30 s by default). Unbounded, any HTTP
client pins the node's memory: 300 such requests that are never read fill a 512-block cache within
a second, and from then on every request queues behind the expiring leases. So the node admits a
`do_remote_decode` request only while

* its client (the HTTP peer's address) has fewer than `max_per_client` of them live (running, or
  finished with its blocks held), and
* the blocks that leases hold, with its own, are at most `max_leased_fraction` of the cache: unread
  leases never stop the node from serving others, and a P/D request never waits for leases to end
  (tens of seconds) for its blocks, where a router would rather send it elsewhere at once. Running
  requests are not counted: they end soon and free theirs.

Anything else is refused at once with HTTP 429 (and `Retry-After`), counted by scope in
`kvbridge_pd_admissions_refused_total`. A request is counted from its admission until the engine
no longer holds it (`Occupancy.live_req_ids`, which the engine thread publishes after each step), so
leases that were read, released or expired free their quota without a message.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

from kvbridge.errors import ConfigError

DEFAULT_MAX_PER_CLIENT = 256
DEFAULT_MAX_LEASED_FRACTION = 0.5


class Occupancy(NamedTuple):
    """The engine's blocks as its thread last saw them (serve/async_engine.py publishes one per step)."""

    taken_at: float  # time.monotonic() when it was taken
    num_blocks: int
    num_free_blocks: int  # what allocation can hand out now, evictable prefix-cache blocks included
    num_held_blocks: int  # blocks of finished requests that a transfer holds (leases, mostly)
    live_req_ids: frozenset[str]  # requests running, waiting, or finished with blocks a transfer holds


class Refusal(NamedTuple):
    scope: str  # "client" or "total"
    message: str


@dataclass
class _Admitted:
    client: str
    num_blocks: int
    started_at: float | None = None  # when its first output came back: the engine surely held it then


@dataclass
class LeaseQuota:
    max_per_client: int = DEFAULT_MAX_PER_CLIENT
    max_leased_fraction: float = DEFAULT_MAX_LEASED_FRACTION
    _admitted: dict[str, _Admitted] = field(default_factory=dict)  # engine request id -> whose, how big

    def __post_init__(self) -> None:
        if self.max_per_client < 1:
            raise ConfigError(f"--max-leases-per-client must be at least 1, got {self.max_per_client}")
        if not 0 < self.max_leased_fraction <= 1:
            raise ConfigError(f"--max-leased-fraction must be in (0, 1], got {self.max_leased_fraction:g}")

    def admit(self, client: str, req_ids: list[str], num_blocks: int, occupancy: Occupancy) -> Refusal | None:
        """Admit the choices `req_ids` of one `do_remote_decode` request of `client`, each needing
        `num_blocks` blocks, or say why not. Called on the event loop, before the engine sees them."""
        self._forget_ended(occupancy)
        mine = sum(1 for a in self._admitted.values() if a.client == client)
        if mine + len(req_ids) > self.max_per_client:
            return Refusal("client", (
                f"this client already has {mine} do_remote_decode request(s) holding KV blocks on this prefill node "
                f"(at most {self.max_per_client}): read or release their leases (or let them expire) first"
            ))  # fmt: skip
        held, wanted = occupancy.num_held_blocks, num_blocks * len(req_ids)
        limit = int(self.max_leased_fraction * occupancy.num_blocks)
        if held + wanted > limit:
            return Refusal("total", (
                f"leases hold {held} of this prefill node's {occupancy.num_blocks} KV blocks; {wanted} more would "
                f"pass its limit of {limit}: try another prefill node, or later"
            ))  # fmt: skip
        for req_id in req_ids:
            self._admitted[req_id] = _Admitted(client, num_blocks)
        return None

    def mark_started(self, req_ids: list[str]) -> None:
        """The engine answered these requests: from now on a snapshot without them means they ended."""
        now = time.monotonic()
        for req_id in req_ids:
            if (admitted := self._admitted.get(req_id)) is not None and admitted.started_at is None:
                admitted.started_at = now

    def forget(self, req_ids: list[str]) -> None:
        """Requests the engine never started (refused, or failed before their first output)."""
        for req_id in req_ids:
            if (admitted := self._admitted.get(req_id)) is not None and admitted.started_at is None:
                del self._admitted[req_id]

    @property
    def num_admitted(self) -> int:
        return len(self._admitted)

    def _forget_ended(self, occupancy: Occupancy) -> None:
        # Only a request the engine had started before the snapshot was taken is missing from it because it ended.
        ended = [
            r for r, a in self._admitted.items()
            if a.started_at is not None and a.started_at < occupancy.taken_at and r not in occupancy.live_req_ids
        ]  # fmt: skip
        for req_id in ended:
            del self._admitted[req_id]
