"""LRU and ARC eviction policies, including ARC's ghost lists and its scan resistance."""

from __future__ import annotations

import random

import pytest

from kvbridge.connectors.offload.policy import ARCPolicy, LRUPolicy, make_policy
from kvbridge.errors import ConfigError


def _always(_key) -> bool:
    return True


def _cache_run(policy, trace) -> int:
    """Run a request trace through a full-capacity cache; return the number of hits."""
    hits = 0
    for key in trace:
        if key in policy:
            policy.touch(key)
            hits += 1
            continue
        if len(policy) >= policy.capacity:
            assert policy.pop_victim(_always, incoming=key) is not None
        policy.insert(key)
        policy.check_integrity()
    return hits


def test_lru_evicts_least_recently_used_and_skips_pinned():
    lru = LRUPolicy(3)
    for key in "abc":
        lru.insert(key)
    lru.touch("a")  # order now b, c, a
    assert lru.pop_victim(lambda k: k != "b") == "c"  # b is pinned
    assert lru.pop_victim(_always) == "b"
    assert lru.pop_victim(lambda k: False) is None  # everything pinned
    assert set(lru.keys()) == {"a"}


def test_arc_second_access_moves_to_t2_and_b1_ghost_hit_grows_p():
    arc = ARCPolicy(2)
    arc.insert("a")
    arc.insert("b")
    arc.touch("a")  # a: T2, b: T1
    assert list(arc.t2) == ["a"] and list(arc.t1) == ["b"]
    assert arc.pop_victim(_always, incoming="c") == "b"  # |T1| = 1 > p = 0: evict from T1
    assert "b" in arc.b1 and "b" not in arc
    arc.insert("c")
    assert arc.pop_victim(_always, incoming="b") in ("a", "c")
    p_before = arc.p
    arc.insert("b")  # a ghost hit in B1: recency was undervalued
    assert arc.p > p_before
    assert "b" in arc.t2 and "b" not in arc.b1
    arc.check_integrity()


def test_arc_b2_ghost_hit_shrinks_p():
    arc = ARCPolicy(2)
    arc.insert("a")
    arc.touch("a")  # T2
    arc.p = 2.0
    assert arc.pop_victim(lambda k: k == "a") == "a"  # only a is evictable: it goes to B2
    assert "a" in arc.b2
    arc.insert("a")
    assert arc.p < 2.0 and "a" in arc.t2
    arc.check_integrity()


def test_arc_ghost_lists_stay_bounded():
    seed = 1234
    print("seed", seed)
    rng = random.Random(seed)
    arc = ARCPolicy(8)
    _cache_run(arc, [rng.randrange(100) for _ in range(3000)])
    assert len(arc.b1) <= 8 and len(arc.b2) <= 8 and len(arc) <= 8


def test_arc_resists_a_scan_that_flushes_lru():
    hot = list(range(6))
    trace = hot * 4
    for sweep in range(5):  # a hot set reused between long one-time scans
        trace += list(range(1000 + 100 * sweep, 1000 + 100 * sweep + 40)) + hot * 2
    lru_hits = _cache_run(LRUPolicy(10), trace)
    arc_hits = _cache_run(ARCPolicy(10), trace)
    assert arc_hits > lru_hits


def test_make_policy_names():
    assert isinstance(make_policy("LRU", 4), LRUPolicy)
    assert isinstance(make_policy("arc", 4), ARCPolicy)
    with pytest.raises(ConfigError, match="unknown eviction policy"):
        make_policy("fifo", 4)
    with pytest.raises(ConfigError):
        LRUPolicy(0)
