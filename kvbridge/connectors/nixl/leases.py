"""Prefill side: blocks held for remote readers, under leases. Pure Python, thread-safe.

A finished prefill request's blocks stay allocated (`delay_free_blocks`) until the worker reports
the request in `finished_sending`. This table decides when that is:

* the decode side reads, then sends `TransferDone`: the lease is RELEASED and the reply says the
  read was valid, because the blocks could not have been reused while the lease was held;
* nobody reads or renews before the deadline: the lease EXPIRES and the blocks are freed. A
  `TransferDone` arriving later is answered "expired": the reader may have seen reused blocks and
  must treat the read as a load error. This check after the read is what makes a read of reused
  blocks detectable: it is never served silently.

`TransferDone` may arrive before the lease is granted (the client got the prefill's response
before the prefill engine ran its next step). The blocks are still held then, so the read was
valid: the id is remembered as released early, and the grant that follows is released at once.

The side-channel thread calls `renew` and `release`; the engine thread calls `grant`, `collect`
and `pending`.
"""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict
from dataclasses import dataclass

_MAX_TOMBSTONES = 65536  # expired / early-released ids remembered, oldest forgotten first


class LeaseState(enum.Enum):
    ACTIVE = enum.auto()
    RELEASED = enum.auto()  # read done: report finished_sending
    EXPIRED = enum.auto()  # deadline passed: report finished_sending, refuse late readers


@dataclass
class _Lease:
    block_ids: tuple[int, ...]
    deadline: float
    state: LeaseState = LeaseState.ACTIVE


class LeaseTable:
    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._lock = threading.Lock()
        self._leases: dict[str, _Lease] = {}
        self._expired: OrderedDict[str, None] = OrderedDict()  # refused late readers
        self._released_early: OrderedDict[str, None] = OrderedDict()
        self.num_expired = 0
        self.num_released = 0

    def grant(self, req_id: str, block_ids: tuple[int, ...], now: float) -> None:
        with self._lock:
            lease = _Lease(block_ids, now + self.lease_s)
            if req_id in self._released_early:
                del self._released_early[req_id]
                lease.state = LeaseState.RELEASED
                self.num_released += 1
            self._leases[req_id] = lease

    def renew(self, req_ids: list[str], now: float) -> tuple[list[str], list[str]]:
        """Extend active leases. Returns (held, unknown)."""
        held, unknown = [], []
        with self._lock:
            for req_id in req_ids:
                lease = self._leases.get(req_id)
                if lease is not None and lease.state is LeaseState.ACTIVE:
                    lease.deadline = max(lease.deadline, now + self.lease_s)
                    held.append(req_id)
                elif lease is None and req_id not in self._expired:
                    held.append(req_id)  # granted at the prefill's next step; nothing is freed before
                else:
                    unknown.append(req_id)
        return held, unknown

    def release(self, req_ids: list[str]) -> tuple[list[str], list[str]]:
        """Readers are done with these requests. Returns (released: reads were valid, expired: not)."""
        released, expired = [], []
        with self._lock:
            for req_id in req_ids:
                lease = self._leases.get(req_id)
                if lease is None:
                    if req_id in self._expired:
                        expired.append(req_id)
                        continue
                    _remember(self._released_early, req_id)
                    released.append(req_id)
                elif lease.state is LeaseState.EXPIRED:
                    expired.append(req_id)
                else:
                    if lease.state is LeaseState.ACTIVE:
                        lease.state = LeaseState.RELEASED
                        self.num_released += 1
                    released.append(req_id)
        return released, expired

    def collect(self, now: float) -> set[str]:
        """Expire overdue leases; return (once) every request whose blocks may now be freed."""
        done: set[str] = set()
        with self._lock:
            for req_id, lease in list(self._leases.items()):
                if lease.state is LeaseState.ACTIVE and now >= lease.deadline:
                    lease.state = LeaseState.EXPIRED
                    self.num_expired += 1
                    _remember(self._expired, req_id)
                if lease.state is not LeaseState.ACTIVE:
                    del self._leases[req_id]
                    done.add(req_id)
        return done

    def pending(self) -> set[str]:
        with self._lock:
            return {r for r, lease in self._leases.items() if lease.state is LeaseState.ACTIVE}

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)


def _remember(ids: OrderedDict[str, None], req_id: str) -> None:
    ids[req_id] = None
    while len(ids) > _MAX_TOMBSTONES:
        ids.popitem(last=False)
