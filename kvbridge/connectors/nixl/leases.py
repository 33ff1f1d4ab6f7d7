"""Prefill side: blocks held for remote readers, under leases. Pure Python, thread-safe.

A finished prefill request's blocks stay allocated (`delay_free_blocks`) until the worker reports
the request in `finished_sending`. This table decides when that is. Every lease is named by
`(request id, token, block ids, block hash)` inside one process `incarnation`; the token is an
unguessable secret that only the request's client received. A renewal or release that does not
match a lease exactly is answered "unknown" and changes nothing, so nobody but the requester can
end a lease early, and nobody can get a read confirmed that no lease covered.

* the reader renews while it reads, then sends `TransferDone`: the lease is RELEASED and the reply
  says "released": the blocks could not have been reused while it was held;
* nobody reads or renews before the deadline: the lease EXPIRES and the blocks are freed; a later
  release is answered "unknown", which the reader treats as a load error;
* a renewal or release that arrives before the lease is granted (the client got the prefill's
  response before the prefill engine ran its next step) is answered "pending": the blocks are
  still allocated then, and the reader asks again. Leases that were granted once and have ended are
  remembered (bounded, as a hash of the exact lease) and answered "unknown" instead;
* a lease abandoned before it is granted (a decode node that refused the request at once, or a
  proxy whose decode leg failed: `TransferDone.failed_leases`, sent once and never asked again) is
  remembered by the hash of the exact lease, for `EARLY_ABANDON_S` and at most `MAX_EARLY_ABANDONS`
  of them. The grant that matches one ends the lease at once, so its blocks are freed at the next
  `collect` instead of when the lease expires. Only the exact lease matches, token included, so
  nobody but the token's holder can end a lease this way; a flood of made-up abandons only evicts
  real ones, whose leases then expire as before.

Only the holder of a lease's token learns anything about it: a renewal or release whose token,
blocks or hash differ from the lease of that id (live or ended) is answered "pending", exactly as an
id never granted is, so nobody can probe which request ids are live. Tokens are compared in
constant time.

The side-channel thread calls `renew` and `release`; the engine thread calls `grant`, `collect`
and `pending`.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

from kvbridge.transfer.messages import KVDigest, LeaseRef, encode_lease

_MAX_ENDED = 65536  # ended request ids remembered, oldest forgotten first
# Leases abandoned before their grant: a grant follows within a step of the prefill engine, so a
# few seconds cover a loaded node; beyond them the lease expires as it would have anyway.
EARLY_ABANDON_S = 30.0
MAX_EARLY_ABANDONS = 4096


class LeaseState(enum.Enum):
    ACTIVE = enum.auto()
    RELEASED = enum.auto()  # read done: report finished_sending
    EXPIRED = enum.auto()  # deadline passed: report finished_sending, refuse late readers


@dataclass
class _Lease:
    ref: LeaseRef
    deadline: float
    digest: KVDigest | None = None  # of the leased blocks' bytes when granted; returned on release
    state: LeaseState = LeaseState.ACTIVE
    readers: set[int] = field(default_factory=set)  # ranks of a TP reader node that confirmed it
    abandoned_early: bool = False  # ended at its grant by an abandon that came before it


@dataclass
class _EarlyAbandon:
    """Abandons of one exact lease that came before its grant."""

    at: float
    readers: set[int]
    num_readers: int


class LeaseAnswer(NamedTuple):
    """Request ids sorted by what the table did with them."""

    matched: list[str]  # held (renew) or released (release)
    pending: list[str]
    unknown: list[str]
    digests: dict[str, KVDigest]  # release: the digest granted with each matched lease that has one


class LeaseTable:
    def __init__(self, lease_s: float, incarnation: str) -> None:
        self.lease_s = lease_s
        self.incarnation = incarnation
        self._lock = threading.Lock()
        self._leases: dict[str, _Lease] = {}
        # released or expired: request id -> (hash of the exact lease, whether an abandon that came
        # before the grant ended it), answered "unknown" on an exact match, except that abandon's
        # retry: "released", as it asked
        self._ended: OrderedDict[str, tuple[bytes, bool]] = OrderedDict()
        # abandoned before granted: hash of the exact lease -> who abandoned it, oldest first
        self._abandoned_early: OrderedDict[bytes, _EarlyAbandon] = OrderedDict()
        self.num_expired = 0
        self.num_released = 0
        self.num_refused = 0  # renewals and releases that matched no lease
        self.num_abandoned_before_grant = 0  # leases ended at their grant by an earlier abandon

    def grant(self, ref: LeaseRef, now: float, digest: KVDigest | None = None) -> None:
        """Hold `ref.block_ids` for `ref.req_id` until released or `lease_s` without a renewal.

        `digest`: of the blocks' bytes now; a release that matches returns it to the reader.
        """
        with self._lock:
            self._ended.pop(ref.req_id, None)
            lease = self._leases[ref.req_id] = _Lease(ref, now + self.lease_s, digest)
            early = self._abandoned_early.pop(_fingerprint(ref), None) if self._abandoned_early else None
            if early is not None and now - early.at < EARLY_ABANDON_S:
                lease.readers |= early.readers
                if len(lease.readers) >= early.num_readers:
                    lease.state = LeaseState.RELEASED
                    lease.abandoned_early = True
                    self.num_released += 1
                    self.num_abandoned_before_grant += 1

    def renew(self, incarnation: str, refs: list[LeaseRef], now: float) -> LeaseAnswer:
        """Extend the leases that match exactly."""
        answer = LeaseAnswer([], [], [], {})
        with self._lock:
            for ref in refs:
                lease = self._match(incarnation, ref, answer)
                if lease is not None and lease.state is LeaseState.ACTIVE and now < lease.deadline:
                    lease.deadline = now + self.lease_s
                    answer.matched.append(ref.req_id)
                elif lease is not None:
                    self._refuse(ref, answer)
        return answer

    def release(
        self, incarnation: str, refs: list[LeaseRef], now: float, reader_rank: int = 0, num_readers: int = 1,
        abandoned: list[LeaseRef] = (),
    ) -> LeaseAnswer:  # fmt: skip
        """The reader is done with these leases: it read `refs` and will not read `abandoned`.
        `matched`: each was held until now (reads valid).

        A tensor-parallel reader node confirms once per rank (`reader_rank` of `num_readers`): a lease
        ends once that many distinct ranks confirmed or abandoned it (or it expires), so no rank's
        read is cut short by another rank's confirmation. An abandon of a lease not granted yet is
        remembered for its grant (module docstring); a confirmation is not: the reader asks again."""
        answer = LeaseAnswer([], [], [], {})
        reader_rank, num_readers = min(max(reader_rank, 0), 1024), max(num_readers, 1)
        with self._lock:
            for ref in abandoned:
                if incarnation == self.incarnation and ref.req_id not in self._leases and ref.req_id not in self._ended:
                    self._remember_early_abandon(ref, now, reader_rank, num_readers)
            for ref, is_abandon in [*((ref, False) for ref in refs), *((ref, True) for ref in abandoned)]:
                lease = self._match(incarnation, ref, answer, is_abandon)
                if lease is None:
                    continue
                if lease.state is LeaseState.ACTIVE and now >= lease.deadline:
                    self._expire(lease)
                if lease.state is LeaseState.EXPIRED:
                    self._refuse(ref, answer)
                    continue
                lease.readers.add(reader_rank)
                if lease.state is LeaseState.ACTIVE and len(lease.readers) >= num_readers:
                    lease.state = LeaseState.RELEASED
                    self.num_released += 1
                answer.matched.append(ref.req_id)
                if lease.digest is not None:
                    answer.digests[ref.req_id] = lease.digest
        return answer

    def _remember_early_abandon(self, ref: LeaseRef, now: float, reader_rank: int, num_readers: int) -> None:
        early = self._abandoned_early
        while early and (len(early) >= MAX_EARLY_ABANDONS or now - next(iter(early.values())).at >= EARLY_ABANDON_S):
            early.popitem(last=False)
        entry = early.setdefault(_fingerprint(ref), _EarlyAbandon(now, set(), num_readers))
        entry.readers.add(reader_rank)

    def _match(self, incarnation: str, ref: LeaseRef, answer: LeaseAnswer, is_abandon: bool = False) -> _Lease | None:
        """The lease `ref` names exactly, or None after filing `ref` as pending or unknown (or, for the
        retry of an abandon that ended the lease at its grant, as matched: it asked for that)."""
        if incarnation != self.incarnation:
            self._refuse(ref, answer)
            return None
        lease = self._leases.get(ref.req_id)
        if lease is None:
            fingerprint, abandoned_early = self._ended.get(ref.req_id, (None, False))
            if fingerprint is not None and hmac.compare_digest(fingerprint, _fingerprint(ref)):
                if is_abandon and abandoned_early:
                    answer.matched.append(ref.req_id)
                else:
                    self._refuse(ref, answer)  # the requester of an ended lease learns that it ended
            else:
                self._refuse_unseen(ref, answer)
            return None
        if not _same(lease.ref, ref):  # token, block ids or block hash differ
            self._refuse_unseen(ref, answer)
            return None
        return lease

    def _refuse_unseen(self, ref: LeaseRef, answer: LeaseAnswer) -> None:
        """No lease matches, and the caller may not learn whether the id is live: the answer to an
        id that was never granted ("pending"; a reader gives up on it after a grace period)."""
        if ref.req_id in self._leases or ref.req_id in self._ended:
            self.num_refused += 1
        answer.pending.append(ref.req_id)

    def _refuse(self, ref: LeaseRef, answer: LeaseAnswer) -> None:
        self.num_refused += 1
        answer.unknown.append(ref.req_id)

    def _expire(self, lease: _Lease) -> None:
        lease.state = LeaseState.EXPIRED
        self.num_expired += 1

    def collect(self, now: float) -> set[str]:
        """Expire overdue leases; return (once) every request whose blocks may now be freed."""
        done: set[str] = set()
        with self._lock:
            for req_id, lease in list(self._leases.items()):
                if lease.state is LeaseState.ACTIVE and now >= lease.deadline:
                    self._expire(lease)
                if lease.state is not LeaseState.ACTIVE:
                    del self._leases[req_id]
                    self._ended[req_id] = (_fingerprint(lease.ref), lease.abandoned_early)
                    while len(self._ended) > _MAX_ENDED:
                        self._ended.popitem(last=False)
                    done.add(req_id)
        return done

    def pending(self, now: float) -> set[str]:
        """Requests whose leases are live: neither ended nor past their deadline."""
        with self._lock:
            return {r for r, lease in self._leases.items() if lease.state is LeaseState.ACTIVE and now < lease.deadline}

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)


def _fingerprint(ref: LeaseRef) -> bytes:
    """What an ended lease is remembered by: 32 bytes, whatever its number of blocks."""
    return hashlib.sha256(encode_lease(ref)).digest()


def _same(a: LeaseRef, b: LeaseRef) -> bool:
    """Whether two leases are the same, comparing the secret token in constant time."""
    return (
        hmac.compare_digest(a.token.encode(), b.token.encode())
        & (a.req_id == b.req_id) & (a.block_ids == b.block_ids) & (a.block_hash == b.block_hash)
    )
