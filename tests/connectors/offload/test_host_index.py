"""Host tier bookkeeping: capacity, visibility after store, pins against eviction."""

from __future__ import annotations

import random

import pytest

from kvbridge.connectors.offload.host_index import HostTierIndex, SlotState


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_store_is_invisible_until_ready_and_not_evictable(policy):
    index = HostTierIndex(2, policy)
    assert index.allocate(h(1), SlotState.STORING) == 0
    assert index.allocate(h(2), SlotState.STORING) == 1
    assert not index.is_ready(h(1))
    assert index.allocate(h(3), SlotState.STORING) is None  # both slots in flight
    index.mark_ready(h(1))
    assert index.is_ready(h(1))
    assert index.allocate(h(3), SlotState.STORING) == 0  # h(1) evicted, its slot reused
    assert h(1) not in index and index.num_evictions == 1
    index.check_integrity()


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_pinned_blocks_survive_eviction(policy):
    index = HostTierIndex(2, policy)
    for i in (1, 2):
        index.allocate(h(i), SlotState.STORING)
        index.mark_ready(h(i))
    slot = index.pin(h(1))
    assert index.allocate(h(3), SlotState.STORING) is not None
    assert index.is_ready(h(1)) and index.slot_of(h(1)) == slot and h(2) not in index
    assert index.allocate(h(4), SlotState.STORING) is None  # h(1) pinned, h(3) storing
    index.unpin(h(1))
    assert index.allocate(h(4), SlotState.STORING) == slot
    index.check_integrity()


def test_discard_frees_the_slot_and_lowest_slots_come_first():
    index = HostTierIndex(4)
    slots = [index.allocate(h(i), SlotState.STORING) for i in range(3)]
    assert slots == [0, 1, 2]  # contiguous runs make few DMAs
    index.discard(h(1))
    assert index.num_free_slots == 2
    assert index.allocate(h(9), SlotState.LOADING) == 1
    index.check_integrity()


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_random_operations_keep_invariants(policy):
    seed = 7
    print("seed", seed)
    rng = random.Random(seed)
    index = HostTierIndex(8, policy)
    pinned: list[bytes] = []
    for _ in range(3000):
        key = h(rng.randrange(40))
        op = rng.random()
        if op < 0.4 and key not in index:
            if index.allocate(key, rng.choice([SlotState.STORING, SlotState.LOADING])) is not None:
                assert len(index) <= 8
        elif op < 0.6 and key in index:
            index.mark_ready(key)
        elif op < 0.75 and index.is_ready(key):
            index.pin(key)
            pinned.append(key)
        elif op < 0.9 and pinned:
            index.unpin(pinned.pop(rng.randrange(len(pinned))))
        elif key in index and key not in pinned:
            index.discard(key)
        index.check_integrity()
    assert all(index.is_ready(k) for k in pinned)  # pinned blocks were never evicted
