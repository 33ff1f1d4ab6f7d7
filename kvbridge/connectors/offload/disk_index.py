"""Which block hashes the disk tier holds. Pure bookkeeping, owned by the scheduler side.

The disk tier is written through: every block that completes a host store is also queued for
writing to disk (unless already there), so an entry is added when its host store completes. The
worker validates each file's header when it reads it; a stale or foreign file fails the load, the
block is recomputed and its entry is dropped. Capacity is enforced here with LRU order and the
deletions travel to the worker in the step metadata.

At start-up the index is seeded from the file names in the directory (a warm restart); listing a
directory once at construction is the only I/O this side does.
"""

from __future__ import annotations

import os
from collections import Counter, OrderedDict

from kvbridge.block_hash import BlockHash

FILE_SUFFIX = ".kvblock"
TEMP_MARK = ".tmp"  # a write in progress: "<block file name>.tmp<pid>", renamed into place when complete


def block_file_name(block_hash: BlockHash) -> str:
    return block_hash.hex() + FILE_SUFFIX


def temp_file_name(block_hash: BlockHash, pid: int) -> str:
    return f"{block_file_name(block_hash)}{TEMP_MARK}{pid}"


def is_temp_file_name(name: str) -> bool:
    """A name `temp_file_name` gives (a write in progress, or one a crash left behind)."""
    stem, mark, pid = name.rpartition(TEMP_MARK)
    return bool(mark) and pid.isdigit() and parse_block_file_name(stem) is not None


def parse_block_file_name(name: str) -> BlockHash | None:
    if not name.endswith(FILE_SUFFIX):
        return None
    try:
        return BlockHash(bytes.fromhex(name[: -len(FILE_SUFFIX)]))
    except ValueError:
        return None


def scan_block_files(directory: str) -> list[BlockHash]:
    """Hashes of the block files in `directory`, oldest modification first."""
    if not os.path.isdir(directory):
        return []
    found: list[tuple[float, BlockHash]] = []
    with os.scandir(directory) as it:
        for entry in it:
            block_hash = parse_block_file_name(entry.name)
            if block_hash is not None and entry.is_file():
                found.append((entry.stat().st_mtime, block_hash))
    return [h for _, h in sorted(found)]


class DiskTierIndex:
    """LRU set of on-disk block hashes with an optional capacity in blocks."""

    def __init__(self, capacity: int | None = None, initial: list[BlockHash] = ()) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[BlockHash, None] = OrderedDict()  # oldest first
        self._pins: Counter[BlockHash] = Counter()  # disk reads in flight
        self.num_evictions = 0
        self._pending_deletes: list[BlockHash] = []
        for block_hash in initial:
            self.add(block_hash)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, block_hash: BlockHash) -> None:
        """A block is (being) written to disk; evict the oldest unpinned blocks beyond capacity."""
        self._entries[block_hash] = None
        self._entries.move_to_end(block_hash)
        while self.capacity is not None and len(self._entries) > self.capacity:
            victim = next((h for h in self._entries if not self._pins[h] and h != block_hash), None)
            if victim is None:
                break
            del self._entries[victim]
            self._pending_deletes.append(victim)
            self.num_evictions += 1

    def pin(self, block_hash: BlockHash) -> None:
        self._pins[block_hash] += 1
        self._entries.move_to_end(block_hash)

    def unpin(self, block_hash: BlockHash) -> None:
        self._pins[block_hash] -= 1
        if self._pins[block_hash] <= 0:
            del self._pins[block_hash]

    def discard(self, block_hash: BlockHash) -> None:
        """The file is bad or gone: forget it and have the worker delete it."""
        if self._entries.pop(block_hash, 0) is None:
            self._pending_deletes.append(block_hash)

    def take_deletes(self) -> list[BlockHash]:
        """Files the worker must delete, since the last call."""
        deletes, self._pending_deletes = self._pending_deletes, []
        return deletes

    def check_integrity(self) -> None:
        if any(n <= 0 for n in self._pins.values()):
            raise AssertionError("disk tier: a non-positive pin count")
        if self.capacity is not None and len(self._entries) > self.capacity + len(self._pins):
            raise AssertionError(f"disk tier: {len(self._entries)} entries exceed capacity {self.capacity}")
