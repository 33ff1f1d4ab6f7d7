"""Decode side: the side-channel conversation with each prefill engine (releases and renewals).

After a read, the decode worker must hear the prefill engine say "released" for the read's lease
before it may use the blocks: only then were they held, unchanged, from before the read to after
it. `PeerControls` batches those confirmations (`TransferDone`) and the renewals of leases still
being read (`LeaseRenew`) per prefill engine, runs them on a small shared thread pool so the engine
step never waits on the network, and turns the answers into one verdict per request:

    confirm(...) --TransferDone--> "released" ------------------------> CONFIRMED
                                   "pending" (lease not granted yet) --> asked again, for PENDING_GRACE_S
                                   "unknown", error, deadline ---------> REFUSED (a load error)

Per-peer state is bounded: at most `max_peers` side-channel addresses at once (every incarnation
and engine id that params name at one address counts once). `admits` makes room for a new address
by dropping the least recently active peer with nothing in flight, and says no only when every peer
is busy; a peer with nothing in flight for `idle_s` is dropped (`drop_idle`). Requests naming many
made-up peers can therefore neither grow threads or sockets nor lock real prefill engines out.

Engine thread only, except the pool's jobs, which only call `send`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

from kvbridge.connectors.nixl.metadata import RemoteEngine
from kvbridge.transfer import messages as m
from kvbridge.transfer.progress import Backoff

NUM_THREADS = 4  # confirmations and renewals in flight at once, over all peers
# Releases of failed or release-only reads go to any address a request named, reachable or not: on
# a pool of their own, at most MAX_COURTESY queued, so they never delay a confirmation.
NUM_COURTESY_THREADS = 2
MAX_COURTESY = 64
# A "pending" lease is usually granted at the prefill's next step, a millisecond or two away when
# the prefill is idle, a step's length when it computes: ask again soon, then less and less often.
RETRY_PENDING_FIRST_S, RETRY_PENDING_MAX_S = 1e-3, 20e-3
# A lease is granted at the prefill engine's next step after the request finished there, so a real
# one is "pending" for a step at most. An id the prefill never handed out is "pending" forever (the
# prefill cannot tell it from one it is about to grant): give up on it after this long.
PENDING_GRACE_S = 5.0


class Verdict(enum.Enum):
    CONFIRMED = enum.auto()  # the lease held through the read: the blocks are this prompt's
    REFUSED = enum.auto()  # not vouched for: a load error


class Outcome(NamedTuple):
    req_id: str  # local request id
    verdict: Verdict
    reason: str
    digest: m.KVDigest | None = None  # CONFIRMED: the owner's digest of the leased blocks, if it sent one


class Reading(NamedTuple):
    """A lease whose read is in flight (its handshake included): renewed while the read lasts."""

    lease: m.LeaseRef
    since: float  # when the read was admitted: the first renewal is due `interval_s` after it
    interval_s: float  # a third of the prefill's lease term (params.lease_s); inf: not given
    answered: bool = True  # the peer answered a handshake; False: renew on the best-effort pool


@dataclass
class _Confirm:
    lease: m.LeaseRef
    deadline: float
    pending_since: float | None = None  # first "pending" answer


@dataclass
class _Peer:
    remote: RemoteEngine
    last_active: float
    to_confirm: dict[str, _Confirm] = field(default_factory=dict)  # local req id -> what to confirm
    to_abandon: list[m.LeaseRef] = field(default_factory=list)  # failed reads: release as a courtesy
    in_flight: tuple[Future, dict[str, _Confirm]] | None = None
    renewing: Future | None = None
    last_renew: float = 0.0
    retry_at: float = 0.0
    pending_backoff: Backoff = field(default_factory=lambda: Backoff(RETRY_PENDING_FIRST_S, RETRY_PENDING_MAX_S))

    @property
    def is_busy(self) -> bool:
        """Owes a verdict: a confirmation queued or in flight. Releases of failed reads and renewals
        are best-effort (the lease expires anyway): a peer with only those may be dropped."""
        return bool(self.to_confirm or (self.in_flight is not None and self.in_flight[1]))


Send = Callable[[RemoteEngine, m.Message], m.Message]


class PeerControls:
    def __init__(
        self, send: Send, engine_id: str, *, max_peers: int, idle_s: float, renew_interval_s: float,
        clock: Callable[[], float], wake: Callable[[], object] = lambda: None, reader_rank: int = 0, num_readers: int = 1,
    ) -> None:  # fmt: skip
        self._send = send
        # a tensor-parallel decode node: each rank confirms its own read; the owner counts them
        self._reader_rank, self._num_readers = reader_rank, num_readers
        self._wake = wake  # rung when a confirmation's answer is in: the engine need not wait for its next poll
        self._engine_id = engine_id
        self._max_peers, self._idle_s, self._renew_interval_s = max_peers, idle_s, renew_interval_s
        self._clock = clock
        self._pool = ThreadPoolExecutor(max_workers=NUM_THREADS, thread_name_prefix="kvbridge-nixl-ctl")
        self._courtesy_pool = ThreadPoolExecutor(NUM_COURTESY_THREADS, thread_name_prefix="kvbridge-nixl-release")
        self._courtesy: set[Future] = set()  # best-effort releases not finished yet
        self.num_courtesy_dropped = 0
        self._peers: dict[RemoteEngine, _Peer] = {}

    def __len__(self) -> int:
        return len(self._peers)

    def addresses(self) -> set[str]:
        return {remote.address for remote in self._peers}

    def admits(self, remote: RemoteEngine, busy: set[RemoteEngine]) -> bool:
        """Whether `remote` may be talked to, making room if its address is new and the table full.

        `busy` are the peers with reads in flight (the caller's); they are never dropped.
        """
        addresses = self.addresses()
        if remote.address in addresses or len(addresses) < self._max_peers:
            return True
        idle = [p for r, p in self._peers.items() if r not in busy and not p.is_busy]
        if not idle:
            return False
        oldest = min(idle, key=lambda p: p.last_active)
        for r in [r for r in self._peers if r.address == oldest.remote.address]:
            if r not in busy and not self._peers[r].is_busy:
                del self._peers[r]
        return len(self.addresses()) < self._max_peers

    def _peer(self, remote: RemoteEngine) -> _Peer:
        peer = self._peers.get(remote)
        if peer is None:
            peer = self._peers[remote] = _Peer(remote, self._clock())
        return peer

    def confirm(self, remote: RemoteEngine, req_id: str, lease: m.LeaseRef, deadline: float) -> None:
        """The read of `req_id` finished: ask the prefill engine to release its lease and vouch for it."""
        self._peer(remote).to_confirm[req_id] = _Confirm(lease, deadline)

    def abandon(self, remote: RemoteEngine, lease: m.LeaseRef) -> None:
        """The read failed: release the lease so the prefill frees its blocks now. No verdict follows."""
        self._peer(remote).to_abandon.append(lease)

    def release(self, remote: RemoteEngine, lease: m.LeaseRef) -> None:
        """The read was verified here against the prefill's signed grant: release the lease so the
        prefill frees its blocks now. Best effort, as an abandon (the lease's term ends it anyway);
        no verdict follows, and nothing waits for one."""
        self.abandon(remote, lease)

    def progress(self, reading: dict[RemoteEngine, list[Reading]]) -> list[Outcome]:
        """Collect answers, send what is due; `reading` are the leases of reads in flight (renewed)."""
        now = self._clock()
        outcomes: list[Outcome] = []
        for remote in set(self._peers) | set(reading):
            peer = self._peer(remote)
            outcomes += self._collect(peer, now)
            self._send_release(peer, now)
            self._renew(peer, reading.get(remote, []), now)
        return outcomes

    def drop_idle(self, busy: set[RemoteEngine]) -> list[RemoteEngine]:
        """Forget peers with nothing in flight for idle_s; return them."""
        now = self._clock()
        idle = [
            r for r, p in self._peers.items() if r not in busy and not p.is_busy and now - p.last_active >= self._idle_s
        ]
        for remote in idle:
            del self._peers[remote]
        return idle

    def _collect(self, peer: _Peer, now: float) -> list[Outcome]:
        if peer.renewing is not None and peer.renewing.done():
            peer.renewing = None  # a renewal's answer changes nothing here: the release decides
        if peer.in_flight is None or not peer.in_flight[0].done():
            return []
        future, sent = peer.in_flight
        peer.in_flight = None
        try:
            reply = future.result()
        except Exception as e:  # the prefill engine is gone or refuses: nothing is vouched for
            reply, error = m.TransferDoneReply(), f"{type(e).__name__}: {e}"
        else:
            error = None if isinstance(reply, m.TransferDoneReply) else f"answered {type(reply).__name__}"
        released, pending = (set(reply.released), set(reply.pending)) if error is None else (set(), set())
        outcomes = []
        retried = False
        for req_id, item in sent.items():
            remote_id = item.lease.req_id
            if remote_id in released:
                outcomes.append(Outcome(req_id, Verdict.CONFIRMED, "", reply.digests.get(remote_id)))
            elif remote_id in pending and self._may_wait(item, now):
                peer.to_confirm.setdefault(req_id, item)  # not granted yet: ask again shortly
                retried = True
            else:
                reason = error or (
                    "its lease was never granted (an id the prefill did not hand out?)" if remote_id in pending
                    else "no lease matches (expired, released, made up, or granted by another instance)"
                )  # fmt: skip
                outcomes.append(Outcome(req_id, Verdict.REFUSED, f"the prefill engine did not confirm the read: {reason}"))
        if retried:
            peer.retry_at = now + peer.pending_backoff.next_s()
        else:
            peer.pending_backoff.reset()
        return outcomes

    @staticmethod
    def _may_wait(item: _Confirm, now: float) -> bool:
        if item.pending_since is None:
            item.pending_since = now
        return now < min(item.deadline, item.pending_since + PENDING_GRACE_S)

    def _send_release(self, peer: _Peer, now: float) -> None:
        if peer.in_flight is not None or now < peer.retry_at or not (peer.to_confirm or peer.to_abandon):
            return
        # Answers name remote request ids: one lease per id and batch, so a forged lease that reuses
        # a real one's id can never share in the real one's "released".
        sent: dict[str, _Confirm] = {}
        remote_ids: set[str] = set()
        for req_id, item in list(peer.to_confirm.items()):
            if item.lease.req_id not in remote_ids:
                remote_ids.add(item.lease.req_id)
                sent[req_id] = peer.to_confirm.pop(req_id)
        abandoned = [lease for lease in peer.to_abandon if lease.req_id not in remote_ids]
        peer.to_abandon = [lease for lease in peer.to_abandon if lease.req_id in remote_ids]
        msg = m.TransferDone(
            engine_id=self._engine_id,
            incarnation=peer.remote.incarnation,
            leases=[item.lease for item in sent.values()],
            failed_leases=abandoned,
            reader_rank=self._reader_rank,
            num_readers=self._num_readers,
        )
        peer.last_active = now
        if sent:
            future = self._pool.submit(self._send, peer.remote, msg)
            future.add_done_callback(lambda _: self._wake())
            peer.in_flight = (future, sent)
        else:
            self._send_courtesy(peer.remote, msg)

    def _send_courtesy(self, remote: RemoteEngine, msg: m.TransferDone) -> None:
        self._courtesy = {f for f in self._courtesy if not f.done()}
        if len(self._courtesy) >= MAX_COURTESY:
            self.num_courtesy_dropped += 1  # the prefill frees the blocks when the lease expires
            return
        self._courtesy.add(self._courtesy_pool.submit(self._send, remote, msg))

    def _renew(self, peer: _Peer, reading: list[Reading], now: float) -> None:
        """Renew every min(local lease_s, the prefill's lease_s) / 3, counting from the earliest
        admission, so a lease granted with a term of `lease_s` is renewed three times within it."""
        if not reading or peer.renewing is not None:
            return
        if not peer.last_renew:
            peer.last_renew = min(r.since for r in reading)
        if now - peer.last_renew < min(self._renew_interval_s, *(r.interval_s for r in reading)):
            return
        msg = m.LeaseRenew(engine_id=self._engine_id, incarnation=peer.remote.incarnation,
                           leases=[r.lease for r in reading])  # fmt: skip
        # A peer still handshaking may never answer: its renewals must not hold a confirmation's thread.
        pool = self._pool if all(r.answered for r in reading) else self._courtesy_pool
        peer.renewing = pool.submit(self._send, peer.remote, msg)
        peer.last_renew = peer.last_active = now

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._courtesy_pool.shutdown(wait=False, cancel_futures=True)
        self._peers.clear()
