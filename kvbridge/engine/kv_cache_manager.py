"""Per-request block tables on top of the block pool: prefix lookups, growth, caching, freeing.

Pure bookkeeping (no torch). The scheduler owns one `KVCacheManager`; it is the only code that
changes which blocks a request holds. A request's block table lists its blocks in token order:
token `t` lives in block `table[t // block_size]`, slot `t % block_size`.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbridge.engine.block_pool import BlockPool
from kvbridge.engine.kv_events import KVEventRecorder
from kvbridge.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Which blocks each request holds, and how many of them are registered in the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self._tables: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks of a table already registered
        self.events: KVEventRecorder | None = None

    def record_events(self, recorder: KVEventRecorder) -> None:
        """Report every block the prefix cache stores, evicts or forgets, and every reset, to `recorder`."""
        self.events = self.pool.events = recorder

    def block_ids(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def holds_blocks(self, request_id: str) -> bool:
        return bool(self._tables.get(request_id))

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Blocks of the longest locally cached prefix of `request`, leaving at least one token to compute."""
        max_blocks = (request.num_tokens - 1) // self.block_size
        if max_blocks <= 0:
            return []
        return self.pool.get_cached_prefix(request.block_hashes, max_blocks)

    def can_allocate_slots(self, request: Request, num_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        return self._num_blocks_to_take(request, num_tokens, computed_blocks) is not None

    def allocate_slots(self, request: Request, num_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Make the request hold blocks for its first `num_tokens` tokens.

        `computed_blocks` (prefix hits, only for a request holding nothing yet) are taken first. Returns
        False, changing nothing, when the pool cannot supply the missing blocks.
        """
        num_new = self._num_blocks_to_take(request, num_tokens, computed_blocks)
        if num_new is None:
            return False
        table = self._tables.setdefault(request.request_id, [])
        if computed_blocks:
            self.pool.touch(computed_blocks)
            table.extend(computed_blocks)
            # Hits are registered blocks already.
            self._num_cached_blocks[request.request_id] = len(computed_blocks)
        if num_new:
            prefer = table[-1] + 1 if table else None
            table.extend(self.pool.allocate(num_new, prefer_start=prefer))
        return True

    def _num_blocks_to_take(self, request: Request, num_tokens: int, computed_blocks: Sequence[int]) -> int | None:
        table = self._tables.get(request.request_id, [])
        if computed_blocks and table:
            raise ValueError(f"{request.request_id}: prefix hits are taken only by a request holding no blocks")
        num_new = max(0, cdiv(num_tokens, self.block_size) - len(table) - len(computed_blocks))
        # Hits sitting in the free queue stop being allocatable once touched.
        num_free_hits = sum(1 for b in computed_blocks if self.pool.ref_count(b) == 0)
        if num_new + num_free_hits > self.pool.num_free_blocks:
            return None
        return num_new

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks whose KV is now computed (or loaded) under their hashes."""
        table = self._tables.get(request.request_id)
        if not table or not self.pool.enable_prefix_caching:
            return
        num_full = min(num_computed_tokens // self.block_size, len(request.block_hashes), len(table))
        start = self._num_cached_blocks.get(request.request_id, 0)
        stored = [i for i in range(start, num_full) if self.pool.cache_block(table[i], request.block_hashes[i])]
        if self.events is not None:
            self.events.blocks_stored(request, stored)
        self._num_cached_blocks[request.request_id] = max(start, num_full)

    def uncache_from(self, request_id: str, first_block: int) -> None:
        """Forget the prefixes of the request's blocks from index `first_block` on (their KV is wrong)."""
        table = self._tables.get(request_id, [])
        for block_id in table[first_block:]:
            self.pool.uncache_block(block_id)
        if self._num_cached_blocks.get(request_id, 0) > first_block:
            self._num_cached_blocks[request_id] = first_block

    def free(self, request_id: str) -> None:
        """Release every block of the request, tail first so that its tail is evicted first."""
        table = self._tables.pop(request_id, [])
        self._num_cached_blocks.pop(request_id, None)
        self.pool.free(reversed(table))
        if self.events is not None:
            self.events.forget(request_id)

    def reset_prefix_cache(self) -> int:
        for request_id in self._num_cached_blocks:
            self._num_cached_blocks[request_id] = 0
        return self.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """The pool's invariants, plus: each block's ref count equals the number of tables holding it."""
        self.pool.check_integrity()
        holders = [0] * self.pool.num_blocks
        for table in self._tables.values():
            for block_id in table:
                holders[block_id] += 1
        for block_id, count in enumerate(holders):
            if self.pool.ref_count(block_id) != count:
                raise AssertionError(
                    f"KVCacheManager integrity: block {block_id} has ref count {self.pool.ref_count(block_id)} "
                    f"but {count} block tables hold it"
                )
