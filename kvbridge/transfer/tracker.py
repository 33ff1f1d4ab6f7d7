"""Per-request transfer records: an explicit state machine with a deadline on every live state.

    HANDSHAKING --> POSTED --> DONE
         |             |-----> FAILED
         |             '-----> EXPIRED   (its deadline passed)
         '--> FAILED | EXPIRED

A record is created HANDSHAKING (waiting for the peer's handshake) or directly POSTED; every
transition into a live state sets a new deadline; final states never change again (an illegal
transition raises `IllegalTransitionError`). `expire_overdue(now)` moves overdue live records to
EXPIRED.

The tracker owns no I/O: the transfer owner (e.g. `KVEndpoint`) keeps opaque handles in
`record.handle` and releases them when it sees a record become final. Pure Python, one thread,
clock injectable (tests use a fake clock).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from kvbridge.errors import KVBridgeError


class TransferState(enum.Enum):
    HANDSHAKING = "handshaking"
    POSTED = "posted"
    DONE = "done"
    FAILED = "failed"
    EXPIRED = "expired"

    @property
    def is_final(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED, TransferState.EXPIRED)


_ALLOWED: dict[TransferState, frozenset[TransferState]] = {
    TransferState.HANDSHAKING: frozenset({TransferState.POSTED, TransferState.FAILED, TransferState.EXPIRED}),
    TransferState.POSTED: frozenset({TransferState.DONE, TransferState.FAILED, TransferState.EXPIRED}),
}


class IllegalTransitionError(KVBridgeError, RuntimeError):
    """A transfer record was asked to move along an edge the state machine does not have (a bug)."""


@dataclass(eq=False)
class TransferRecord:
    """One request's transfer. `deadline` (clock seconds) bounds the current live state."""

    req_id: str
    peer: str
    state: TransferState
    deadline: float
    created_at: float
    nbytes: int = 0
    num_descriptors: int = 0
    error: str | None = None
    finished_at: float | None = None
    device_s: float | None = None  # a CUDA IPC read's copies timed on the device (None: not measured)
    copy_digests: Any = None  # a read on the SMs: the wsum64 DigestJob of the blocks it wrote (cuda_ipc.py)
    handle: Any = None  # owner's in-flight handle(s); None once released
    payload: Any = None  # owner's data (block ids, the instance expected, ...)
    history: list[TransferState] = field(default_factory=list)

    @property
    def is_final(self) -> bool:
        return self.state.is_final

    @property
    def is_ok(self) -> bool:
        return self.state is TransferState.DONE


class TransferTracker:
    """All transfer records of one endpoint, by request id."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._records: dict[str, TransferRecord] = {}
        self.num_done = 0
        self.num_failed = 0  # FAILED + EXPIRED
        self.bytes_done = 0

    def start(
        self, req_id: str, peer: str, timeout_s: float, *, state: TransferState = TransferState.HANDSHAKING, **fields
    ) -> TransferRecord:
        """Create a live record. A live record with the same id is an error; a final one is replaced."""
        if state.is_final:
            raise IllegalTransitionError(f"a transfer cannot start in final state {state.name}")
        old = self._records.get(req_id)
        if old is not None and not old.is_final:
            raise ValueError(f"request {req_id!r} already has a transfer in state {old.state.name}")
        now = self.clock()
        rec = TransferRecord(req_id, peer, state, now + timeout_s, now, history=[state], **fields)
        self._records[req_id] = rec
        return rec

    def get(self, req_id: str) -> TransferRecord | None:
        return self._records.get(req_id)

    def live(self) -> list[TransferRecord]:
        return [r for r in self._records.values() if not r.is_final]

    @property
    def num_live(self) -> int:
        return sum(1 for r in self._records.values() if not r.is_final)

    def mark_posted(self, req_id: str, timeout_s: float, **fields) -> TransferRecord:
        rec = self._transition(req_id, TransferState.POSTED)
        rec.deadline = self.clock() + timeout_s
        for name, value in fields.items():
            setattr(rec, name, value)
        return rec

    def mark_done(self, req_id: str) -> TransferRecord:
        rec = self._transition(req_id, TransferState.DONE)
        self.num_done += 1
        self.bytes_done += rec.nbytes
        return rec

    def mark_failed(self, req_id: str, error: str) -> TransferRecord:
        rec = self._transition(req_id, TransferState.FAILED)
        rec.error = error
        self.num_failed += 1
        return rec

    def expire_overdue(self, now: float | None = None) -> list[TransferRecord]:
        """Move every live record past its deadline to EXPIRED; returns them."""
        now = self.clock() if now is None else now
        expired = [r for r in self._records.values() if not r.is_final and now >= r.deadline]
        for rec in expired:
            self._transition(rec.req_id, TransferState.EXPIRED, now)
            rec.error = f"no progress within its deadline (state was {rec.history[-2].name})"
            self.num_failed += 1
        return expired

    def pop_final(self) -> list[TransferRecord]:
        """Remove and return every final record (the owner reports them, e.g. from get_finished)."""
        final = [r for r in self._records.values() if r.is_final]
        for rec in final:
            del self._records[rec.req_id]
        return final

    def _transition(self, req_id: str, new: TransferState, now: float | None = None) -> TransferRecord:
        rec = self._records.get(req_id)
        if rec is None:
            raise KeyError(f"no transfer record for request {req_id!r}")
        if new not in _ALLOWED.get(rec.state, frozenset()):
            raise IllegalTransitionError(f"request {req_id!r}: {rec.state.name} -> {new.name} is not allowed")
        rec.state = new
        rec.history.append(new)
        if new.is_final:
            rec.finished_at = self.clock() if now is None else now
        return rec
