"""Which block hash lives in which host-tier slot, and in what state. Pure bookkeeping, no torch.

Owned by the scheduler side of the OffloadingConnector: it decides every slot assignment and
eviction, and the worker side only copies bytes between GPU block ids and the slots it is told.

States of an entry:

    STORING  a GPU->host store was issued; not visible to lookups, not evictable
    LOADING  a disk->host read was issued for a load; not visible, not evictable
    READY    the bytes are in the slot; visible; evictable when no load pins it

A block becomes visible only once its store (or disk read) completed, and a block being loaded
to the GPU is pinned, so a slot is never overwritten under a transfer that reads it.
"""

from __future__ import annotations

import enum
import heapq
from dataclasses import dataclass

from kvbridge.block_hash import BlockHash
from kvbridge.connectors.offload.policy import EvictionPolicy, make_policy


class SlotState(enum.Enum):
    STORING = enum.auto()
    LOADING = enum.auto()
    READY = enum.auto()


@dataclass
class HostEntry:
    slot: int
    state: SlotState
    num_pins: int = 0  # loads in flight that read this slot


class HostTierIndex:
    """`num_slots` host slots keyed by `BlockHash`, with an eviction policy over the READY ones."""

    def __init__(self, num_slots: int, policy: str | EvictionPolicy = "lru") -> None:
        self.num_slots = num_slots
        self.policy = make_policy(policy, num_slots) if isinstance(policy, str) else policy
        self._entries: dict[BlockHash, HostEntry] = {}
        self._free_slots = list(range(num_slots))  # a heap: lowest slots first, so runs stay contiguous
        self.num_evictions = 0

    # ------------------------------------------------------------------ queries

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def is_ready(self, block_hash: BlockHash) -> bool:
        entry = self._entries.get(block_hash)
        return entry is not None and entry.state is SlotState.READY

    def slot_of(self, block_hash: BlockHash) -> int:
        return self._entries[block_hash].slot

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def _is_evictable(self, block_hash: BlockHash) -> bool:
        entry = self._entries[block_hash]
        return entry.state is SlotState.READY and entry.num_pins == 0

    # ------------------------------------------------------------------ transitions

    def allocate(self, block_hash: BlockHash, state: SlotState) -> int | None:
        """Give `block_hash` a slot in `state` (STORING or LOADING), evicting if needed.

        Returns the slot, or None when the tier is full of pinned / in-flight entries.
        """
        assert block_hash not in self._entries, "allocate() of a hash that already has a slot"
        assert state is not SlotState.READY
        if not self._free_slots:
            victim = self.policy.pop_victim(self._is_evictable, incoming=block_hash)
            if victim is None:
                return None
            heapq.heappush(self._free_slots, self._entries.pop(victim).slot)
            self.num_evictions += 1
        slot = heapq.heappop(self._free_slots)
        self._entries[block_hash] = HostEntry(slot, state)
        return slot

    def mark_ready(self, block_hash: BlockHash) -> None:
        """The store or disk read into this entry's slot completed: make it visible."""
        entry = self._entries.get(block_hash)
        if entry is None or entry.state is SlotState.READY:
            return
        entry.state = SlotState.READY
        self.policy.insert(block_hash)

    def discard(self, block_hash: BlockHash) -> None:
        """Forget an entry whose bytes are not valid (failed transfer). Its slot becomes free."""
        entry = self._entries.pop(block_hash, None)
        if entry is None:
            return
        if entry.state is SlotState.READY:
            self.policy.remove(block_hash)
        heapq.heappush(self._free_slots, entry.slot)

    def pin(self, block_hash: BlockHash) -> int:
        """Pin a READY entry against eviction for a load; counts as a hit. Returns its slot."""
        entry = self._entries[block_hash]
        assert entry.state is SlotState.READY, "only READY entries can be pinned for a load"
        entry.num_pins += 1
        self.policy.touch(block_hash)
        return entry.slot

    def unpin(self, block_hash: BlockHash) -> None:
        entry = self._entries.get(block_hash)
        if entry is not None and entry.num_pins > 0:
            entry.num_pins -= 1

    def hashes_in(self, state: SlotState) -> set[BlockHash]:
        return {h for h, e in self._entries.items() if e.state is state}

    def pin_counts(self) -> dict[BlockHash, int]:
        return {h: e.num_pins for h, e in self._entries.items() if e.num_pins}

    # ------------------------------------------------------------------ invariants

    def check_integrity(self) -> None:
        used = [e.slot for e in self._entries.values()]
        if len(used) + len(self._free_slots) != self.num_slots:
            raise AssertionError(f"host tier: used {len(used)} + free {len(self._free_slots)} != {self.num_slots}")
        if len(set(used) | set(self._free_slots)) != self.num_slots:
            raise AssertionError("host tier: a slot is both used and free, or used twice")
        ready = {h for h, e in self._entries.items() if e.state is SlotState.READY}
        if set(self.policy.keys()) != ready:
            raise AssertionError("host tier: the eviction policy does not track exactly the READY entries")
        if any(e.num_pins < 0 or (e.num_pins and e.state is not SlotState.READY) for e in self._entries.values()):
            raise AssertionError("host tier: a pin count is negative or pins a non-READY entry")
        self.policy.check_integrity()
