"""Block pool: ref counts, contiguous allocation, prefix cache, lazy LRU eviction, integrity."""

from __future__ import annotations

import random

import pytest

from kvbridge.block_hash import BlockHash, hash_full_blocks
from kvbridge.engine.block_pool import BlockPool


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "little"))


def test_fresh_pool_hands_out_contiguous_ascending_runs():
    pool = BlockPool(64)
    runs = [pool.allocate(n) for n in (5, 1, 12, 3)]
    assert runs[0] == [0, 1, 2, 3, 4]
    assert runs[1] == [5]
    assert runs[2] == list(range(6, 18))
    assert runs[3] == [18, 19, 20]
    assert pool.num_free_blocks == 64 - 21
    pool.check_integrity()


def test_allocate_finds_a_contiguous_run_past_fragmentation():
    pool = BlockPool(32)
    blocks = pool.allocate(32)
    pool.free([1, 3, 5, 10, 11, 12, 13, 20])  # holes: single blocks, then a run of four
    assert pool.allocate(3) == [10, 11, 12]
    assert pool.allocate(2) == [1, 3]  # no run of two left: lowest ids
    pool.check_integrity()
    pool.free([b for b in blocks if pool.ref_count(b) > 0])
    assert pool.num_free_blocks == 32
    pool.check_integrity()


def test_allocate_prefers_the_block_after_a_requests_last_block():
    pool = BlockPool(16)
    a = pool.allocate(2)  # [0, 1]
    b = pool.allocate(2)  # [2, 3]
    pool.free(b)
    assert pool.allocate(1, prefer_start=a[-1] + 1) == [2]
    assert pool.allocate(1, prefer_start=99) == [3]  # hint not free: first run
    pool.check_integrity()


def test_ref_counts_and_double_free():
    pool = BlockPool(4)
    [b] = pool.allocate(1)
    pool.cache_block(b, h(1))
    pool.touch([b])
    assert pool.ref_count(b) == 2
    pool.free([b])
    assert pool.ref_count(b) == 1 and pool.num_free_blocks == 3
    pool.free([b])
    assert pool.num_free_blocks == 4
    with pytest.raises(ValueError, match="not in use"):
        pool.free([b])
    with pytest.raises(ValueError, match="can_allocate"):
        pool.allocate(5)
    pool.check_integrity()


def test_freed_cached_block_is_hit_until_evicted_lru():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    for i, b in enumerate(blocks):
        pool.cache_block(b, h(i))
    pool.free([blocks[2], blocks[0], blocks[1], blocks[3]])  # LRU order: 2, 0, 1, 3
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 4
    assert pool.get_cached_block(h(0)) == blocks[0]  # lazily kept
    [evicted] = pool.allocate(1)
    assert evicted == blocks[2] and pool.get_cached_block(h(2)) is None
    assert pool.num_evictions == 1
    pool.touch([blocks[0]])  # a hit takes it out of the free queue
    assert pool.allocate(1) == [blocks[1]]  # next LRU, skipping the touched one
    pool.check_integrity()


def test_uncached_blocks_go_before_cached_ones():
    pool = BlockPool(6)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.cache_block(b, h(i))
    pool.free(blocks)
    assert pool.allocate(3) == [3, 4, 5]  # never-cached first
    assert pool.num_cached_blocks == 3
    assert pool.allocate(1) == [blocks[0]]
    assert pool.num_cached_blocks == 2
    pool.check_integrity()


def test_hits_are_verified_and_duplicates_stay_uncached():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, h(7))
    assert not pool.cache_block(b, h(7))  # another block already holds this prefix
    assert pool.block_hash(b) is None
    pool.free([a])
    pool._hash[a] = h(8)  # a block that no longer holds the hash the map says
    assert pool.get_cached_block(h(7)) is None
    pool._hash[a] = h(7)
    assert pool.get_cached_block(h(7)) == a
    pool.free([b])
    pool.check_integrity()


def test_get_cached_prefix_stops_at_first_miss_and_respects_max():
    pool = BlockPool(8)
    hashes = hash_full_blocks(list(range(64)), 16)
    blocks = pool.allocate(4)
    for b, bh in zip(blocks, hashes):
        pool.cache_block(b, bh)
    pool.uncache_block(blocks[2])
    assert pool.get_cached_prefix(hashes, max_blocks=4) == blocks[:2]
    assert pool.get_cached_prefix(hashes, max_blocks=1) == blocks[:1]
    pool.check_integrity()


def test_reset_prefix_cache_drops_every_hash():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.cache_block(b, h(i))
    pool.free(blocks[1:])
    assert pool.reset_prefix_cache() == 3
    assert pool.num_cached_blocks == 0 and all(pool.get_cached_block(h(i)) is None for i in range(3))
    assert pool.ref_count(blocks[0]) == 1  # in-use blocks stay in use
    assert pool.allocate(3) == [1, 2, 3]  # freed blocks are plain free blocks again, in id order
    pool.check_integrity()


def test_prefix_caching_off_caches_nothing():
    pool = BlockPool(4, enable_prefix_caching=False)
    [b] = pool.allocate(1)
    assert not pool.cache_block(b, h(1))
    assert pool.get_cached_block(h(1)) is None
    pool.check_integrity()


def test_check_integrity_catches_corruption():
    pool = BlockPool(4)
    [b] = pool.allocate(1)
    pool._free_uncached.append(b)  # both free and in use
    with pytest.raises(AssertionError, match="both free and in use|unsorted"):
        pool.check_integrity()
    pool = BlockPool(4)
    pool._ref_cnt[0] = -1
    with pytest.raises(AssertionError, match="negative"):
        pool.check_integrity()
    pool = BlockPool(4)
    [b] = pool.allocate(1)
    pool._hash[b] = h(3)  # hash set but not in the map
    with pytest.raises(AssertionError, match="hash"):
        pool.check_integrity()


def test_random_operations_keep_invariants():
    seed = random.randrange(2**32)
    print(f"seed={seed}")
    rng = random.Random(seed)
    pool = BlockPool(48)
    held: list[list[int]] = []
    for step in range(400):
        op = rng.random()
        if op < 0.45:
            n = rng.randint(1, 6)
            if pool.can_allocate(n):
                blocks = pool.allocate(n)
                assert blocks == sorted(blocks) and len(set(blocks)) == n
                for b in blocks:
                    if rng.random() < 0.5:
                        pool.cache_block(b, h(rng.randrange(40)))
                held.append(blocks)
        elif op < 0.8 and held:
            pool.free(held.pop(rng.randrange(len(held))))
        elif op < 0.95:
            hit = pool.get_cached_block(h(rng.randrange(40)))
            if hit is not None:
                pool.touch([hit])
                held.append([hit])
        else:
            pool.reset_prefix_cache()
        pool.check_integrity()
        assert pool.num_used_blocks == len({b for blocks in held for b in blocks})
    for blocks in held:
        pool.free(blocks)
    assert pool.num_free_blocks == 48
    pool.check_integrity()
