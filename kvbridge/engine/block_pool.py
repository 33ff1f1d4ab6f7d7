"""The block pool: which KV blocks are free, who holds them, and which hold a cached prefix.

Pure bookkeeping (no torch). Block ids index the first dimension of the engine's block-major KV
tensor (see `kvbridge/layout.py`).

* Each block has a reference count: the number of requests whose block table holds it.
* With prefix caching, a full block computed for a request is registered under its chained
  `BlockHash`. A block whose count drops to zero keeps its hash and waits in an LRU queue: a later
  request may hit it again (`touch`) until `allocate` needs it for something else (lazy eviction).
* Free blocks that hold no cached prefix are handed out first, lowest ids first and in contiguous
  runs where possible: a request whose blocks are adjacent moves in few transfer descriptors.

The scheduler (through `KVCacheManager`) is the only caller; everything runs on the engine thread.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kvbridge.block_hash import BlockHash
from kvbridge.block_runs import find_run

if TYPE_CHECKING:
    from kvbridge.engine.kv_events import KVEventRecorder


class BlockPool:
    """Ref counts, the free queues and the hash -> block map of one engine's KV blocks."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"BlockPool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_cnt = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}  # invariant: _cached[h] == b  <=>  _hash[b] == h
        # Free blocks without a hash, sorted ascending (handed out first, in runs).
        self._free_uncached: list[int] = list(range(num_blocks))
        # Free blocks with a hash, least recently freed first (evicted first).
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self.num_evictions = 0
        self.num_hit_queries = 0
        self.num_hit_blocks = 0
        self.events: KVEventRecorder | None = None  # told of every removal and reset (engine/kv_events.py)

    # ------------------------------------------------------------------ counts

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out, cached ones (evictable) included."""
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered under a hash, in use or free."""
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref_cnt[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._hash[block_id]

    # ------------------------------------------------------------------ allocation

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int, prefer_start: int | None = None) -> list[int]:
        """Take `num_blocks` free blocks (ref count 1), ascending.

        Blocks without a cached prefix go first: the run starting at `prefer_start` when it is free
        (a request growing past its last block), else the first contiguous run long enough, else the
        lowest ids. Only then are cached free blocks evicted, least recently freed first.
        """
        if not self.can_allocate(num_blocks):
            raise ValueError(f"allocate({num_blocks}) with only {self.num_free_blocks} free blocks; call can_allocate first")
        taken = self._take_uncached(min(num_blocks, len(self._free_uncached)), prefer_start)
        while len(taken) < num_blocks:
            block_id, _ = self._free_cached.popitem(last=False)
            self._drop_hash(block_id)
            self.num_evictions += 1
            taken.append(block_id)
        taken.sort()
        for block_id in taken:
            self._ref_cnt[block_id] = 1
        return taken

    def _take_uncached(self, n: int, prefer_start: int | None) -> list[int]:
        free = self._free_uncached
        if n == 0:
            return []
        start = find_run(free, n, prefer_start)
        if start is None:
            taken = free[:n]
            del free[:n]
        else:
            taken = free[start : start + n]
            del free[start : start + n]
        return taken

    def touch(self, block_ids: Iterable[int]) -> None:
        """A request takes another reference on blocks it hit in the prefix cache."""
        for block_id in block_ids:
            if self._ref_cnt[block_id] == 0:
                if block_id not in self._free_cached:
                    raise ValueError(f"touch({block_id}): a free block without a cached prefix cannot be hit")
                del self._free_cached[block_id]
            self._ref_cnt[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block. Blocks reaching zero are freed in the given order, so
        callers pass the blocks they want evicted first, first (a request's tail before its head)."""
        for block_id in block_ids:
            if self._ref_cnt[block_id] <= 0:
                raise ValueError(f"free({block_id}): block is not in use")
            self._ref_cnt[block_id] -= 1
            if self._ref_cnt[block_id] == 0:
                if self._hash[block_id] is None:
                    bisect.insort(self._free_uncached, block_id)
                else:
                    self._free_cached[block_id] = None

    # ------------------------------------------------------------------ prefix cache

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        """The block holding `block_hash`, verified to still hold it, or None."""
        if not self.enable_prefix_caching:
            return None
        block_id = self._cached.get(block_hash)
        if block_id is None or self._hash[block_id] != block_hash:
            return None
        return block_id

    def get_cached_prefix(self, block_hashes: Sequence[BlockHash], max_blocks: int) -> list[int]:
        """Blocks of the longest cached prefix of `block_hashes` (at most `max_blocks`)."""
        self.num_hit_queries += 1
        hits: list[int] = []
        for block_hash in block_hashes[:max_blocks]:
            block_id = self.get_cached_block(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        self.num_hit_blocks += len(hits)
        return hits

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a full, computed block in use under its hash. False when caching is off, the
        block already has a hash, or another block already holds this prefix (it stays uncached)."""
        if not self.enable_prefix_caching or self._hash[block_id] is not None or block_hash in self._cached:
            return False
        if self._ref_cnt[block_id] <= 0:
            raise ValueError(f"cache_block({block_id}): only blocks in use can be cached")
        self._hash[block_id] = block_hash
        self._cached[block_hash] = block_id
        return True

    def uncache_block(self, block_id: int) -> None:
        """Forget a block's prefix (its content is wrong, e.g. a failed load). It is never hit again."""
        if self._hash[block_id] is None:
            return
        self._drop_hash(block_id)
        if block_id in self._free_cached:
            del self._free_cached[block_id]
            bisect.insort(self._free_uncached, block_id)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; blocks in use stay in use. Returns how many were dropped."""
        num_dropped = len(self._cached)
        for block_id in self._cached.values():
            self._hash[block_id] = None
        self._cached.clear()
        self._free_uncached = sorted(self._free_uncached + list(self._free_cached))
        self._free_cached.clear()
        if self.events is not None:
            self.events.all_cleared()
        return num_dropped

    def _drop_hash(self, block_id: int) -> None:
        block_hash = self._hash[block_id]
        self._hash[block_id] = None
        if block_hash is not None and self._cached.get(block_hash) == block_id:
            del self._cached[block_hash]
            if self.events is not None:
                self.events.block_removed(block_hash)

    # ------------------------------------------------------------------ invariants

    def check_integrity(self) -> None:
        """Raise AssertionError unless free + used == total, refs >= 0, no block is both free and in
        use, free lists are duplicate-free, and the hash map matches the per-block hashes."""

        def require(ok: bool, what: str) -> None:
            if not ok:
                raise AssertionError(f"BlockPool integrity: {what}")

        free_uncached, free_cached = self._free_uncached, list(self._free_cached)
        require(all(r >= 0 for r in self._ref_cnt), "negative ref count")
        require(free_uncached == sorted(set(free_uncached)), "uncached free list unsorted or duplicated")
        require(not set(free_uncached) & set(free_cached), "block in both free lists")
        free = set(free_uncached) | set(free_cached)
        used = {b for b, r in enumerate(self._ref_cnt) if r > 0}
        require(not free & used, f"blocks both free and in use: {sorted(free & used)[:8]}")
        require(len(free) + len(used) == self.num_blocks, f"free {len(free)} + used {len(used)} != {self.num_blocks}")
        require(all(self._hash[b] is None for b in free_uncached), "uncached free block has a hash")
        require(all(self._hash[b] is not None for b in free_cached), "cached free block has no hash")
        for block_hash, block_id in self._cached.items():
            require(self._hash[block_id] == block_hash, f"hash map points at block {block_id} holding another hash")
        num_hashed = sum(h is not None for h in self._hash)
        require(num_hashed == len(self._cached), f"{num_hashed} blocks hashed, {len(self._cached)} in the map")
        require(self.enable_prefix_caching or not self._cached, "cached blocks with prefix caching off")
