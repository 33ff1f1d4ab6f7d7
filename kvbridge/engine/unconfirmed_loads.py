"""Requests computing on loaded KV that is not vouched for yet, and what that computed, held back.

A connector names an async load in `KVConnectorOutput.landed_recving` once its bytes are in their
blocks, before it vouches for them (the NixlConnector: before the prefill confirmed that its lease
held through the read and the read's digests matched). The request's first step may then run on
those bytes while the confirmation travels; everything that step yields stays here:

    parked --landed--> UNCONFIRMED --its step sampled--> HELD (the token lives here, not in the request)
    UNCONFIRMED | HELD --finished_recving, no load error--> released: the held token is the request's first
    UNCONFIRMED | HELD --a load error on its blocks-------> discarded: the request recomputes (or fails)
    UNCONFIRMED | HELD --the request ends (abort)---------> discarded

Meanwhile the request stays parked in the transfer bookkeeping (WAITING_FOR_REMOTE_KVS) and sits in
neither the running nor the waiting queue: it is never preempted, its blocks are freed only when its
load ends, none of its blocks past its local prefix hit is hashed into the prefix cache (so no other
request can be served them), and nothing it sampled reaches its output. One early step per load: a
step whose result cannot be held (a sampling error) is dropped, and the request computes again once
confirmed.

Pure bookkeeping (no torch), on the engine thread; the `Scheduler` owns one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from kvbridge.engine.outputs import TokenLogprobs
    from kvbridge.engine.request import Request


class HeldToken(NamedTuple):
    """A token sampled on unconfirmed KV: the request's only once its load is confirmed."""

    token_id: int
    logprobs: TokenLogprobs | None


class UnconfirmedLoads:
    def __init__(self) -> None:
        self._requests: dict[str, Request] = {}  # request id -> request, in landing order
        self._scheduled: set[str] = set()  # its one early step was scheduled
        self._held: dict[str, HeldToken] = {}
        self.num_early_steps = 0  # early steps scheduled
        self.num_used = 0  # early steps whose token became the request's (its load was confirmed)
        self.num_discarded = 0  # early steps whose result was dropped (load error, or the request ended first)

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def requests(self) -> list[Request]:
        return list(self._requests.values())

    def add(self, request: Request) -> None:
        """Its load landed, unconfirmed: its first step may be scheduled."""
        self._requests[request.request_id] = request

    def to_schedule(self) -> list[Request]:
        """Requests whose early step has not been scheduled yet, in landing order."""
        return [r for rid, r in self._requests.items() if rid not in self._scheduled]

    def mark_scheduled(self, request_id: str) -> None:
        self._scheduled.add(request_id)
        self.num_early_steps += 1

    def hold(self, request_id: str, token: HeldToken) -> None:
        self._held[request_id] = token

    def release(self, request_id: str) -> HeldToken | None:
        """Its load was confirmed: forget it; its held token (None: none was sampled) is the caller's."""
        self._forget(request_id)
        token = self._held.pop(request_id, None)
        self.num_used += token is not None
        return token

    def discard(self, request_id: str) -> None:
        """Its load failed or the request ended: forget it and drop whatever it computed."""
        self.num_discarded += request_id in self._scheduled
        self._forget(request_id)
        self._held.pop(request_id, None)

    def _forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._scheduled.discard(request_id)

    def get_stats(self) -> dict[str, int]:
        return {
            "num_unconfirmed_loads": len(self._requests),
            "num_early_steps": self.num_early_steps,
            "num_early_steps_used": self.num_used,
            "num_early_steps_discarded": self.num_discarded,
        }

    def check_integrity(self) -> None:
        if not set(self._held) <= self._scheduled <= set(self._requests):
            raise AssertionError("UnconfirmedLoads integrity: a held token or early step of a request no longer unconfirmed")
