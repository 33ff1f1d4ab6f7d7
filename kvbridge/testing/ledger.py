"""What the conformance kit's tap keeps per engine: the loads the scheduler half asked for, and the
transfers started and reported finished per request."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvbridge.block_hash import BlockHash


@dataclass
class Load:
    """One load the scheduler half asked for: the full blocks it fills, with their hashes."""

    request_id: str
    targets: list[tuple[int, BlockHash]]  # (block id, chained hash)
    is_async: bool
    error_blocks: set[int] = field(default_factory=set)  # reported as failed while it was in flight


@dataclass
class Ledger:
    """Transfers started and reported finished, per request id."""

    recv_started: Counter = field(default_factory=Counter)
    recv_finished: Counter = field(default_factory=Counter)
    send_started: Counter = field(default_factory=Counter)
    send_finished: Counter = field(default_factory=Counter)
    num_loaded_blocks: Counter = field(default_factory=Counter)  # per request, async and sync loads
    num_sync_loads: int = 0
    num_load_errors: int = 0

    def unfinished(self) -> list[str]:
        """Request ids with a transfer started and not reported finished."""
        recv = {r for r, n in self.recv_started.items() if self.recv_finished[r] < n}
        send = {r for r, n in self.send_started.items() if self.send_finished[r] < n}
        return sorted(recv | send)
